"""I/O-error loops, as SQLite tests them: fail the Nth filesystem operation of a save, for every N.

For N = 1, 2, ... until a save completes untouched, in one-shot mode (only the Nth
operation fails) and persistent mode (every operation from the Nth fails, as on a
dying disk), with EIO and ENOSPC:
- the save raises (it never reports success over a failed operation);
- restore then returns the previous generation, or the new one if the pointer had
  already moved or the new one is committed (complete: restore rolls forward to
  it), bitwise; no partial generation is visible;
- a failed fsync is never retried (the kernel may have dropped the dirty pages:
  "fsyncgate"), and its generation is never published;
- the next save, on a healthy disk, succeeds and removes the leftovers.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

import trainstate as ts
from test_crash_states import fingerprint, make_state
from trainer import step
from trainstate.state import rng
from trainstate.storage.local import LocalStore, PosixOps
from trainstate.storage.verify import verify_generation

OPS = ("mkdir", "create", "write", "fsync", "close", "fsync_dir", "rename", "replace", "unlink", "rmtree")


class FaultOps(PosixOps):
    """Real operations, except that the Nth (and, when persistent, every later one) raises."""

    def __init__(self, fail_at: int, code: int, persistent: bool):
        self.fail_at, self.code, self.persistent = fail_at, code, persistent
        self.count = 0
        self.failed: list[str] = []
        self.attempted: list[str] = []  # every operation in order, the failing ones included
        self.synced_after_failure: list[int] = []
        self._failed_fds: set[int] = set()

    def _gate(self, name: str, fd: int | None = None) -> None:
        self.count += 1
        self.attempted.append(name)
        if self.count == self.fail_at or (self.persistent and self.count > self.fail_at):
            self.failed.append(name)
            if name == "fsync" and fd is not None:
                self._failed_fds.add(fd)
            raise OSError(self.code, f"injected {errno.errorcode[self.code]} at operation {self.count} ({name})")

    def fsync(self, fd):
        if fd in self._failed_fds:
            self.synced_after_failure.append(fd)
        self._gate("fsync", fd)
        super().fsync(fd)


def _gated(name):
    def method(self, *args):
        self._gate(name)
        return getattr(PosixOps, name)(self, *args)
    return method


for _name in OPS:
    if _name != "fsync":
        setattr(FaultOps, _name, _gated(_name))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A run directory with generation 1 committed, and the state that will be saved as 2."""
    root = tmp_path_factory.mktemp("io") / "run"
    state = make_state()
    step(state)
    with ts.CheckpointManager(root, keep_last=1) as ckpt:
        ckpt.save(state)
    previous = fingerprint(state)
    step(state)
    globals_at_save = rng.capture({})  # the save captures global RNG: pin it for every attempt
    return root, state, previous, fingerprint(state), globals_at_save


def _published_before(ops: FaultOps, n: int) -> bool:
    """Whether the pointer's replace and the directory fsync after it both completed before operation ``n``."""
    done = ops.attempted[: n - 1]
    return any(a == "replace" and b == "fsync_dir" for a, b in zip(done, done[1:]))


def _restore(root: Path) -> tuple[str, str]:
    fresh = make_state(seed=99)
    with ts.CheckpointManager(root) as ckpt:
        info = ckpt.restore(fresh)
    return info.generation.name, fingerprint(fresh)


@pytest.mark.parametrize("persistent", [False, True], ids=["one-shot", "persistent"])
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
def test_every_failing_operation(tmp_path, template, code, persistent):
    source, state, previous, new, globals_at_save = template
    failures_seen = 0
    for n in range(1, 500):
        root = tmp_path / f"n{n}"
        shutil.copytree(source, root)
        ops = FaultOps(n, code, persistent)
        pointer_before = (root / "latest").read_bytes()
        rng.restore(globals_at_save, {})
        state.parent = "gen-000000000001"  # the state is shared by the tests of this module: a run saved at 1
        with ts.CheckpointManager(root, keep_last=1, store=LocalStore(root, ops=ops)) as ckpt:
            try:
                ckpt.save(state)
                raised = None
            except OSError as exc:
                raised = exc
        if not ops.failed:  # the fault came after the last operation: the loop is complete
            assert raised is None
            break
        failures_seen += 1
        where = f"{ops.failed[0]} (operation {n})"
        if _published_before(ops, n):  # the pointer had moved durably: a failing cleanup is logged, not raised
            assert raised is None, f"a save published before {where} was reported as failed"
        else:
            assert raised is not None and raised.errno == code, f"save reported success over a failed {where}"
        assert not ops.synced_after_failure, f"a failed fsync was retried after {where}"
        moved = (root / "latest").read_bytes() != pointer_before
        committed = (root / "gen-000000000002").is_dir()  # left by a failed commit step, complete: rolled forward
        name, got = _restore(root)
        assert (name, got) == (("gen-000000000002", new) if moved or committed else ("gen-000000000001", previous)), \
            where
        store = LocalStore(root, create=False)
        for generation in store.generations():
            verify_generation(store, generation)  # nothing partial is visible
        # a healthy disk again: the next save succeeds and sweeps what the failure left
        again = make_state(seed=5)
        with ts.CheckpointManager(root, keep_last=1) as ckpt:
            ckpt.restore(again)  # the run continues from whatever survived
            step(again)
            again.next_update = 3
            ckpt.save(again)
        assert LocalStore(root, create=False).leftovers() == [], where
        assert _restore(root) == ("gen-000000000003", fingerprint(again))
        shutil.rmtree(root)
    else:
        pytest.fail("the save never completed")
    assert failures_seen >= 15
    print(f"\n{errno.errorcode[code]} {'persistent' if persistent else 'one-shot'}: "
          f"{failures_seen} failing positions checked")


def test_failed_fsync_abandons_the_generation(tmp_path, template):
    """The first file fsync fails: the save raises, the staging is dropped, the pointer stays."""
    source, state, previous, _, _ = template
    root = tmp_path / "run"
    shutil.copytree(source, root)
    fsyncs = 0

    class FailFirstFsync(FaultOps):
        def fsync(self, fd):
            nonlocal fsyncs
            fsyncs += 1
            if fsyncs == 1:
                raise OSError(errno.EIO, "injected EIO on the first fsync")
            super().fsync(fd)

    ops = FailFirstFsync(0, errno.EIO, False)
    with ts.CheckpointManager(root, store=LocalStore(root, ops=ops)) as ckpt:
        with pytest.raises(OSError, match="first fsync"):
            ckpt.save(state)
    assert fsyncs == 1, "the failed fsync was retried or the save went on syncing"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("gen-")) == ["gen-000000000001"]
    assert _restore(root) == ("gen-000000000001", previous)
