"""Multi-rank scenarios, run under a real ``torchrun`` (gloo on CPU) by ``tests/test_distributed*.py``.

``python -m torch.distributed.run --nproc_per_node N tests/dist_worker.py OUT SCENARIO [SCENARIO ...]``

Each scenario runs on every rank, in order, in ``OUT/<scenario>/``, and
writes what it observed to ``OUT/<scenario>/rank<r>.json``; the pytest side
reads those. Reference tensors are written with safetensors (never pickle).
Several scenarios share one launch because each launch costs seconds.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainstate as ts  # noqa: E402

TIMEOUT_S = float(os.environ.get("TRAINSTATE_TEST_TIMEOUT", "60"))
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


# the training setup ------------------------------------------------------------------------------------
class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int = 96):
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        noise = torch.randn(8, generator=ts.sample_generator(index)) * 0.05
        return self.x[index] + noise, self.y[index]


def wrap(model: torch.nn.Sequential, mode: str) -> torch.nn.Module:
    """FSDP2 (each Linear, then the whole) or DDP."""
    if mode != "fsdp":
        return torch.nn.parallel.DistributedDataParallel(model)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def build(mode: str, seed: int = 0, batch: int = 4, loader: bool = True) -> ts.TrainState:
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                     torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    components = {"model": model, "optimizer": opt, "scheduler": sched}
    if loader:
        components["data"] = ts.ResumableLoader(Noisy(), batch_size=batch, seed=11)
    return ts.TrainState(rngs={"noise": torch.Generator().manual_seed(1000 * seed + 17 + rank)},
                         contract={"config": {"mode": mode}}, **components)


def step(state: ts.TrainState, batches=None) -> None:
    model, opt = state["model"], state["optimizer"]
    if batches is not None:
        x, y = next(batches)
    else:
        g = state.rngs["noise"]
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    x = x + torch.randn(x.shape, generator=state.rngs["noise"]) * 0.01
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    state["scheduler"].step()
    state.next_update += 1


def train(state: ts.TrainState, updates: int, ckpt=None, every: int = 0, blocking: bool = True) -> None:
    """Train ``updates`` updates through the loader (epochs roll over), saving every ``every``."""
    loader = state.components.get("data")
    done = 0
    while done < updates:
        batches = iter(loader) if loader is not None else None
        for _ in range(len(loader) - loader.cursor if loader is not None else updates - done):
            step(state, batches)
            done += 1
            if ckpt is not None and every and state.next_update % every == 0:
                ckpt.save(state, blocking=blocking)
            if done == updates:
                break


def full_state(state: ts.TrainState) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, gathered to full tensors (a collective), plus scalars as tensors."""
    model, opt = state["model"], state["optimizer"]
    out = {}
    for key, value in get_model_state_dict(model).items():
        out[f"model.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
    osd = get_optimizer_state_dict(model, opt)
    for key, entry in osd["state"].items():
        for name, value in entry.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"optim.{key}.{name}"] = value.detach().clone() if isinstance(value, torch.Tensor) else \
                torch.tensor(value)
    out["sched.last_epoch"] = torch.tensor(state["scheduler"].last_epoch)
    out["clock"] = torch.tensor(state.next_update)
    return {k: v.contiguous() for k, v in out.items()}


def rank_state(state: ts.TrainState) -> dict[str, torch.Tensor]:
    """This rank's own streams: the next draws of its generators and the next batch's sample ids."""
    out = {"noise": torch.randn(5, generator=torch.Generator().set_state(state.rngs["noise"].get_state())),
           "torch_global": torch.get_rng_state()}
    loader = state.components.get("data")
    if loader is not None:
        out["next_ids"] = torch.as_tensor(loader.epoch_batches(loader.epoch)[loader.cursor]).to(torch.int64)
        out["position"] = torch.tensor([loader.epoch, loader.cursor, loader.start])
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def manager(directory: Path, **kwargs) -> ts.CheckpointManager:
    if os.environ.get("TRAINSTATE_TEST_FULL_EVERY") == "none":  # every save whole: DCP's metadata by rule
        kwargs.setdefault("full_every", None)
    return ts.CheckpointManager(directory, collective_timeout_s=TIMEOUT_S, **kwargs)


def save_ref(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    if dist.get_rank() == 0:
        save_file(tensors, str(path))
    dist.barrier()


# scenarios ----------------------------------------------------------------------------------------------
def _roundtrip_save(out: Path, mode: str) -> dict:
    state = build(mode)
    with manager(out / f"run-{mode}") as ckpt:
        train(state, 5)
        ckpt.save(state)
    reference = full_state(state)
    save_ref(out / f"ref-{mode}.safetensors", reference)
    fresh = build(mode, seed=3)
    with manager(out / f"run-{mode}") as ckpt:
        info = ckpt.restore(fresh, allow_changes=["world_size"])
    metadata = json.loads((out / f"run-{mode}" / info.generation.name / "dcp-metadata.json").read_bytes())
    return {"saved_world": dist.get_world_size(), "differs": same(full_state(fresh), reference),
            "generation": info.generation.name, "identical": info.identical_continuation,
            "by_rule": "rule" in metadata}


def _frozen_base(seed: int = 0) -> ts.TrainState:
    """FSDP2: a frozen Linear(1024, 1024) (2 MiB of each rank's shard at 2 ranks: a part once it is seen unchanged)
    and a trained head."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4))
    model[0].requires_grad_(False)
    model = wrap(model, "fsdp")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return ts.TrainState(model=model, optimizer=opt, contract={"config": {"mode": "frozen"}},
                         rngs={"noise": torch.Generator().manual_seed(seed + 17 + dist.get_rank())})


@scenario
def rule_incremental(out: Path) -> dict:
    """Incremental saves (``full_every=8``, the default, whatever $TRAINSTATE_TEST_FULL_EVERY says) by rule while
    every rank's shard is one file; listed once a frozen block is laid out in a part (control). Rank 0 keeps its
    own fingerprints, as every rank does, though a generation by rule records none (its second save lays the
    frozen block out in a part, like the others'), and a restarted manager's first save, which has none, writes
    its shard whole, by rule. Each restore bitwise."""
    result: dict = {}

    def metadata(run: Path, name: str) -> dict:
        return json.loads((run / name / "dcp-metadata.json").read_bytes())

    changing, run = build("fsdp", loader=False), out / "changing"
    names = []
    with manager(run, keep_last=10, full_every=8) as ckpt:
        for _ in range(3):
            train(changing, 2)
            names.append(ckpt.save(changing).name)
    with manager(run, keep_last=10, full_every=8) as ckpt:  # a restarted process's first save: no fingerprints kept, none in the manifest
        train(changing, 1)
        names.append(ckpt.save(changing).name)
    reference = full_state(changing)
    fresh = build("fsdp", seed=5, loader=False)
    with manager(run, keep_last=10, full_every=8) as ckpt:
        ckpt.restore(fresh)
    result["changing_by_rule"] = ["rule" in metadata(run, n) for n in names]
    result["changing_prints"] = [bool(json.loads((run / n / "manifest.json").read_bytes()).get("fingerprints"))
                                 for n in names]
    result["changing_differs"] = same(full_state(fresh), reference)

    from trainstate.distributed import capture

    hint = capture.frozen_names
    capture.frozen_names = lambda state: frozenset()  # no requires_grad hint: the part is found at save 2
    try:
        result.update(_frozen_run(out / "frozen", metadata))
    finally:
        capture.frozen_names = hint
    result.update({f"hinted_{k}": v for k, v in _frozen_run(out / "hinted", metadata).items()})
    return result


def _frozen_run(run: Path, metadata: Any) -> dict:
    frozen, names = _frozen_base(), []
    with manager(run, keep_last=10, full_every=8) as ckpt:
        for _ in range(3):
            _sized_steps(frozen, 1, inputs=(4, 1024))
            names.append(ckpt.save(frozen).name)
    reference = full_state_of(frozen)
    fresh = _frozen_base(seed=9)
    with manager(run, keep_last=10, full_every=8) as ckpt:
        ckpt.restore(fresh)
    result = {"frozen_by_rule": ["rule" in metadata(run, n) for n in names]}
    listed = [json.loads((run / n / "manifest.json").read_bytes()) for n in names]
    result["rank_parts"] = [[r for r in range(dist.get_world_size())
                             if any(f["name"].startswith(f"shard-{r:05d}-part-") for f in m["files"])] for m in listed]
    result["frozen_shares"] = [len(m.get("shares", {})) for m in listed]
    result["frozen_differs"] = same(full_state_of(fresh), reference)
    return result


@scenario
def roundtrip_save_ddp(out: Path) -> dict:
    return _roundtrip_save(out, "ddp")


@scenario
def roundtrip_save_fsdp(out: Path) -> dict:
    return _roundtrip_save(out, "fsdp")


def _roundtrip_load(out: Path, mode: str) -> dict:
    """Restore what another launch (another world size) saved into ``TRAINSTATE_TEST_SOURCE``."""
    source = Path(os.environ["TRAINSTATE_TEST_SOURCE"]) / f"roundtrip_save_{mode}"
    reference = load_file(str(source / f"ref-{mode}.safetensors"))
    fresh = build(mode, seed=5)
    with manager(source / f"run-{mode}") as ckpt:
        try:
            ckpt.restore(fresh)
            refused = None
        except ts.ContractMismatch as exc:
            refused = [c.field for c in exc.changes]
        info = ckpt.restore(fresh, allow_changes=["world_size"])
    return {"refused_without_allow": refused, "differs": same(full_state(fresh), reference),
            "identical": info.identical_continuation, "warnings": list(info.warnings),
            "loader": [fresh["data"].epoch, fresh["data"].cursor, fresh["data"].start]}


@scenario
def roundtrip_load_ddp(out: Path) -> dict:
    return _roundtrip_load(out, "ddp")


@scenario
def roundtrip_load_fsdp(out: Path) -> dict:
    return _roundtrip_load(out, "fsdp")


@scenario
def exact_resume(out: Path) -> dict:
    """Uninterrupted vs saved-and-restored-into-fresh-objects, FSDP2, dropout, per-rank RNG, sharded loader."""
    total, cut = 14, 9
    reference = build("fsdp")
    train(reference, total)
    want_full, want_rank = full_state(reference), rank_state(reference)
    first = build("fsdp")
    with manager(out / "run") as ckpt:
        train(first, cut)
        ckpt.save(first)
    del first
    torch.manual_seed(999)  # the global stream is wrong until restore puts it back
    resumed = build("fsdp", seed=42)
    with manager(out / "run") as ckpt:
        info = ckpt.restore(resumed)
    right_after = full_state(resumed)
    train(resumed, total - cut)
    got_full, got_rank = full_state(resumed), rank_state(resumed)
    # negative control: the same resume with two ranks' RNG records swapped; a model-only comparison misses it
    swapped = build("fsdp", seed=43)
    with manager(out / "run") as ckpt:
        ckpt.restore(swapped)
    model_only_equal = not same(full_state(swapped), right_after)
    states = [torch.empty_like(swapped.rngs["noise"].get_state()) for _ in range(dist.get_world_size())]
    dist.all_gather(states, swapped.rngs["noise"].get_state())
    swapped.rngs["noise"].set_state(states[(dist.get_rank() + 1) % dist.get_world_size()])
    train(swapped, total - cut)
    return {"generation": info.generation.name, "identical": info.identical_continuation,
            "full_differs": same(got_full, want_full), "rank_differs": same(got_rank, want_rank),
            "control_model_only_equal": model_only_equal,
            "control_rank_differs": same(rank_state(swapped), want_rank),
            "control_full_differs": same(full_state(swapped), want_full)}


@scenario
def bit_flip(out: Path) -> dict:
    state = build("fsdp")
    with manager(out / "run", keep_last=5) as ckpt:
        train(state, 3)
        ckpt.save(state)
        older = full_state(state)
        train(state, 2)
        ckpt.save(state)
    if dist.get_rank() == 0:
        shard = out / "run" / "gen-000000000005" / "shard-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    fresh = build("fsdp", seed=8)
    with manager(out / "run") as ckpt:
        info = ckpt.restore(fresh)
    result = {"generation": info.generation.name, "rejected": [r.generation for r in info.rejected],
              "differs": same(full_state(fresh), older)}
    if dist.get_rank() == 0:  # now damage the older one too: nothing verifies, nothing loads
        shard = out / "run" / "gen-000000000003" / "shard-00000.safetensors"
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    # one pass (the default): shards are verified as they load, so verified chunks of a generation that then
    # fails may already be in live tensors: the state is then unusable and saves refuse it
    untouched = build("fsdp", seed=9)
    before = full_state(untouched)
    with manager(out / "run") as ckpt:
        try:
            ckpt.restore(untouched)
            result["none_valid"] = "restored"
        except ts.NoValidGeneration as exc:
            result["none_valid"] = [r.generation for r in exc.rejections]
            result["unusable"] = exc.unusable is not None
        try:
            ckpt.save(untouched)
            result["save_refused"] = False
        except ts.StateUnusable:
            result["save_refused"] = True
    result["untouched_differs"] = same(full_state(untouched), before)
    # in_place=False: every shard digested before anything loads: not one live tensor changes
    untouched = build("fsdp", seed=9)
    with manager(out / "run") as ckpt:
        try:
            ckpt.restore(untouched, in_place=False)
            result["two_pass"] = "restored"
        except ts.NoValidGeneration as exc:
            result["two_pass"] = [r.generation for r in exc.rejections]
            result["two_pass_unusable"] = exc.unusable is not None
    result["two_pass_differs"] = same(full_state(untouched), before)
    return result


@scenario
def missing_file(out: Path) -> dict:
    """A restore holds open only this rank's share of the files (plus what it reads), not every file of the
    generation on every rank; a file gone from the newest generation, whichever rank's, is still found before
    anything loads (its share's rank), and every rank falls back to the one before, bitwise."""
    from trainstate.restore import HeldFiles

    rank, world, result = dist.get_rank(), dist.get_world_size(), {}
    for lost in range(world):
        run = out / f"run-{lost}"
        state = build("fsdp")
        with manager(run, keep_last=5) as ckpt:
            train(state, 3)
            ckpt.save(state)
            older = full_state(state)
            train(state, 2)
            ckpt.save(state)
        newest = full_state(state)
        opened: list[str] = []
        real = HeldFiles.open
        HeldFiles.open = lambda self, generation, file: (opened.append(file), real(self, generation, file))[1]
        try:
            fresh = build("fsdp", seed=8)
            with manager(run) as ckpt:
                ckpt.restore(fresh)
        finally:
            HeldFiles.open = real
        result[f"whole-{lost}"] = same(full_state(fresh), newest)
        result[f"others-{lost}"] = sorted({f for f in opened if f.startswith("rank-") and f != f"rank-{rank:05d}.json"
                                           and not f.startswith(f"rank-{rank:05d}.")})
        if rank == 0:
            (run / "gen-000000000005" / f"shard-{lost:05d}.safetensors").unlink()
        dist.barrier()
        fresh = build("fsdp", seed=8)
        with manager(run) as ckpt:
            info = ckpt.restore(fresh)
            result[f"usable-{lost}"] = ckpt.save(fresh) is not None  # nothing loaded from the damaged one
        result[f"generation-{lost}"] = info.generation.name
        result[f"rejected-{lost}"] = [r.generation for r in info.rejected]
        result[f"differs-{lost}"] = same(full_state(fresh), older)
    return result


@scenario
def no_pickle(out: Path) -> dict:
    """A restore runs with pickle.load, pickle.loads and torch.load forbidden; a crafted metadata file is just
    corrupt; the stock DCP reader trips the same guard (the control)."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from test_hostile import reseal

    state = build("fsdp")
    with manager(out / "run") as ckpt:
        train(state, 3)
        ckpt.save(state)
    saved = full_state(state)
    dcp.save({"model": get_model_state_dict(state["model"])}, checkpoint_id=str(out / "stock"))
    if dist.get_rank() == 0:  # a second run whose only generation carries a crafted (pickle) metadata file
        import shutil
        shutil.copytree(out / "run", out / "crafted")
        gen = out / "crafted" / "gen-000000000003"
        (gen / "dcp-metadata.json").write_bytes(pickle.dumps({"a": 1}))
        reseal(out / "crafted", "gen-000000000003")
    dist.barrier()
    tripped = []
    originals = (pickle.load, pickle.loads, torch.load, torch.serialization.load)

    def forbidden(name):
        def guard(*args, **kwargs):
            tripped.append(name)
            raise AssertionError(f"{name} called during a restore")
        return guard

    pickle.load, pickle.loads = forbidden("pickle.load"), forbidden("pickle.loads")
    torch.load = torch.serialization.load = forbidden("torch.load")
    try:
        fresh = build("fsdp", seed=4)
        with manager(out / "run") as ckpt:
            ckpt.restore(fresh)
        ours = list(tripped)
        with manager(out / "crafted") as ckpt:
            try:
                ckpt.restore(build("fsdp", seed=5))
                crafted = "restored"
            except ts.NoValidGeneration as exc:
                crafted = [r.reason for r in exc.rejections]
        crafted_tripped = list(tripped)
        try:
            dcp.load({"model": get_model_state_dict(build("fsdp", seed=6)["model"])}, checkpoint_id=str(out / "stock"))
            stock = "loaded without the guard"
        except BaseException as exc:  # CheckpointException derives from BaseException
            stock = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        pickle.load, pickle.loads, torch.load, torch.serialization.load = originals
    return {"differs": same(full_state(fresh), saved), "tripped_by_ours": ours, "crafted": crafted,
            "tripped_by_crafted": crafted_tripped, "stock": stock, "tripped_by_stock": sorted(set(tripped))}


def _leftovers(run: Path) -> list[str]:
    return sorted(n for n in os.listdir(run) if n.startswith(".trainstate-staging") or n.startswith(".trainstate-trash"))


@scenario
def replica_divergence(out: Path) -> dict:
    state = build("ddp")
    with manager(out / "run") as ckpt:
        train(state, 2)
        ckpt.save(state)
        if dist.get_rank() == 1:
            with torch.no_grad():
                next(state["model"].parameters()).add_(1e-3)  # one replica drifts
        train(state, 1)
        try:
            ckpt.save(state)
            outcome = "saved"
        except ts.TrainStateError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        latest = ckpt.latest()
    dist.barrier()
    return {"outcome": outcome, "latest": latest, "leftovers": _leftovers(out / "run")}


def _same_update_changes(state: ts.TrainState) -> dict:
    """Issue 29 item 1: changes a script makes without advancing next_update, one kind at a time."""
    model, opt = state["model"], state["optimizer"]
    first_param = next(model.parameters())

    def weights():
        with torch.no_grad():
            first_param.add_(1.0)  # FSDP2: a DTensor, every rank's local shard changes

    def moment():
        opt.state[first_param]["exp_avg"].mul_(2.0)

    def rng_rank1():
        if dist.get_rank() == 1:  # only rank 1's own file differs: rank 0's state.json cannot show it
            torch.randn(3, generator=state.rngs["noise"])

    def buffer_free_position():
        if dist.get_rank() == 1:
            state["data"].cursor += 1  # rank 1's loader position alone

    return {"weights": weights, "moment": moment, "rng on rank 1": rng_rank1, "position on rank 1": buffer_free_position}


@scenario
def existing_generation(out: Path) -> dict:
    state = build("fsdp")
    names = {}
    with manager(out / "run") as ckpt:
        train(state, 2)
        first = ckpt.save(state)
        again = ckpt.save(state)  # the same state at the same update: a no-op
        for kind, change in _same_update_changes(state).items():
            change()
            names[kind] = ckpt.save(state).name
        names["same again"] = ckpt.save(state).name
        want_full, want_rank = full_state(state), rank_state(state)
        state["optimizer"].param_groups[0]["lr"] = 0.5  # changed without advancing next_update: a revision
        try:
            outcome = f"saved {ckpt.save(state).name}"
        except ts.TrainStateError as exc:
            outcome = type(exc).__name__
        latest = ckpt.latest()
    fresh = build("fsdp", seed=6)
    with manager(out / "run") as ckpt:
        ckpt.restore(fresh, generation=names["same again"])
    dist.barrier()
    return {"noop_same": again == first, "outcome": outcome, "latest": latest, "names": names,
            "full_differs": same(full_state(fresh), want_full), "rank_differs": same(rank_state(fresh), want_rank),
            "leftovers": _leftovers(out / "run")}


def _raise_in(target: str, rank: int):
    """Patch one step of the save to raise on ``rank`` (a real exception in a real process)."""
    from trainstate.distributed import storage

    if target == "write":
        real = storage.Writer.write_data

        def write_data(self, plan, planner):
            if self.rank == rank:
                raise OSError(5, f"injected EIO in write_data on rank {rank}")
            return real(self, plan, planner)
        storage.Writer.write_data = write_data
        return lambda: setattr(storage.Writer, "write_data", real)
    real = storage.Writer.finish_data  # rank 0's finish, listed or by rule

    def finish_data(self, data, shards, fields):
        raise OSError(5, "injected EIO in finish")
    storage.Writer.finish_data = finish_data
    return lambda: setattr(storage.Writer, "finish_data", real)


@scenario
def raised_faults(out: Path) -> dict:
    """A failure in write (rank 0, rank 1) or finish: no generation, pointer unchanged, every rank raises a
    typed error, and the next save cleans up."""
    results = {}
    for fault, rank in (("write", 0), ("write", 1), ("finish", 0)):
        run = out / f"{fault}-{rank}"
        state = build("fsdp")
        with manager(run) as ckpt:
            train(state, 2)
            ckpt.save(state)
            pointer = (run / "latest").read_bytes()
            undo = _raise_in(fault, rank)
            train(state, 1)
            try:
                ckpt.save(state)
                outcome = "saved"
            except ts.TrainStateError as exc:
                outcome = type(exc).__name__
            finally:
                undo()
            dist.barrier()
            entry = {"outcome": outcome, "pointer_unchanged": (run / "latest").read_bytes() == pointer,
                     "generations": ckpt.generations(), "leftovers": _leftovers(run)}
            fresh = build("fsdp", seed=3)
            info = ckpt.restore(fresh)
            train(fresh, 1)
            ckpt.save(fresh)
            entry.update(restored=info.generation.name, after_next_save=_leftovers(run), latest=ckpt.latest())
        results[f"{fault}-rank{rank}"] = entry
    return results


def _refuse_on_rank1(out: Path, timeout_s: float, control: bool) -> dict:
    """Rank 1 holds a fact that cannot be stored: its capture fails before the round in which the ranks exchange
    their reports. ``control``: that rank raises without taking part in the round, as a save did before the
    round carried failures (the other rank then waits out the collective timeout)."""
    from trainstate.distributed import capture as capture_mod
    from trainstate.distributed import group as group_mod

    rank, run = dist.get_rank(), out / ("control" if control else "run")
    state = build("fsdp")
    real, real_local, raised = group_mod.Ranks.gather, capture_mod._local, []
    if control:
        def local(*args, **kwargs):
            try:
                return real_local(*args, **kwargs)
            except Exception as exc:
                raised.append(exc)
                raise

        def gather(self, value, phase, room=2048):
            if phase == "capture" and raised:  # the failed rank leaves instead of reporting in the round
                raise raised.pop()
            return real(self, value, phase, room)
        group_mod.Ranks.gather, capture_mod._local = gather, local
    ckpt = ts.CheckpointManager(run, collective_timeout_s=timeout_s)
    result: dict = {}
    try:
        train(state, 2)
        ckpt.save(state)
        train(state, 1)
        if rank == 1:
            state.facts["handle"] = object()
        started = time.monotonic()
        try:
            ckpt.save(state)
            result["outcome"] = "saved"
        except ts.TrainStateError as exc:
            result.update(outcome=type(exc).__name__, message=str(exc)[:600])
        result["seconds_to_raise"] = round(time.monotonic() - started, 2)
        state.facts.pop("handle", None)
        dist.barrier()
        result["generations"] = ckpt.generations()
        if not control:
            ckpt.save(state)  # the same manager: its groups are still in step
            result["after_fix"] = ckpt.generations()
            ckpt.close()
    finally:
        group_mod.Ranks.gather, capture_mod._local = real, real_local
    return result


@scenario
def one_rank_refuses(out: Path) -> dict:
    """A failure on one rank while capturing reaches every rank in the same round: all raise at once."""
    return _refuse_on_rank1(out, TIMEOUT_S, control=False)


@scenario
def one_rank_refuses_control(out: Path) -> dict:
    """The control: without the failure in the round, the other rank waits the whole (short) collective timeout.
    The manager is left unclosed: its groups are out of step."""
    return _refuse_on_rank1(out, 5.0, control=True)


@scenario
def background(out: Path) -> dict:
    """Background saves on the dedicated group while DDP trains; an injected failure surfaces at the next call."""
    state = build("ddp")
    boundaries = {}
    with manager(out / "run", keep_last=10) as ckpt:
        preallocated = ckpt.preallocate(state)  # the first background save copies into faulted-in buffers
        for _ in range(3):
            train(state, 2)
            boundaries[state.next_update] = full_state(state)
            ckpt.save(state, blocking=False)
            train(state, 1)  # trains while the save is written
        ckpt.wait()
        latest = ckpt.latest()
        surfaced = {}
        for where in ("save", "wait", "close"):
            undo = _raise_in("write", 1)
            train(state, 1)
            ckpt.save(state, blocking=False)
            try:
                if where == "save":
                    train(state, 1)
                    ckpt.save(state, blocking=False)
                elif where == "wait":
                    ckpt.wait()
                else:
                    ckpt.close()
                surfaced[where] = "nothing"
            except ts.AsyncSaveFailed as exc:
                surfaced[where] = f"AsyncSaveFailed from {type(exc.__cause__).__name__}"
            finally:
                undo()
            if where == "save":
                ckpt.wait()
    restored = {}
    for update, expected in boundaries.items():
        fresh = build("ddp", seed=9)
        with manager(out / "run") as ckpt:
            ckpt.restore(fresh, generation=f"gen-{update:012d}")
        restored[update] = same(full_state(fresh), expected)
    # FSDP2 (DTensors, 0-d step counts): preallocate leaves the live state as it was, and a background save
    # into the preallocated buffers restores bitwise
    sharded = build("fsdp")
    train(sharded, 2)
    with manager(out / "fsdp", keep_last=2) as ckpt:
        before = full_state(sharded)
        fsdp_preallocated = ckpt.preallocate(sharded)
        untouched = same(full_state(sharded), before)
        ckpt.save(sharded, blocking=False)
        train(sharded, 1)  # changes the live tensors while the owned copy is written
        ckpt.wait()
    fresh = build("fsdp", seed=9)
    with manager(out / "fsdp") as ckpt:
        ckpt.restore(fresh)
    return {"latest": latest, "restored_differs": {str(k): v for k, v in restored.items()}, "surfaced": surfaced,
            "preallocated": preallocated, "fsdp_preallocated": fsdp_preallocated, "preallocate_changed": untouched,
            "fsdp_background_differs": same(full_state(fresh), before),
            "scalar_background_differs": _scalar_background(out / "scalar")}


def _scalar_background(run: Path) -> list[str]:
    """A 0-d replicated DTensor (a scalar parameter and its AdamW moments) in a background save, changed in place
    the moment ``save`` returns: the generation must hold the values at the boundary (torch's CPU state dict
    hands a 0-d DTensor back as the live one, which the writer thread then read after the change)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    def build_scalar() -> ts.TrainState:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = torch.nn.Module()
        model.scale = torch.nn.Parameter(distribute_tensor(torch.tensor(2.0), mesh, [Replicate()]))
        opt = torch.optim.AdamW([model.scale], lr=0.1)
        (model.scale * 3.0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return ts.TrainState(model=model, optimizer=opt, capture_global_rngs=False)

    def values(state: ts.TrainState) -> dict[str, torch.Tensor]:
        out = {"scale": state["model"].scale.to_local().clone()}
        for name, value in state["optimizer"].state[state["model"].scale].items():
            out[name] = (value.to_local() if isinstance(value, DTensor) else value).clone()
        return out

    state = build_scalar()
    before = values(state)
    with manager(run) as ckpt:
        ckpt.save(state, blocking=False)
        with torch.no_grad():  # the next step, at once: in place, while the writer works
            state["model"].scale.add_(100.0)
            for value in state["optimizer"].state[state["model"].scale].values():
                value.add_(100.0)
        ckpt.wait()
    fresh = build_scalar()
    with manager(run) as ckpt:
        ckpt.restore(fresh)
    return same(values(fresh), before)


def _install_fault(kind: str) -> None:
    """A real fault in a real process: SIGKILL rank 1 inside its shard write, SIGKILL rank 0 between writing
    the manifest and the rename, or hang rank 1 inside its write (the survivors must time out)."""
    import signal

    from trainstate.distributed import storage
    from trainstate.storage.local import LocalStaging

    rank = dist.get_rank()
    if kind in ("kill_rank1_write", "hang_rank1_write") and rank == 1:
        real = storage.Writer.write_data

        def write_data(self, plan, planner):
            if kind == "hang_rank1_write":
                time.sleep(600)

            def dying_write(file, chunks, stable=False):
                next(iter(chunks), None)  # some bytes in flight, then the process is gone
                os.kill(os.getpid(), signal.SIGKILL)
            self.staging.write = dying_write
            return real(self, plan, planner)
        storage.Writer.write_data = write_data
    if kind == "kill_rank0_rename" and rank == 0:
        real_commit = LocalStaging.commit

        def commit(self):
            if (self.path / "manifest.json").exists():
                os.kill(os.getpid(), signal.SIGKILL)
            return real_commit(self)
        LocalStaging.commit = commit


@scenario
def fault(out: Path) -> dict:
    kind = os.environ["TRAINSTATE_TEST_FAULT"]
    state = build("fsdp")
    run = out / "run"
    with manager(run) as ckpt:
        train(state, 2)
        ckpt.save(state)
        _install_fault(kind)
        train(state, 1)
        started = time.monotonic()
        try:
            ckpt.save(state)
            outcome = "saved"
        except ts.TrainStateError as exc:
            outcome = f"{type(exc).__name__}: {exc}"[:600]
        result = {"ok": True, "outcome": outcome, "seconds_to_raise": round(time.monotonic() - started, 2)}
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
        os._exit(3 if outcome != "saved" else 0)  # a survivor exits non-zero at once: its peer is gone


@scenario
def fault_followup(out: Path) -> dict:
    """After each fault: the next run restores the previous generation and its next save cleans the leftover."""
    results = {}
    for source in sorted(p for p in Path(os.environ["TRAINSTATE_TEST_SOURCE"]).iterdir() if (p / "fault").is_dir()):
        run = source / "fault" / "run"
        entry = {"leftovers_before": _leftovers(run), "generations_before": sorted(
            n for n in os.listdir(run) if n.startswith("gen-"))}
        fresh = build("fsdp", seed=4)
        with manager(run) as ckpt:
            info = ckpt.restore(fresh)
            train(fresh, 1)
            saved = ckpt.save(fresh)
            entry.update(restored=info.generation.name, saved=saved.name, latest=ckpt.latest())
        dist.barrier()
        entry["leftovers_after"] = _leftovers(run)
        results[source.name] = entry
    return results


@scenario
def object_store(out: Path) -> dict:
    """The same exact resume on an S3 URL (``TRAINSTATE_TEST_S3``): every rank uploads its own shard under the
    attempt prefix, rank 0 writes the manifest and the create-only commit record; no shared filesystem."""
    remote = json.loads(os.environ["TRAINSTATE_TEST_S3"])
    url, opts = remote["url"], remote["storage_options"]
    total, cut = 10, 6
    reference = build("fsdp")
    train(reference, total)
    want_full, want_rank = full_state(reference), rank_state(reference)
    first = build("fsdp")
    with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S, keep_last=1) as ckpt:
        nothing = ckpt.restore(first)  # an empty run: planning the reads must not give the optimizer state
        untouched = len(first["optimizer"].state)
        train(first, cut - 2)
        ckpt.save(first)
        train(first, 2)
        info_saved = ckpt.save(first)
        dist.barrier()  # rank 0 prunes after every rank has its answer
        generations = ckpt.generations()
    del first
    torch.manual_seed(999)
    resumed = build("fsdp", seed=42)
    with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S) as ckpt:
        info = ckpt.restore(resumed)
    train(resumed, total - cut)
    from trainstate.storage.locate import open_store

    store = open_store(url, storage_options=opts)
    files = sorted(store.files(info.generation.name))
    return {"saved": info_saved.name, "generations": generations, "generation": info.generation.name,
            "empty_restore": nothing, "optimizer_state_after_empty_restore": untouched,
            "identical": info.identical_continuation, "files": files, "leftovers": store.leftovers(),
            "full_differs": same(full_state(resumed), want_full),
            "rank_differs": same(rank_state(resumed), want_rank)}


@scenario
def rank0_only_save(out: Path) -> dict:
    """Issue 29 item 4: the DDP tutorial's `if rank == 0: save(...)`. Rank 0 must fail within the join timeout
    ($TRAINSTATE_SAVE_JOIN_TIMEOUT_S), not the collective timeout, with SaveNotJoined naming rank 1; rank 1, which
    went on training, learns of it when rank 0's process ends, as under a real uncaught error."""
    rank, run = dist.get_rank(), out / "run"
    state = build("ddp")
    result: dict = {"ok": True}
    started = time.monotonic()
    try:
        with manager(run) as ckpt:
            train(state, 2)
            started = time.monotonic()
            if rank == 0:  # the habit from torch.save code
                ckpt.save(state)
            train(state, 1)  # rank 1: the next update's allreduce waits for rank 0
        result["outcome"] = "no error"
    except Exception as exc:  # noqa: BLE001 - every rank reports what it saw
        result.update(outcome=type(exc).__name__, message=str(exc)[:1500], missing=getattr(exc, "missing", None),
                      checkpoint_failed=isinstance(exc, ts.errors.CheckpointFailed))
    result["seconds_to_raise"] = round(time.monotonic() - started, 2)
    if rank == 0:
        result.update(generations=sorted(n for n in os.listdir(run) if n.startswith("gen-")), leftovers=_leftovers(run))
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    os._exit(3)  # as a script whose save raised: the process ends, torchrun tears the job down


@scenario
def manager_missing(out: Path) -> dict:
    """A rank that never creates its manager (a ``CheckpointManager`` made under ``if rank == 0``): rank 0's
    first save fails within the join timeout with SaveNotJoined saying so, not after the collective timeout.
    Rank 1 stays alive meanwhile (training elsewhere), then both processes end."""
    rank, run = dist.get_rank(), out / "run"
    result: dict = {"ok": True}
    started = time.monotonic()
    if rank == 0:
        state = build("fsdp", loader=False)
        try:
            with manager(run) as ckpt:
                started = time.monotonic()
                ckpt.save(state)
            result["outcome"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            result.update(outcome=type(exc).__name__, message=str(exc)[:1500], missing=getattr(exc, "missing", None))
        result["seconds_to_raise"] = round(time.monotonic() - started, 2)
        result["generations"] = sorted(n for n in os.listdir(run) if n.startswith("gen-"))
    else:
        time.sleep(float(os.environ.get("TRAINSTATE_SAVE_JOIN_TIMEOUT_S", "2")) + 4)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    os._exit(3)


@scenario
def collectives(out: Path) -> dict:
    """The JSON and byte collectives at the edges of their one-round room: small values in one round, a value
    over the room (on one rank only) in a second, ``None`` and empty bytes."""
    from trainstate.distributed.group import ROOM, checkpoint_groups
    from trainstate.distributed.tiers import broadcast_bytes

    ranks, _ = checkpoint_groups(None, TIMEOUT_S)
    big = "x" * (ROOM + 100)
    edge = "y" * (ROOM - 2)  # with its quotes, exactly the room
    r = ranks.rank
    return {
        "broadcast": [ranks.broadcast(v if r == 0 else "ignored", "t") for v in (None, 7, edge, big, [big, 1])]
        == [None, 7, edge, big, [big, 1]],
        "gather_small": ranks.all_gather({"rank": r}, "t") == [{"rank": i} for i in range(ranks.world_size)],
        "gather_mixed": ranks.all_gather(big if r == 1 else r, "t") == [0, big][: ranks.world_size],
        "gather_edge": ranks.all_gather([edge, None][r % 2], "t") == [edge, None][: ranks.world_size],
        "to_rank0": [ranks.gather(v, "t") for v in ({"rank": r}, big if r == 1 else r, big if r == 0 else [r])]
        == ([[{"rank": i} for i in range(ranks.world_size)], [0, big][: ranks.world_size],
             [big, [1]][: ranks.world_size]] if r == 0 else [None, None, None]),
        "from_rank0": [ranks.scatter(v if r == 0 else None, "t") for v in (
            [{"to": i} for i in range(ranks.world_size)], [big if i == 1 else i for i in range(ranks.world_size)])]
        == [{"to": r}, big if r == 1 else r],
        "failures": [ranks.failures(v, "t") for v in ("", "bad" if r == 1 else "")] == [{}, {1: "bad"}],
        "sum": ranks.sum([1, r, 2 ** 40], "t") == [ranks.world_size, sum(range(ranks.world_size)),
                                                   ranks.world_size * 2 ** 40],
        "bytes": [broadcast_bytes(ranks, v if r == 0 else None, 0, "t", room=16) for v in (b"", b"a" * 16,
                                                                                       b"b" * 17)]
        == [b"", b"a" * 16, b"b" * 17],
    }


def _gloo_threads() -> int:
    """This process's native gloo threads (each group's worker and transport loops), by their thread names."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # ended meanwhile
            continue
    return sum(name in ("pt_gloo_runloop", "gloo_tcp_loop") for name in names)


@scenario
def fsdp1_refusal(out: Path) -> dict:
    """FSDP1 (its state dicts run ``all_gather_object`` on its own group): rank 1 alone holds pending gradients
    and refuses the save. Every rank must raise at once, not rank 0 waiting inside FSDP's collective for the rank
    that skipped it (on NCCL, the collective timeout: minutes). Control: with the agreement before FSDP's
    collectives switched off, rank 0 waits out the FSDP group's timeout (5 s here)."""
    from datetime import timedelta

    from torch.distributed.fsdp import FullyShardedDataParallel

    from trainstate.distributed import capture as capture_mod

    results = {}
    for control in (False, True):
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
        torch.manual_seed(0)
        model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)),
                                         device_id=torch.device("cpu"), process_group=group)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        state = ts.TrainState(model=model, optimizer=opt, capture_global_rngs=False)
        if dist.get_rank() == 1:
            for p in model.parameters():  # gradients no optimizer step consumed, set without a collective
                p.grad = torch.ones_like(p)
        real = capture_mod._gathers_objects
        if control:
            capture_mod._gathers_objects = lambda state: False
        started, raised = time.monotonic(), None
        try:
            with manager(out / f"fsdp1-{control}") as ckpt:
                ckpt.save(state)
        except Exception as exc:  # noqa: BLE001 - the control's rank 0 raises FSDP's timeout (RuntimeError)
            raised = type(exc).__name__
        finally:
            capture_mod._gathers_objects = real
        results["control" if control else "agreed"] = {"raised": raised, "seconds": time.monotonic() - started}
    return results


@scenario
def preemption_agreed(out: Path) -> dict:
    """SIGTERM reaches rank 1 alone, in the middle of update 4: with ``agreed()`` every rank saves at the same
    boundary (after update 4) and the generation restores. Control: each rank's own flag, the next step's
    all-reduce on a group with a 3 s timeout: rank 1 goes into ``save`` while rank 0 waits in the all-reduce,
    and both fail after the timeouts."""
    import signal
    from datetime import timedelta

    def loop(run: Path, agreed: bool, timeout_s: float) -> dict:
        state = build("ddp", loader=False)
        reducer = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        saved, started = None, time.monotonic()
        try:
            with ts.PreemptionHandler() as preempt, ts.CheckpointManager(run, collective_timeout_s=timeout_s) as ckpt:
                for i in range(8):
                    t = torch.ones(1)
                    dist.all_reduce(t, group=reducer)  # the step's all-reduce
                    step(state)
                    if dist.get_rank() == 1 and i == 3:
                        os.kill(os.getpid(), signal.SIGTERM)  # mid-update: this rank alone
                    if preempt.agreed() if agreed else preempt.requested:
                        ckpt.save(state)
                        saved = state.next_update
                        break
            outcome = None
        except Exception as exc:  # noqa: BLE001 - the control's ranks fail apart
            outcome = type(exc).__name__
        return {"saved": saved, "raised": outcome, "seconds": time.monotonic() - started}

    agreed = loop(out / "agreed", True, 60.0)
    with manager(out / "agreed") as ckpt:
        info = ckpt.restore(build("ddp", seed=3, loader=False))
        restored = info.generation.name if info is not None else None
    return {"agreed": agreed, "restored": restored, "control": loop(out / "control", False, 3.0)}


@scenario
def groups_released(out: Path) -> dict:
    """Each manager creates two gloo groups; close destroys them: after a normal close their threads and
    sockets too, after one with an exception propagating (on every rank here) by name only, never waiting on a
    collective. A closed manager's save raises InvalidArgument. Control: a close that keeps its groups leaves
    two more, and their threads."""
    from torch.distributed.distributed_c10d import _world

    from trainstate.distributed.session import Session

    state = build("ddp", loader=False)
    before, threads = len(_world.pg_map), _gloo_threads()
    counts, leftover_threads = [], []
    for i in range(3):
        with manager(out / "run") as ckpt:
            step(state)
            ckpt.save(state)
        counts.append(len(_world.pg_map) - before)
        leftover_threads.append(_gloo_threads() - threads)
    try:
        with manager(out / "run") as ckpt:
            step(state)
            raise SystemExit(3)  # e.g. a preemption handler's exit, on every rank
    except SystemExit:
        pass
    counts.append(len(_world.pg_map) - before)
    try:
        ckpt.save(state)
        closed = "saved"
    except ts.InvalidArgument as exc:
        closed = str(exc)
    del ckpt
    pre_control = _gloo_threads()
    release = Session.release
    Session.release = lambda self, writing, clean: None  # the control: groups kept, as before
    try:
        with manager(out / "control") as kept:
            pass
    finally:
        Session.release = release
    return {"counts": counts, "closed": closed, "control": len(_world.pg_map) - before - counts[-1],
            "threads": leftover_threads, "control_threads": _gloo_threads() - pre_control > 0, "kept": kept is not None}


def _sized(mode: str, seed: int = 0) -> ts.TrainState:
    """A model of a few MiB with Adam moments (bytes, not metadata, dominate the counts), FSDP2 or DDP."""
    torch.manual_seed(seed)
    width = int(os.environ.get("TRAINSTATE_TEST_WIDTH", "1024"))  # benchmarks/bench_restore_traffic.py sizes it
    model = wrap(torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                     torch.nn.ReLU(), torch.nn.Linear(width, 64)), mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ts.TrainState(model=model, optimizer=opt, contract={"config": {"mode": mode}},
                         rngs={"noise": torch.Generator().manual_seed(seed + dist.get_rank())})


def _sized_steps(state: ts.TrainState, n: int, inputs: tuple[int, int] = (8, 64)) -> None:
    for _ in range(n):
        x = torch.randn(*inputs, generator=state.rngs["noise"])
        state["model"](x).square().mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state.next_update += 1


@scenario
def object_restore(out: Path) -> dict:
    """Issue 34: one phase per launch ($TRAINSTATE_TEST_S3: url, storage_options, phase, mode), so that the test
    counts the restore's requests alone through a proxy. ``save`` writes the generation and a reference of the
    full state; ``restore`` restores into fresh objects and compares."""
    remote = json.loads(os.environ["TRAINSTATE_TEST_S3"])
    url, opts, mode = remote["url"], remote["storage_options"], remote["mode"]
    ref = Path(remote["reference"])
    if remote["phase"] == "save":
        state = _sized(mode)
        _sized_steps(state, 2)
        with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S) as ckpt:
            info = ckpt.save(state)
        save_ref(ref, full_state_of(state))
        return {"generation": info.name, "size": info.size}
    fresh = _sized(mode, seed=5)
    if remote["phase"] == "bad-peer":  # the control: rank 0 hands over chunks with one bit flipped
        from trainstate.storage.fetched import Fetched

        real = Fetched.chunk

        def flipped(self, manifest, name, index):
            data = bytearray(real(self, manifest, name, index))
            data[len(data) // 2] ^= 0x01
            return memoryview(bytes(data))
        if dist.get_rank() == 0:
            Fetched.chunk = flipped
        try:
            with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S) as ckpt:
                ckpt.restore(fresh)
            return {"outcome": "restored"}
        except ts.TrainStateError as exc:
            return {"outcome": type(exc).__name__, "message": str(exc)[:3000]}
    started = time.monotonic()
    with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S) as ckpt:
        info = ckpt.restore(fresh)
    seconds = time.monotonic() - started
    return {"generation": info.generation.name, "seconds": round(seconds, 3),
            "differs": same(full_state_of(fresh), load_file(str(ref)))}


def full_state_of(state: ts.TrainState) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors gathered to full tensors (a collective)."""
    model, opt = state["model"], state["optimizer"]
    out = {f"model.{k}": (v.full_tensor() if isinstance(v, DTensor) else v.detach()).clone()
           for k, v in get_model_state_dict(model).items()}
    for key, entry in get_optimizer_state_dict(model, opt)["state"].items():
        for name, value in entry.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"optim.{key}.{name}"] = value.detach().clone() if isinstance(value, torch.Tensor) else \
                torch.tensor(value)
    return {k: v.contiguous() for k, v in out.items()}


@scenario
def golden_multirank_write(out: Path) -> dict:
    """Writes tests/golden/multirank-v3 (run once, by the code before a change of the multi-rank layout): an
    FSDP2 run saved after 3 updates, with the state after 2 more updates as the reference to continue to."""
    state = build("fsdp")
    with manager(out / "run") as ckpt:
        train(state, 3)
        ckpt.save(state)
    train(state, 2)
    save_ref(out / "after-full.safetensors", full_state(state))
    save_file(rank_state(state), str(out / f"after-rank{dist.get_rank()}.safetensors"))
    return {}


@scenario
def golden_multirank_read(out: Path) -> dict:
    """The golden run (``$TRAINSTATE_TEST_SOURCE``, written by earlier code) restores at world size 2 and
    continues bitwise; the next save (today's layout) restores too."""
    source = Path(os.environ["TRAINSTATE_TEST_SOURCE"])
    remote = json.loads(os.environ.get("TRAINSTATE_TEST_S3", "null"))
    where = remote["url"] if remote else str(source / "run")
    options = {"storage_options": remote["storage_options"]} if remote else {}
    fresh = build("fsdp", seed=8)
    with ts.CheckpointManager(where, collective_timeout_s=TIMEOUT_S, **options) as ckpt:
        info = ckpt.restore(fresh)
        train(fresh, 2)
        saved = ckpt.save(fresh)
    result = {"restored": info.generation.name, "identical": info.identical_continuation, "saved": saved.name,
              "full_differs": same(full_state(fresh), load_file(str(source / "after-full.safetensors"))),
              "rank_differs": same(rank_state(fresh),
                                   load_file(str(source / f"after-rank{dist.get_rank()}.safetensors")))}
    again = build("fsdp", seed=9)
    with ts.CheckpointManager(where, collective_timeout_s=TIMEOUT_S, **options) as ckpt:
        result["again"] = ckpt.restore(again).generation.name
    result["again_differs"] = same(full_state(again), full_state(fresh))
    return result


@scenario
def golden_reshard(out: Path) -> dict:
    """At another world size: the golden run (a copy in ``$TRAINSTATE_TEST_SOURCE``) restored with
    ``allow_changes=["world_size"]`` and saved again at its update (a revision, cut for this world size)."""
    run = Path(os.environ["TRAINSTATE_TEST_SOURCE"]) / "run"
    fresh = build("fsdp", seed=8)
    with manager(run) as ckpt:
        info = ckpt.restore(fresh, allow_changes=["world_size"])
        saved = ckpt.save(fresh)
    return {"restored": info.generation.name, "saved": saved.name}


def main(scenarios: dict | None = None) -> NoReturn:
    """Run the scenarios named on the command line (from ``scenarios``, default this file's), each rank writing
    ``OUT/<scenario>/rank<r>.json``; other workers (``tier_worker.py``...) pass their own. Ends the process
    (:func:`exit_now`): 1 if a scenario failed."""
    scenarios = SCENARIOS if scenarios is None else scenarios
    out, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[rank{dist.get_rank()}] %(levelname)s %(message)s")
    status = 0
    for name in names:
        where = out / name
        where.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        started = time.monotonic()
        try:
            result = {"ok": True, **scenarios[name](where)}
        except Exception as exc:  # reported to the test, which shows it
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            status = 1
        result["seconds"] = round(time.monotonic() - started, 2)
        (where / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1, default=str))
    dist.destroy_process_group()
    exit_now(status)


def exit_now(status: int) -> NoReturn:
    """End a rank once every result is written and the process group destroyed, skipping the interpreter's
    teardown, as the drill's worker does. That teardown frees torch's objects while gloo's threads may still hold
    tensors over Python memory; a rank aborted there (SIGABRT, "terminate called without an active exception")
    after its scenario had passed, and its peers' torchrun agent then waited in its exit barrier until the launch
    timed out. The teardown also costs seconds per launch."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
