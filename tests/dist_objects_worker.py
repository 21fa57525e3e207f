"""A multi-rank restore from an object store when the shard it reads as it loads is damaged, or the store goes away
halfway (run by tests/test_object_restore_traffic.py under a real ``torchrun``, moto on loopback).

Each rank reads its own FSDP2 shard straight from the store while DCP loads it, each chunk verified before it reaches
a live tensor (``share.read_as_loaded``). Reuses tests/dist_worker.py's runner and helpers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainstate as ts  # noqa: E402
from dist_worker import TIMEOUT_S, _sized, _sized_steps, full_state_of, main, same, scenario  # noqa: E402


def _restore(url: str, opts: dict, seed: int) -> tuple[ts.TrainState, dict]:
    fresh = _sized("fsdp", seed=seed)
    return fresh, _restore_into(url, opts, fresh)


def _restore_into(url: str, opts: dict, state: ts.TrainState) -> dict:
    try:
        with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S) as ckpt:
            info = ckpt.restore(state)
        return {"generation": info.generation.name, "unusable": ts.unusable_reason(state),
                "rejected": [f"{r.generation}: {r.reason}"[:500] for r in info.rejected]}
    except ts.TrainStateError as exc:
        return {"outcome": type(exc).__name__, "message": str(exc)[:1500], "unusable": ts.unusable_reason(state)}


def _try_save(url: str, opts: dict, state: ts.TrainState) -> str:
    try:
        with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S) as ckpt:
            return ckpt.save(state).name
    except ts.TrainStateError as exc:
        return type(exc).__name__


@scenario
def object_faults(out: Path) -> dict:
    """Two generations; the newer's shard of rank 0 gets one flipped bit in its last chunk (by rank 0, through the
    store's own client), then: a restore falls back to the older one bitwise, and its control (chunk checks off)
    loads the damaged one; with the bytes put back, a read that fails halfway (rank 0's GETs past the header chunk
    refused) leaves every rank's state unusable and its save refused, and its control (nothing marked) saves; a store
    that does not answer rank 1 in a fetch round fails the restore on every rank (StorageUnavailable, nothing
    loaded), and its control (counted as damage) resumes from the older generation."""
    from trainstate.distributed import load as load_mod
    from trainstate.storage import chunked
    from trainstate.storage.fetched import Fetched
    from trainstate.storage.objects import ObjectStore

    remote = json.loads(os.environ["TRAINSTATE_TEST_S3"])
    url, opts = remote["url"], remote["storage_options"]
    rank = dist.get_rank()
    state = _sized("fsdp")
    _sized_steps(state, 2)
    with ts.CheckpointManager(url, storage_options=opts, collective_timeout_s=TIMEOUT_S, keep_last=4) as ckpt:
        older = ckpt.save(state).name
        first = full_state_of(state)
        _sized_steps(state, 1)
        newer = ckpt.save(state).name
        second = full_state_of(state)
    store = ObjectStore(url, storage_options=opts)
    key = f"attempts/{store._attempt(newer)}/shard-00000.safetensors"
    good = store.client.get_small(key) if rank == 0 else b""
    if rank == 0:
        bad = bytearray(good)
        bad[-100] ^= 0x01
        store.client.put(key, bytes(bad))
    dist.barrier()
    result: dict = {"older": older, "newer": newer, "chunks": len(good) // (4 << 20) + 1 if rank == 0 else None}

    direct: set[str] = set()
    held: dict[str, list[int]] = {}  # what the fetch rounds downloaded into memory, by file
    real_read_as_loaded, real_fetch = Fetched.read_as_loaded, Fetched.fetch_chunks
    Fetched.read_as_loaded = lambda self, manifest, names: direct.update(names) or real_read_as_loaded(
        self, manifest, names)
    Fetched.fetch_chunks = lambda self, manifest, name, chunks: held.setdefault(name, []).extend(chunks) or \
        real_fetch(self, manifest, name, chunks)
    try:
        live, result["damaged"] = _restore(url, opts, seed=7)
    finally:
        Fetched.read_as_loaded, Fetched.fetch_chunks = real_read_as_loaded, real_fetch
    result["direct"] = sorted(direct)
    result["held"] = held
    result["damaged_differs"] = same(full_state_of(live), first)
    real_check = chunked._check
    chunked._check = lambda *a, **k: None  # the control: nothing checked, the damaged generation loads
    try:
        live, result["unchecked"] = _restore(url, opts, seed=7)
    finally:
        chunked._check = real_check
    result["unchecked_differs"] = same(full_state_of(live), second)

    if rank == 0:
        store.client.put(key, good)
    dist.barrier()
    real_download = Fetched._download

    def cut(self, generation, name, spans):  # the store refuses rank 0's shard reads after the header chunk
        if name.startswith("shard-00000") and any(b > 0 for b, _ in spans):
            raise ConnectionResetError(f"{name}: connection reset (the test cut it)")
        return real_download(self, generation, name, spans)

    for marking in (True, False):
        live, _ = _restore(url, opts, seed=7)  # restored once, completely: the state belongs to the run
        if rank == 0:
            Fetched._download = cut
        real_mark = load_mod.mark_unusable
        if not marking:  # the control: a state left half-loaded and not marked is saved, a mix of two states
            load_mod.mark_unusable = lambda *a, **k: None
        try:
            got = _restore_into(url, opts, live)
        finally:
            Fetched._download, load_mod.mark_unusable = real_download, real_mark
        got["save"] = _try_save(url, opts, live)
        result["cut" if marking else "cut_unmarked"] = got

    def down(self, generation, name, spans):  # rank 1's GETs of the newer generation, in the fetch rounds
        if generation == newer:
            raise ts.StorageUnavailable(f"GET {name} failed after the client's retries (the test cut it)")
        return real_download(self, generation, name, spans)

    for raising in (True, False):
        if rank == 1:
            Fetched._download = down
        real_raise = load_mod.raise_unavailable
        if not raising:  # the control: a store that did not answer counts as damage, the older generation loads
            load_mod.raise_unavailable = lambda reports: None
        try:
            live, got = _restore(url, opts, seed=7)
        finally:
            Fetched._download, load_mod.raise_unavailable = real_download, real_raise
        got["differs_older"] = same(full_state_of(live), first)
        result["unavailable" if raising else "unavailable_fell_back"] = got
    return result


@scenario
def object_leftovers(out: Path) -> dict:
    """Rank 0 looks for what interrupted saves left at a manager's first save and after a failed one, not at every
    save. A save whose rank 1 cannot stage (and whose staged objects rank 0 then fails to remove) leaves them; the
    next save removes them, and in the control (the failure not remembered) they stay."""
    from trainstate.distributed import commit as commit_mod
    from trainstate.storage import objects as objects_mod

    remote = json.loads(os.environ["TRAINSTATE_TEST_S3"])
    rank, result = dist.get_rank(), {}
    real_clean, real_stage, real_abort = (objects_mod.ObjectStore.clean_leftovers, commit_mod.stage_records,
                                          objects_mod.ObjectStaging.abort)
    scans: list[int] = []
    objects_mod.ObjectStore.clean_leftovers = lambda self: scans.append(1) or real_clean(self)
    try:
        for flagged in (True, False):
            url = f"{remote['url']}-{'flagged' if flagged else 'control'}"
            state = _sized("fsdp")
            with ts.CheckpointManager(url, storage_options=remote["storage_options"],
                                      collective_timeout_s=TIMEOUT_S) as ckpt:
                counts = []
                for _ in range(2):
                    _sized_steps(state, 1)
                    scans.clear()
                    ckpt.save(state)
                    counts.append(len(scans))
                _sized_steps(state, 1)
                if rank == 1:
                    commit_mod.stage_records = lambda *a, **k: ([], OSError("rank 1's disk is gone (the test)"))
                objects_mod.ObjectStaging.abort = lambda self: None  # rank 0's cleanup of the attempt fails too
                try:
                    ckpt.save(state)
                    failed = "saved"
                except (ts.TrainStateError, OSError) as exc:  # (rank 1 raises its own error, rank 0 CheckpointFailed)
                    failed = type(exc).__name__
                finally:
                    commit_mod.stage_records, objects_mod.ObjectStaging.abort = real_stage, real_abort
                left = ckpt.store.leftovers() if rank == 0 else None
                if not flagged and rank == 0:
                    ckpt._publisher.clean_due = False
                scans.clear()
                ckpt.save(state)
                counts.append(len(scans))
                result["flagged" if flagged else "control"] = {
                    "scans": counts, "failed": failed, "left": left,
                    "after": ckpt.store.leftovers() if rank == 0 else None, "generations": ckpt.generations()}
    finally:
        objects_mod.ObjectStore.clean_leftovers = real_clean
    return result


if __name__ == "__main__":
    sys.exit(main())
