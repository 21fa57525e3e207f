"""Node-local tiers under SIGKILL: scenarios for ``tests/test_tiers_kill.py`` (several ``torchrun`` agents, one host).

Each agent is a node with its own directory (``$TRAINSTATE_NODE_DIR``),
``CheckpointManager(node_dir, keep_last=2, replicas=2)``; a scenario writes
``OUT/<scenario>/rank<r>.json`` (``dist_worker.main``).

- ``tier_kill_train``: FSDP2 (``dist_worker.build("fsdp")``), resuming first
  when the nodes hold anything, then a blocking save after EVERY update up to
  update ``TS_KILL_TOTAL`` (default 60); the replicas follow on the writer
  thread, pruning after them. Rank 0 records the update each save reached in
  ``OUT/<scenario>/progress.json`` (written whole: temp file, rename). The test
  SIGKILLs the launch at some moment and starts it again.
  With ``TRAINSTATE_TEST_S3`` (``{"url", "storage_options"}``) the manager
  has the remote tier behind the nodes: ``mirror=URL``, ``mirror_every=2``
  (``TS_MIRROR_EVERY``), so the first save of each launch and every second
  one after it are uploaded on the writer thread, after the replicas.
- ``tier_kill_finish``: restore into fresh objects built from a wrong seed,
  train to ``TS_KILL_TOTAL`` without saving, and compare bitwise (every tensor
  of model and optimizer, the schedule, the clock, each rank's generator,
  global torch stream and loader position) with an uninterrupted run computed
  in the same launch.

Where a kill lands: every rank appends one line per phase boundary to
``OUT/<scenario>/phases-rank<r>.log`` (``<time> <node> <rank> <thread>
enter|exit|error <phase> <update>``), written with one ``O_APPEND`` write so
it is whole at any kill. The phases: ``restore`` (``refill``), ``save`` (the
local tier's publish: ``write``, ``commit``, ``verify``, ``point``),
``replicate`` (``transfer``, ``point-replicas``), ``upload`` (``send``: each
rank's files sent to the remote staging attempt; ``commit-remote``: rank 0's
manifest, commit record, check, ``point-remote`` and ``prune-remote``, one per
removed remote generation), ``prune``.

Knobs (environment):

- ``TS_KILL_SLEEP`` (seconds, default 0): a pause inside the phases where a
  kill leaves the most to clean up: before every staging directory's commit
  (a staged holding, in either tier), before every pointer moves, after
  every replicated file is written, before every removed generation's files
  are deleted (a trash entry); on the remote: after every file sent, before
  the commit record, before the remote ``latest`` moves and before each remote
  generation is removed. Widens the windows a random kill hits.
- ``TS_KILL_PAUSE`` (``<node>:<update>:<phase>``): the ranks of agent
  ``<node>`` stop on entering ``<phase>`` while saving update ``<update>``:
  they touch ``OUT/<scenario>/paused-rank<r>`` and sleep, so that the test
  kills that node's processes exactly there (the other nodes wait in a
  collective).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_worker as dw  # noqa: E402

import trainstate as ts  # noqa: E402

SCENARIOS = {}
PHASES = ("restore", "refill", "save", "write", "commit", "verify", "point", "replicate", "transfer",
          "point-replicas", "upload", "send", "commit-remote", "point-remote", "prune-remote", "prune")


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def total() -> int:
    return int(os.environ.get("TS_KILL_TOTAL", "60"))


def node_dir() -> Path:
    return Path(os.environ["TRAINSTATE_NODE_DIR"])


def remote() -> dict | None:
    """``{"url", "storage_options"}`` of the remote tier behind the nodes (``TRAINSTATE_TEST_S3``), or None."""
    found = os.environ.get("TRAINSTATE_TEST_S3")
    return json.loads(found) if found else None


def tiered() -> ts.CheckpointManager:
    kwargs = {}
    if remote() is not None:
        kwargs.update(mirror=remote()["url"], mirror_options=remote()["storage_options"],
                      mirror_every=int(os.environ.get("TS_MIRROR_EVERY", "2")))
    return ts.CheckpointManager(node_dir(), keep_last=2, replicas=2, collective_timeout_s=dw.TIMEOUT_S, **kwargs)


# where a kill lands: phase lines, sleeps, a pause --------------------------------------------------------
class Phases:
    """Appends phase boundaries to this rank's log; sleeps and pauses where the knobs say."""

    def __init__(self, out: Path):
        self.node, self.rank = os.environ.get("TRAINSTATE_TEST_NODE", "?"), dist.get_rank()
        self.fd = os.open(out / f"phases-rank{self.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                          0o644)
        self.sleep = float(os.environ.get("TS_KILL_SLEEP", "0") or 0)
        pause = os.environ.get("TS_KILL_PAUSE", "")
        self.pause = None
        if pause:
            node, update, phase = pause.split(":")
            assert phase in PHASES, phase
            self.pause = (node, int(update), phase)
        self.out = out
        self.update = 0  # the update being saved (or last saved)

    def line(self, event: str, phase: str) -> None:
        thread = "main" if threading.current_thread() is threading.main_thread() else "writer"
        os.write(self.fd, f"{time.time():.6f} {self.node} {self.rank} {thread} {event} {phase} {self.update}\n"
                 .encode())

    def enter(self, phase: str) -> None:
        self.line("enter", phase)
        if self.pause is not None and self.pause == (self.node, self.update, phase):
            (self.out / f"paused-rank{self.rank}").write_text(f"{phase} {self.update}\n")
            time.sleep(600)  # until the test kills this node

    def nap(self) -> None:
        if self.sleep:
            time.sleep(self.sleep)

    def wrap(self, owner: object, attr: str, phase, *, before: bool = False, after: bool = False) -> None:
        """Log ``owner.attr``'s calls as ``phase`` (a name, or a function of the call's arguments giving one; None:
        not logged); ``before``/``after``: sleep ``TS_KILL_SLEEP`` there."""
        real = getattr(owner, attr)

        @functools.wraps(real)
        def wrapped(*args, **kwargs):
            name = phase(*args, **kwargs) if callable(phase) else phase
            if name:
                self.enter(name)
            if before:
                self.nap()
            try:
                result = real(*args, **kwargs)
            except BaseException:
                if name:
                    self.line("error", name)
                raise
            if after:
                self.nap()
            if name:
                self.line("exit", name)
            return result

        setattr(owner, attr, wrapped)


def instrument(out: Path) -> Phases:
    from trainstate.distributed import tierload, tierremote, tiersave
    from trainstate.storage import local, objects, posix

    phases = Phases(out)
    phases.wrap(tiersave, "publish", "save")
    logged = tiersave.publish

    def publish(snap, pending, *args, **kwargs):
        phases.update = pending.next_update  # before "save" is logged (and a pause is matched)
        return logged(snap, pending, *args, **kwargs)

    tiersave.publish = publish
    phases.wrap(tiersave, "_write", "write")
    phases.wrap(tiersave, "_complete", "commit")
    phases.wrap(tiersave, "_verify", "verify")
    phases.wrap(tiersave, "_point", lambda verified, ranks, tier, key, pointer="latest", store=None:
                "point-replicas" if store is tier.replica else "point", before=True)
    phases.wrap(tiersave, "replicate", "replicate")
    phases.wrap(tiersave, "_transfer", "transfer")
    phases.wrap(tiersave, "_write_checked", None, after=True)  # each file another rank sent, written
    phases.wrap(tiersave, "prune", "prune")
    # the remote tier: called as module globals at call time (session.py imports tierremote.upload when it runs)
    phases.wrap(tierremote, "upload", "upload")
    phases.wrap(tierremote, "_send", "send")  # each file sent: tiersave._write_checked above (a nap after it)
    phases.wrap(tierremote, "_commit", "commit-remote")
    phases.wrap(objects.ObjectStaging, "commit", None, before=True)  # every file and the manifest uploaded
    phases.wrap(tierremote, "point_at", "point-remote", before=True)  # committed, the remote latest not moved
    phases.wrap(objects.ObjectStore, "remove", "prune-remote", before=True)  # a remote generation removed
    phases.wrap(tierload, "restore", "restore")
    phases.wrap(tierload, "_refill", "refill")
    phases.wrap(local.LocalStaging, "commit", None, before=True)  # a staged holding, either tier
    phases.wrap(posix.PosixOps, "rmtree", None, before=True)  # a trash entry (or an aborted staging)
    return phases


class Recording:
    """The manager, with rank 0 recording the update each save reached (``progress.json``, written whole)."""

    def __init__(self, ckpt: ts.CheckpointManager, out: Path, started: int, resumed: str | None):
        self.ckpt, self.out, self.started, self.resumed = ckpt, out, started, resumed
        self.rank = dist.get_rank()
        self._write(started)

    def _write(self, update: int) -> None:
        if self.rank == 0:
            tmp = self.out / "progress.tmp"
            tmp.write_text(json.dumps({"started": self.started, "resumed": self.resumed, "update": update,
                                       "time": time.time()}))
            os.replace(tmp, self.out / "progress.json")

    def save(self, state: ts.TrainState, **kwargs):
        info = self.ckpt.save(state, **kwargs)
        self._write(state.next_update)
        return info


# scenarios ------------------------------------------------------------------------------------------------
def anything_held() -> bool:
    """Whether any node's directory holds a generation, in either tier (collective: the same answer on every
    rank). A restore is called only then: ``restore()`` over empty tiers returns None but is not a no-op (it
    builds the optimizer's state through DCP, a zero-gradient step: AdamW's step counters become 1), which would
    make the first launch differ from the uninterrupted run; ``tier_restore_empty`` shows it."""
    mine = any(p.name.startswith("gen-") for d in (node_dir(), node_dir() / "replicas") if d.is_dir()
               for p in d.iterdir())
    if not mine and remote() is not None and dist.get_rank() == 0:  # the remote tier counts too
        from trainstate.storage.locate import open_store

        mine = bool(open_store(remote()["url"], storage_options=remote()["storage_options"]).generations())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return any(every)


@scenario
def tier_kill_train(out: Path) -> dict:
    instrument(out)
    state = dw.build("fsdp")
    with tiered() as ckpt:
        info = ckpt.restore(state) if anything_held() else None
        started = state.next_update
        resumed = None if info is None else info.generation.name
        dw.train(state, total() - state.next_update, Recording(ckpt, out, started, resumed), every=1)
        ckpt.wait()
        tiers = ckpt.status().tiers
    return {"resumed": None if info is None else info.generation.name, "started": started,
            "reached": state.next_update, "rejected": [] if info is None else
            [[r.generation, r.reason] for r in info.rejected],
            "sources": None if info is None else info.sources, "tiers": tiers}


@scenario
def tier_kill_finish(out: Path) -> dict:
    instrument(out)
    torch.manual_seed(999)  # the global stream is wrong until restore puts it back
    state = dw.build("fsdp", seed=42)
    with tiered() as ckpt:
        try:
            info = ckpt.restore(state)
        except ts.TrainStateError as exc:
            return {"raised": type(exc).__name__, "message": str(exc)}
        tiers = ckpt.status().tiers
    if info is None:
        return {"raised": "nothing", "message": "no node holds any generation"}
    restored = state.next_update
    dw.train(state, total() - state.next_update)
    got_full, got_rank = dw.full_state(state), dw.rank_state(state)
    reference = dw.build("fsdp")  # the uninterrupted run, in this launch
    dw.train(reference, total())
    return {"generation": info.generation.name, "restored_update": restored,
            "rejected": [[r.generation, r.reason] for r in info.rejected], "sources": info.sources, "tiers": tiers,
            "full_differs": dw.same(got_full, dw.full_state(reference)),
            "rank_differs": dw.same(got_rank, dw.rank_state(reference)),
            "compared": sorted(got_full) + sorted(got_rank)}


@scenario
def tier_restore_empty(out: Path) -> dict:
    """``restore()`` where no node holds anything returns None; the objects must be as they were (the bug: the
    optimizer's state is built by a zero-gradient step, every AdamW step counter 1)."""
    state = dw.build("fsdp")  # no update yet: the optimizer holds no state
    optimizer = state["optimizer"]
    before = len(optimizer.state)
    with dw.manager(out / "shared-empty") as ckpt:  # the control: one directory every rank shares
        shared = ckpt.restore(state)
    after_shared = len(optimizer.state)
    empty = out / f"empty-node{os.environ['TRAINSTATE_TEST_NODE']}"
    with ts.CheckpointManager(empty, keep_last=2, replicas=2, collective_timeout_s=dw.TIMEOUT_S) as ckpt:
        info = ckpt.restore(state)
    steps = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
    return {"returned": None if info is None else info.generation.name, "optimizer_state_before": before,
            "shared_returned": shared, "optimizer_state_after_shared": after_shared,
            "optimizer_state_after": len(optimizer.state), "steps_after": steps}


if __name__ == "__main__":
    sys.exit(dw.main(SCENARIOS))
