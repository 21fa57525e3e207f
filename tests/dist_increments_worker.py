"""Multi-rank incremental generations (issue 32) under a real ``torchrun`` (run by tests/test_distributed_incremental.py).

A LoRA-shaped FSDP2 model: a frozen base (each rank's shard of it a few MiB), a trainable adapter and its Adam
moments. Reuses tests/dist_worker.py's runner and helpers; adds its own scenarios.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainstate as ts  # noqa: E402
from dist_worker import TIMEOUT_S, full_state, main, same, save_ref, scenario  # noqa: E402

FULL_EVERY = 0  # the default: each part in two copies, linked crosswise; no generation forced whole
WIDTH = int(os.environ.get("TRAINSTATE_TEST_LORA_WIDTH", "1024"))
GOLDEN_WIDTH = 768  # the golden incremental run's (a smaller fixture)


class Lora(torch.nn.Module):
    def __init__(self, width: int | None = None, rank: int = 8):
        super().__init__()
        width = width or WIDTH
        self.base = torch.nn.Linear(width, width)  # 4 MiB of weight: 2 MiB per rank at world size 2
        self.base.requires_grad_(False)
        self.down = torch.nn.Linear(width, rank, bias=False)
        self.up = torch.nn.Linear(rank, width, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def lora_state(seed: int = 0) -> ts.TrainState:
    torch.manual_seed(seed)
    model = Lora()
    fully_shard(model.base)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return ts.TrainState(model=model, optimizer=opt, scheduler=sched, contract={"config": {"lora": 8}},
                         rngs={"noise": torch.Generator().manual_seed(100 * seed + dist.get_rank())})


def lora_step(state: ts.TrainState) -> None:
    g = state.rngs["noise"]
    x = torch.randn(4, WIDTH, generator=g)
    loss = ((state["model"](x) - x) ** 2).mean()
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["scheduler"].step()
    state.next_update += 1


def _own_parts(run: Path, name: str) -> dict[str, int]:
    """This rank's part files and their spares in generation ``name``, by inode (the same inode: the same stored
    bytes)."""
    rank = dist.get_rank()
    return {p.name: p.stat().st_ino for p in sorted((run / name).glob(f"shard-{rank:05d}-part-*"))}


def _manifest(run: Path, name: str) -> dict:
    return json.loads((run / name / "manifest.json").read_text())


def _write_frozen(state: ts.TrainState) -> None:
    """A write to the frozen base on rank 1 only, through ``.data`` of its local shard (no version counter moves)."""
    if dist.get_rank() == 1:
        with torch.no_grad():
            state["model"].base.weight.to_local().data[0, 0] += 1.0


def _run(out: Path) -> dict:
    run = out / "run"
    state = lora_state()
    names, parts, sizes = [], [], []
    with ts.CheckpointManager(run, keep_last=10, full_every=FULL_EVERY, collective_timeout_s=TIMEOUT_S) as ckpt:
        for update in range(7):
            lora_step(state)
            if update == 6:
                _write_frozen(state)
            names.append(ckpt.save(state).name)
            if update == 5:
                save_ref(out / "gen6.safetensors", full_state(state))
            manifest = _manifest(run, names[-1])
            parts.append(_own_parts(run, names[-1]))
            sizes.append([sum(f["size"] for f in manifest["files"] if f["name"] not in manifest.get("shares", {})),
                          sum(f["size"] for f in manifest["files"])])
        live = full_state(state)
        save_ref(out / "live.safetensors", live)
    fresh = lora_state(seed=5)
    with ts.CheckpointManager(run, collective_timeout_s=TIMEOUT_S) as ckpt:
        info = ckpt.restore(fresh)
    shares = _manifest(run, names[-1]).get("shares", {})
    return {"rank": dist.get_rank(), "names": names, "parts": parts, "sizes": sizes, "shares": shares,
            "restored": info.generation.name, "differs": same(full_state(fresh), live),
            "format": _manifest(run, names[-1])["format_version"]}


@scenario
def incremental(out: Path) -> dict:
    """Seven saves with the defaults; the seventh after a write to rank 1's frozen shard; a restore of the last."""
    return _run(out)


@scenario
def incremental_missed(out: Path) -> dict:
    """The control: a change detector that remembers each item's first fingerprint (a cheap signal that misses a
    write through ``.data``) links rank 1's changed part, and the restore differs from the live state."""
    import types

    from trainstate.lifecycle import incremental

    first: dict[str, object] = {}
    real = incremental.changes.fingerprints

    def stale(tensors, *args, **kwargs):
        now = real(tensors, *args, **kwargs)
        return {n: first.setdefault(n, fp) for n, fp in now.items()}

    incremental.changes = types.SimpleNamespace(**{**vars(incremental.changes), "fingerprints": stale})
    try:
        return _run(out)
    finally:
        incremental.changes = sys.modules["trainstate.state.changes"]


def _copy_keeping_links(source: Path, target: Path) -> None:
    """A copy of a run directory in which the files one inode names in ``source`` share one inode too."""
    copies: dict[int, str] = {}

    def copy(src: str, dst: str) -> None:
        inode = os.stat(src).st_ino
        if inode in copies:
            os.link(copies[inode], dst)
        else:
            shutil.copy2(src, dst)
            copies[inode] = dst

    shutil.copytree(source, target, copy_function=copy)


@scenario
def incremental_damaged(out: Path) -> dict:
    """One flipped bit in the copy of rank 0's base that gen 7 reads (which gens 1, 3 and 5 read too, and gens 2,
    4 and 6 keep as their spare): the restore falls back past gen 7 to gen 6, which reads the other copy;
    ``trainstate verify`` names each generation that lists the damaged copy."""
    source = out.parent / "incremental"
    run = out / "run"
    if dist.get_rank() == 0:
        _copy_keeping_links(source / "run", run)
        names = sorted(p.name for p in run.glob("gen-*"))
        part = next(p for p in (run / names[6]).glob("shard-00000-part-*.safetensors"))
        data = bytearray(part.read_bytes())
        data[-5] ^= 0x04
        os.chmod(part, 0o644)
        with open(part, "r+b") as stream:  # in place: every generation naming this inode sees the flip
            stream.write(bytes(data))
    dist.barrier()
    fresh = lora_state(seed=7)
    with ts.CheckpointManager(run, collective_timeout_s=TIMEOUT_S) as ckpt:
        info = ckpt.restore(fresh)
    want = load_file(str(source / "gen6.safetensors"))
    result = {"restored": info.generation.name, "rejected": [r.generation for r in info.rejected],
              "differs": same(full_state(fresh), want)}
    if dist.get_rank() == 0:
        import io
        from contextlib import redirect_stdout

        from trainstate import cli

        printed = io.StringIO()
        with redirect_stdout(printed):
            result["verify_exit"] = cli.main(["verify", str(run), "--json"])
        result["verify"] = printed.getvalue()
    return result


@scenario
def incremental_reshard(out: Path) -> dict:
    """At another world size: the incremental run restores bitwise (allow_changes), then saves three times: the
    first writes every item into the shard of what changed (the parent's items had other shapes), the second
    splits the unchanged base into a part and its spare, the third links them crosswise."""
    source = Path(os.environ["TRAINSTATE_TEST_SOURCE"]) / "incremental"
    run = out / "run"
    if dist.get_rank() == 0:
        shutil.copytree(source / "run", run)
    dist.barrier()
    fresh = lora_state(seed=9)
    with ts.CheckpointManager(run, keep_last=10, full_every=FULL_EVERY, collective_timeout_s=TIMEOUT_S) as ckpt:
        info = ckpt.restore(fresh, allow_changes=["world_size"])
        result = {"restored": info.generation.name,
                  "differs": same(full_state(fresh), load_file(str(source / "live.safetensors")))}
        names, parts = [], []
        for _ in range(3):
            lora_step(fresh)
            names.append(ckpt.save(fresh).name)
            parts.append(_own_parts(run, names[-1]))
    return {**result, "names": names, "parts": parts, "shares": _manifest(run, names[-1]).get("shares", {})}


@scenario
def incremental_objects(out: Path) -> dict:
    """On an S3 URL (``TRAINSTATE_TEST_S3``): a linked part is a server-side copy, so a steady save uploads what
    changed only (counted at each rank's client); the restore of the newest is bitwise."""
    from trainstate.storage.objectclient import Client

    remote = json.loads(os.environ["TRAINSTATE_TEST_S3"])
    from objectservers import counted_puts

    uploaded: list[int] = []
    real = Client.put_stream
    Client.put_stream = counted_puts(uploaded)
    state, names = lora_state(), []
    try:
        with ts.CheckpointManager(remote["url"], storage_options=remote["storage_options"], keep_last=5,
                                  full_every=FULL_EVERY, collective_timeout_s=TIMEOUT_S) as ckpt:
            for _ in range(4):
                lora_step(state)
                uploaded.append(0)
                names.append(ckpt.save(state).name)
    finally:
        Client.put_stream = real
    live = full_state(state)
    fresh = lora_state(seed=6)
    with ts.CheckpointManager(remote["url"], storage_options=remote["storage_options"],
                              collective_timeout_s=TIMEOUT_S) as ckpt:
        info = ckpt.restore(fresh)
    return {"names": names, "uploaded": uploaded, "restored": info.generation.name, "held": _held(remote),
            "differs": same(full_state(fresh), live)}


def _held(remote: dict) -> int:
    """The bytes the remote run holds (every object listed)."""
    from trainstate.storage.objects import ObjectStore

    return sum(ObjectStore(remote["url"], storage_options=remote["storage_options"]).client.listing("").values())


def _tiered() -> ts.CheckpointManager:
    return ts.CheckpointManager(os.environ["TRAINSTATE_NODE_DIR"], keep_last=10, replicas=2, full_every=FULL_EVERY,
                                wait_replicas=True, collective_timeout_s=TIMEOUT_S)


def _tier_parts(name: str) -> dict[str, int]:
    """Every rank's part files this node holds in ``name`` (its own, and the replicas it keeps), by inode."""
    node = Path(os.environ["TRAINSTATE_NODE_DIR"])
    return {f"{p.parent.parent.name}/{p.name}": p.stat().st_ino for p in sorted(
        [*(node / name).glob("shard-*-part-*"), *(node / "replicas" / name).glob("shard-*-part-*")])}


def _flip(path: Path) -> None:
    """One bit flipped in place near the end of ``path`` (every generation naming its inode sees it)."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as stream:
        stream.seek(-5, os.SEEK_END)
        byte = stream.read(1)[0]
        stream.seek(-5, os.SEEK_END)
        stream.write(bytes([byte ^ 0x04]))


@scenario
def tier_incremental(out: Path) -> dict:
    """Node-local tiers (a node per rank, replicas=2): five saves link each node's own part and spare within its
    own directory, and its peer's within its replicas (the bytes each save's replication receives counted);
    before the fourth, one bit of the replica copy it would link as its part is flipped (so that copy is sent
    again); a restore from the node's own disk is bitwise."""
    from trainstate.distributed import tiersave

    state = lora_state()
    names, parts, received = [], [], []
    real = tiersave._receive

    def counted(size, sender, ranks):
        received[-1] += size
        return real(size, sender, ranks)

    tiersave._receive = counted
    try:
        with _tiered() as ckpt:
            for save in range(5):
                if save == 3:  # damage the copy of the peer's base that gen 4's replica would link as its part
                    _flip(next((Path(os.environ["TRAINSTATE_NODE_DIR"]) / "replicas" / names[2]).glob("*.spare")))
                lora_step(state)
                received.append(0)
                names.append(ckpt.save(state).name)
                parts.append(_tier_parts(names[-1]))
    finally:
        tiersave._receive = real
    save_ref(out.parent / "tier_live.safetensors", full_state(state))
    fresh = lora_state(seed=3)
    with _tiered() as ckpt:
        info = ckpt.restore(fresh)
    return {"names": names, "parts": parts, "restored": info.generation.name, "sources": info.sources,
            "received": received,
            "differs": same(full_state(fresh), load_file(str(out.parent / "tier_live.safetensors")))}


@scenario
def tier_incremental_refilled(out: Path) -> dict:
    """After node 1 lost its directory: its part comes from node 0's replica (verified), bitwise; the next two
    saves on the refilled node link what it was refilled with."""
    fresh = lora_state(seed=4)
    with _tiered() as ckpt:
        info = ckpt.restore(fresh)
        differs = same(full_state(fresh), load_file(str(out.parent / "tier_live.safetensors")))
        names, parts = [], []
        for _ in range(2):
            lora_step(fresh)
            names.append(ckpt.save(fresh).name)
            parts.append(_tier_parts(names[-1]))
    return {"restored": info.generation.name, "sources": info.sources, "differs": differs, "names": names,
            "parts": parts, "shares": _manifest(Path(os.environ["TRAINSTATE_NODE_DIR"]), names[-1]).get("shares")}


@scenario
def tier_incremental_remote(out: Path) -> dict:
    """Node-local tiers with the object store behind them (every generation uploaded, ``TRAINSTATE_TEST_S3``):
    a part the remote already holds is a server-side copy, so a steady upload sends what changed only (counted at
    each rank's client); then every node's directory is lost and the run restores from the remote alone."""
    from objectservers import counted_puts
    from trainstate.storage.objectclient import Client

    remote = json.loads(os.environ["TRAINSTATE_TEST_S3"])
    node = Path(os.environ["TRAINSTATE_NODE_DIR"])

    def manager() -> ts.CheckpointManager:
        return ts.CheckpointManager(node, keep_last=10, replicas=2, full_every=FULL_EVERY, wait_replicas=True,
                                    mirror=remote["url"], mirror_options=remote["storage_options"], mirror_every=1,
                                    collective_timeout_s=TIMEOUT_S)

    uploaded: list[int] = []
    real = Client.put_stream
    Client.put_stream = counted_puts(uploaded)
    state = lora_state()
    try:
        with manager() as ckpt:
            for _ in range(4):
                lora_step(state)
                uploaded.append(0)
                ckpt.save(state)
                ckpt.wait()  # this generation's upload, counted as this save's
    finally:
        Client.put_stream = real
    live = full_state(state)
    held = _held(remote)
    dist.barrier()
    shutil.rmtree(node)  # every node lost: the remote alone
    dist.barrier()
    fresh = lora_state(seed=8)
    with manager() as ckpt:
        info = ckpt.restore(fresh)
    return {"uploaded": uploaded, "restored": info.generation.name, "sources": info.sources, "held": held,
            "differs": same(full_state(fresh), live)}


def _reference(updates: int) -> dict[str, torch.Tensor]:
    """The state of an uninterrupted run after ``updates`` (the golden run's, recomputed: CPU and gloo are exact)."""
    state = lora_state()
    for _ in range(updates):
        lora_step(state)
    return full_state(state)


@scenario
def golden_incremental_write(out: Path) -> dict:
    """Writes tests/golden/multirank-incremental-v4-82a1efe (run once, by the code at 82a1efe, before a shard's
    parts had spares; ``TRAINSTATE_TEST_LORA_WIDTH=768``, ``GOLDEN_WIDTH``): three saves with the defaults of then (gen 2 lays each
    rank's base out in one part, gen 3 links it); only gen 3 is kept."""
    state = lora_state()
    run = out / "run"
    with ts.CheckpointManager(run, keep_last=1, collective_timeout_s=TIMEOUT_S) as ckpt:
        for _ in range(3):
            lora_step(state)
            ckpt.save(state)
    return {}


@scenario
def golden_incremental_read(out: Path) -> dict:
    """The golden incremental run (``tests/golden/multirank-incremental-v4-82a1efe``, format 4, no spares, a copy)
    restores bitwise, continues
    and saves three times: the first writes each rank's part afresh and keeps the old one as its spare, the next
    two link them crosswise; the newest restores bitwise."""
    global WIDTH
    width, WIDTH = WIDTH, GOLDEN_WIDTH
    try:
        return _golden_read(out)
    finally:
        WIDTH = width


def _golden_read(out: Path) -> dict:
    run = out / "run"
    if dist.get_rank() == 0:
        shutil.copytree(Path(__file__).resolve().parent / "golden" / "multirank-incremental-v4-82a1efe" / "run", run)
    dist.barrier()
    before = _own_parts(run, "gen-000000000003")
    fresh = lora_state(seed=5)
    names, parts = [], []
    with ts.CheckpointManager(run, keep_last=10, collective_timeout_s=TIMEOUT_S) as ckpt:
        info = ckpt.restore(fresh)
        restored = same(full_state(fresh), _reference(3))
        for _ in range(3):
            lora_step(fresh)
            names.append(ckpt.save(fresh).name)
            parts.append(_own_parts(run, names[-1]))
    continued = same(full_state(fresh), _reference(6))
    again = lora_state(seed=6)
    with ts.CheckpointManager(run, collective_timeout_s=TIMEOUT_S) as ckpt:
        newest = ckpt.restore(again).generation.name
    return {"restored": info.generation.name, "restored_differs": restored, "continued_differs": continued,
            "names": names, "before": before, "parts": parts, "newest": newest,
            "newest_differs": same(full_state(again), full_state(fresh)),
            "formats": [_manifest(run, n)["format_version"] for n in ["gen-000000000003", *names]]}


if __name__ == "__main__":
    sys.exit(main())
