"""Node-local tier scenarios, run on several ``torchrun`` agents of this host (``tests/multinode.py``).

Each agent is a node with its own directory (``$TRAINSTATE_NODE_DIR``); a
scenario writes ``OUT/<scenario>/rank<r>.json``. Phases run in separate
launches so that a test can lose a node's directory between them.

- ``tier_train``: 6 updates of FSDP2 training, a save every 2 (blocking; the
  replicas in the background), then the uninterrupted reference at update 10
  (``OUT/ref_full.safetensors``, ``OUT/ref_rank<r>.safetensors``);
- ``tier_resume``: restore into fresh objects built from a wrong seed, train
  to update 10, compare bitwise with the reference;
- ``tier_resume_unverified``: the same with the chunk check turned off (the
  negative control for a flipped bit in a node's copy);
- ``tier_resume_checked_first``: the same with ``restore(in_place=False)``;
- ``tier_resume_unavailable_as_damage``: ``tier_resume`` with a remote read the store did not answer counted as
  damage (the negative control of raising ``StorageUnavailable``).

Environment: ``TS_REPLICAS`` (default 2), ``TS_DOMAIN`` (a failure-domain
label for this node, optional), ``TS_WAIT_REPLICAS`` ("1": save waits),
``TRAINSTATE_TEST_S3`` (the remote tier: ``{"url", "storage_options"}``) with
``TS_MIRROR_EVERY`` (default 2).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_worker as dw  # noqa: E402

import trainstate as ts  # noqa: E402
from trainstate.storage.local import LocalStore  # noqa: E402

TOTAL, SAVED = 10, 6
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def node_dir() -> Path:
    return Path(os.environ["TRAINSTATE_NODE_DIR"])


def tiered(**kwargs) -> ts.CheckpointManager:
    remote = os.environ.get("TRAINSTATE_TEST_S3")  # {"url", "storage_options"}: the remote tier behind the nodes
    if remote:
        remote = json.loads(remote)
        kwargs.update(mirror=remote["url"], mirror_options=remote["storage_options"],
                      mirror_every=int(os.environ.get("TS_MIRROR_EVERY", "2")))
    return ts.CheckpointManager(node_dir(), keep_last=2, replicas=int(os.environ.get("TS_REPLICAS", "2")),
                                failure_domain=os.environ.get("TS_DOMAIN") or None,
                                wait_replicas=os.environ.get("TS_WAIT_REPLICAS") == "1",
                                collective_timeout_s=dw.TIMEOUT_S, **kwargs)


def _status(ckpt: ts.CheckpointManager) -> dict:
    return ckpt.status().tiers


def mode() -> str:
    return os.environ.get("TS_MODE", "fsdp")


@scenario
def tier_train(out: Path) -> dict:
    state = dw.build(mode())
    with tiered() as ckpt:
        dw.train(state, SAVED, ckpt, every=2, blocking=os.environ.get("TS_BLOCKING", "1") == "1")
        ckpt.wait()
        status = _status(ckpt)
    saved = dw.full_state(state)
    if dist.get_rank() == 0:
        save_file(saved, str(out.parent / "ref_saved.safetensors"))  # at the newest generation, for a reshard
    reference = dw.build(mode())
    dw.train(reference, TOTAL)
    full = dw.full_state(reference)
    if dist.get_rank() == 0:
        save_file(full, str(out.parent / "ref_full.safetensors"))
    save_file(dw.rank_state(reference), str(out.parent / f"ref_rank{dist.get_rank()}.safetensors"))
    dist.barrier()
    return {"tiers": status, "node_dir": str(node_dir()), "group_rank": os.environ["GROUP_RANK"]}


def _resume(out: Path, control: bool = False, **restore) -> dict:
    torch.manual_seed(999)  # the global stream is wrong until restore puts it back
    state = dw.build(mode(), seed=42)
    ckpt = tiered()
    warned = _Collect()
    logging.getLogger("trainstate").addHandler(warned)
    try:
        try:
            info = ckpt.restore(state, **restore)
        except ts.TrainStateError as exc:
            if not (control and getattr(exc, "phase", None) == "refill"):
                return {"raised": type(exc).__name__, "message": str(exc), "phase": getattr(exc, "phase", None),
                        "unusable": ts.unusable_reason(state)}
            info = None  # the control's refill checks what it writes: the unchecked bytes fail there, the load held
        at_return = _pointers_now()
        after = _status(ckpt)
    finally:
        logging.getLogger("trainstate").removeHandler(warned)
        ckpt.close()
    dw.train(state, TOTAL - state.next_update)
    want_full = load_file(str(out.parent / "ref_full.safetensors"))
    want_rank = load_file(str(out.parent / f"ref_rank{dist.get_rank()}.safetensors"))
    return {"generation": state.parent, "sources": info and info.sources,
            "rejected": [[r.generation, r.reason] for r in info.rejected] if info else [],
            "full_differs": dw.same(dw.full_state(state), want_full),
            "rank_differs": dw.same(dw.rank_state(state), want_rank), "tiers": after, "node_dir": str(node_dir()),
            "warnings": warned.messages, "at_return": at_return, "group_rank": os.environ["GROUP_RANK"]}


def _pointers_now() -> dict:
    """What this node's directory holds the moment restore returns: the generations its pointers name, and the
    manifests present (a refill still running off the restore has written none of it yet)."""
    def named(path: Path) -> str | None:
        try:
            return json.loads(path.read_text())["generation"]
        except (OSError, ValueError, KeyError):
            return None

    root = node_dir()
    return {"latest": named(root / "latest"), "replicas_latest": named(root / "replicas" / "latest"),
            "manifests": sorted(str(p.relative_to(root)) for p in root.glob("**/manifest.json")
                                if ".rejected" not in str(p))}


def _lose_node_1() -> None:
    """Node 1 comes back empty (a replacement machine) between two scenarios of one launch."""
    dist.barrier()
    if os.environ["TRAINSTATE_TEST_NODE"] == "1" and os.environ["LOCAL_RANK"] == "0":
        for path in node_dir().iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    dist.barrier()


@scenario
def tier_resume_refill_later(out: Path) -> dict:
    """The control of the refill's window: node 1 lost again and its refill run after restore returns (c81b50e ran
    it on the writer thread; here the close runs it): when restore returns, the replacement holds nothing yet."""
    from trainstate.distributed import tierload

    _lose_node_1()
    restore, close, jobs = tierload.restore, ts.CheckpointManager.close, []

    def deferred(*args, **kwargs):
        return restore(*args, refill=jobs.append, **kwargs)

    def refill_then_close(self):
        while jobs:
            jobs.pop(0)(self._session.fg)
        close(self)

    tierload.restore, ts.CheckpointManager.close = deferred, refill_then_close
    try:
        return _resume(out)
    finally:
        tierload.restore, ts.CheckpointManager.close = restore, close


@scenario
def tier_resume_refill_fails(out: Path) -> dict:
    """Node 1 lost again, and its refill cannot write (ENOSPC on node 1): restore raises on every rank, with the
    state restored and usable."""
    import errno

    from trainstate.distributed import tierload

    _lose_node_1()
    write = tierload._write_checked

    def full(staging, manifest, file, data):
        if os.environ["TRAINSTATE_TEST_NODE"] == "1":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return write(staging, manifest, file, data)

    tierload._write_checked = full
    try:
        return _resume(out)
    finally:
        tierload._write_checked = write


@scenario
def tier_resume_refilled(out: Path) -> dict:
    return _resume(out)


@scenario
def tier_fork(out: Path) -> dict:
    """A deliberate return to update 4 (restore(generation=...)), one update, a save: the run's timeline now forks
    from update 4, and the generation at 6 lies on the timeline it left."""
    state = dw.build(mode(), seed=42)
    with tiered() as ckpt:
        info = ckpt.restore(state, generation="gen-000000000004")
        dw.train(state, 1)
        saved = ckpt.save(state).name
    return {"restored": info.generation.name, "saved": saved}


@scenario
def tier_resume_after_fork(out: Path) -> dict:
    """The restart after the fork resumes gen 5, the timeline the run saved to last (its state is the
    uninterrupted run's at update 5, so training on to update 10 meets the reference), not gen 6."""
    return _resume(out)


@scenario
def tier_resume_after_fork_control(out: Path) -> dict:
    """The control: candidates newest first by update, as in c81b50e: the abandoned timeline's gen 6 is resumed."""
    from trainstate.distributed import tierload

    current_first = tierload.current_first
    tierload.current_first = lambda names, held, pointers: names
    try:
        return _resume(out)
    finally:
        tierload.current_first = current_first


class _Collect(logging.Handler):
    """The library's warnings during one restore (what it passed over, and why)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@scenario
def tier_resume(out: Path) -> dict:
    return _resume(out)


@scenario
def tier_resume_again(out: Path) -> dict:
    return _resume(out)


@scenario
def tier_resume_checked_first(out: Path) -> dict:
    """``restore(in_place=False)``: every chunk, the node's own shards too, fetched and checked before any loads."""
    return _resume(out, in_place=False)


@scenario
def tier_no_space(out: Path) -> dict:
    """A node whose disk cannot hold its share: the save is refused before anything is written, on every rank."""
    state = dw.build(mode())
    dw.train(state, 2)
    with tiered() as ckpt:
        try:
            ckpt.save(state)
            raised, message = None, ""
        except ts.TrainStateError as exc:
            raised, message = type(exc).__name__, str(exc)
    return {"raised": raised, "message": message[:600], "held": sorted(p.name for p in node_dir().iterdir()
                                                                      if not p.name.startswith(".trainstate.lock"))}


def _pins_of_own_node_only() -> None:
    """The control of ``tier_retention``: each node prunes with its own pins only (the gather kept in step)."""
    from trainstate.distributed import tierprune, tiersave
    from trainstate.lifecycle.generations import Lifecycle

    def prune(tier, key, ranks):
        ranks.all_gather({"pins": {}, "error": ""}, "prune")
        if not tier.topology.is_leader:
            return []
        if tier.lifecycle is None:
            tier.lifecycle = Lifecycle(tier.own, key)
            tier.lifecycle.structure_check = tierprune.holding_check(tier, key)
        return tierprune._prune_node(tier, key, tier.lifecycle.pins())
    tiersave.prune = prune


@scenario
def tier_retention(out: Path) -> dict:
    """retention= with tiers: updates 1-9 saved with a loss that is best at update 3, a milestone every 4 updates,
    keep_last=2, and update 5 pinned by rank 0 alone; then the best generation restored from the nodes."""
    if os.environ.get("TS_PINS_LOCAL") == "1":
        _pins_of_own_node_only()
    state = dw.build(mode())
    policy = ts.Retention(keep_last=2, milestone_every=4, best=("loss", "min"))
    with ts.CheckpointManager(node_dir(), retention=policy, replicas=2, collective_timeout_s=dw.TIMEOUT_S) as ckpt:
        for _ in range(9):
            dw.train(state, 1)
            info = ckpt.save(state, metrics={"loss": 0.1 if state.next_update == 3 else float(state.next_update)})
            if state.next_update == 5 and dist.get_rank() == 0:
                ckpt.pin("keep", info.name)
        ckpt.wait()
        held = {"own": sorted(p.name for p in node_dir().glob("gen-*")),
                "replica": sorted(p.name for p in (node_dir() / "replicas").glob("gen-*"))}
        fresh = dw.build(mode(), seed=5)
        restored = ckpt.restore(fresh, generation="gen-000000000003") if os.environ.get("TS_PINS_LOCAL") != "1" \
            else None
    return {**held, "restored": restored.generation.name if restored else None,
            "sources": restored.sources if restored else None}


def _held() -> dict:
    return {"own": sorted(p.name for p in node_dir().glob("gen-*")),
            "replica": sorted(p.name for p in (node_dir() / "replicas").glob("gen-*"))}


@scenario
def tier_prune_by_hand(out: Path) -> dict:
    """``ckpt.prune()`` in a tiered run: four generations saved with keep_last=10, the first pinned by rank 0
    alone; then, by a manager with keep_last=2, a dry run and a prune, on every rank."""
    state = dw.build(mode())

    def manager(keep_last: int) -> ts.CheckpointManager:
        return ts.CheckpointManager(node_dir(), keep_last=keep_last, replicas=2, wait_replicas=True,
                                    collective_timeout_s=dw.TIMEOUT_S)

    with manager(10) as ckpt:
        dw.train(state, 4, ckpt, every=1)
        if dist.get_rank() == 0:
            ckpt.pin("keep", "gen-000000000001")
    with manager(2) as ckpt:
        dry = ckpt.prune(dry_run=True)
        after_dry = _held()
        plan = ckpt.prune()
    return {"dry_prune": list(dry.prune), "dry_keep": list(dry.keep), "after_dry": after_dry,
            "prune": list(plan.prune), "keep": list(plan.keep), "after": _held(),
            "reasons": {d.generation: list(d.reasons) for d in plan.decisions}}


@scenario
def tier_same_update(out: Path) -> dict:
    """Saves at one update: the same state again (and ``finish``) returns the generation that holds it, writing
    nothing; a changed learning rate becomes a revision, saving that again writes nothing, and each of one changed
    element of rank 1's shard, a draw from rank 1's generator and a write through ``.data`` is a revision again."""
    state = dw.build(mode())
    dw.train(state, 2)
    names = []
    with tiered() as ckpt:
        names.append(ckpt.save(state).name)
        names.append(ckpt.save(state).name)  # unchanged
        for group in state["optimizer"].param_groups:
            group["lr"] *= 0.5
        names.append(ckpt.save(state).name)  # changed: a revision
        names.append(ckpt.save(state, blocking=False).wait().name)  # unchanged again
        with torch.no_grad():  # only a tensor's bytes change (one element of one rank's shard)
            next(state["model"].parameters()).to_local().view(-1)[:1].add_(1.0 if dist.get_rank() == 1 else 0.0)
        names.append(ckpt.save(state).name)
        if dist.get_rank() == 1:  # only rank 1's generator moves (its per-rank file changes, nothing else)
            torch.randn(1, generator=state.rngs["noise"])
        names.append(ckpt.save(state).name)
        for module in state["model"].modules():  # a write through .data on rank 0's shard of the last layer
            if isinstance(module, torch.nn.Linear) and dist.get_rank() == 0:
                module.bias.data.to_local().view(-1)[:1].mul_(2.0)
        names.append(ckpt.save(state).name)
        ckpt.finish(state)
        ckpt.wait()
        held = {"own": sorted(p.name for p in node_dir().glob("gen-*")),
                "replica": sorted(p.name for p in (node_dir() / "replicas").glob("gen-*")),
                "leftovers": ckpt.store.leftovers() + LocalStore(node_dir() / "replicas").leftovers(),
                "done": (node_dir() / "DONE").is_file(), "latest": ckpt.latest()}
    return {"names": names, **held}


@scenario
def tier_replica_fails(out: Path) -> dict:
    """Replication fails in the background (a full replicas disk): save returned, wait() raises it once, the
    replicated tier never names the generation, the local tier does."""
    state = dw.build(mode())
    dw.train(state, 2)
    with tiered() as ckpt:
        saved = ckpt.save(state).name
        raised = []
        for _ in range(2):
            try:
                ckpt.wait()
                raised.append(None)
            except ts.TrainStateError as exc:
                raised.append(f"{type(exc).__name__}: {exc}"[:600])
        status = _status(ckpt)
    return {"saved": saved, "raised": raised, "tiers": status,
            "replica_entries": sorted(p.name for p in (node_dir() / "replicas").iterdir())}


@scenario
def tier_reshard(out: Path) -> dict:
    """Restore at another world size (fewer nodes or ranks): model and optimizer reshard exactly."""
    state = dw.build(mode(), seed=42)
    with tiered() as ckpt:
        info = ckpt.restore(state, allow_changes=["world_size"])
        status = _status(ckpt)
    want = load_file(str(out.parent / "ref_saved.safetensors"))
    return {"generation": info.generation.name, "sources": info.sources, "tiers": status,
            "identical": info.identical_continuation, "full_differs": dw.same(dw.full_state(state), want)}


@scenario
def tier_resume_unverified(out: Path) -> dict:
    """The control: a chunk from any node's disk is taken without checking its digest (and nothing is repaired),
    fetched in a round or read straight from the disk as DCP loads it."""
    from trainstate.storage import chunked

    check = chunked._check  # every chunked reader's, the fetch rounds' too
    chunked._check = lambda *args: None
    try:
        return _resume(out, control=True)
    finally:
        chunked._check = check


@scenario
def tier_resume_unavailable_as_damage(out: Path) -> dict:
    """The control for a remote that does not answer: its unanswered reads counted as damage to its copy."""
    from trainstate.distributed import tierfetch

    real = tierfetch.StorageUnavailable
    tierfetch.StorageUnavailable = type("NotUnavailable", (Exception,), {})  # nothing is recognised as unanswered
    try:
        return _resume(out)
    finally:
        tierfetch.StorageUnavailable = real


if __name__ == "__main__":
    sys.exit(dw.main(SCENARIOS))
