"""Pruned generations are deleted off the save path, and never under a name restore could pick."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import torch

import trainstate as ts
from trainstate import restore as restore_mod
from trainstate.storage.local import _LEFTOVER_RE, LocalStore


def _state() -> ts.TrainState:
    torch.manual_seed(0)
    return ts.TrainState(model=torch.nn.Linear(256, 256), capture_global_rngs=False)


class Gate:
    """An rmtree that records what it deletes and waits until the test opens the gate."""

    def __init__(self, real):
        self.real, self.open, self.started, self.paths = real, threading.Event(), threading.Event(), []

    def __call__(self, path):
        self.paths.append(path.name)
        self.started.set()
        assert self.open.wait(60)
        self.real(path)


def test_deletion_runs_after_the_save_returns_and_only_on_trash(tmp_path):
    state = _state()
    with ts.CheckpointManager(tmp_path, keep_last=1) as ckpt:
        gate = Gate(ckpt.store.ops.rmtree)
        ckpt.store.ops.rmtree = gate
        for update in (1, 2):
            state.next_update = update
            ckpt.save(state)  # the second save prunes gen 1; its deletion waits at the gate
        assert gate.started.wait(30)
        names = os.listdir(tmp_path)
        assert "gen-000000000001" not in names and "gen-000000000002" in names  # gone at once, by rename
        trash = [n for n in names if n.startswith(".trainstate-trash-gen-000000000001")]
        assert len(trash) == 1 and trash[0] not in ckpt.store.leftovers()  # being deleted: not a leftover
        fresh = _state()
        info, _ = restore_mod.restore(LocalStore(tmp_path, create=False), fresh, key=None)  # a reader meanwhile
        assert info.generation.name == "gen-000000000002"
        gate.open.set()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".trainstate-trash")]  # close joined it
    assert gate.paths and all(_LEFTOVER_RE.fullmatch(p) and "trash" in p for p in gate.paths)


def test_without_deferral_removal_is_synchronous(tmp_path):
    """The control: a store used directly (the CLI's prune) deletes before remove() returns."""
    state = _state()
    with ts.CheckpointManager(tmp_path, keep_last=5) as ckpt:
        for update in (1, 2):
            state.next_update = update
            ckpt.save(state)
    store = LocalStore(tmp_path, create=False)
    store.remove("gen-000000000001")
    assert not [n for n in os.listdir(tmp_path) if "gen-000000000001" in n]


CHILD = textwrap.dedent("""
    import sys, time, pathlib, torch, trainstate as ts
    run = sys.argv[1]
    torch.manual_seed(0)
    state = ts.TrainState(model=torch.nn.Linear(512, 512), capture_global_rngs=False)
    ckpt = ts.CheckpointManager(run, keep_last=1)
    real = ckpt.store.ops.rmtree
    def half(path):  # delete one file, then stall: the kill lands mid-deletion
        files = sorted(path.iterdir())
        files[0].unlink()
        pathlib.Path(run, "..", "deleting").resolve().write_text(path.name)
        time.sleep(600)
    ckpt.store.ops.rmtree = half
    for update in (1, 2):
        state.next_update = update
        ckpt.save(state)
    print("saved", flush=True)
    time.sleep(600)
""")


def test_kill_during_background_deletion_leaves_only_trash(tmp_path):
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        while not (tmp_path / "deleting").exists():
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    trash = (tmp_path / "deleting").read_text()
    assert (run / trash).is_dir() and "gen-000000000001" in trash  # half deleted, under its trash name only
    assert sorted(n for n in os.listdir(run) if n.startswith("gen-")) == ["gen-000000000002"]
    state = _state()
    with ts.CheckpointManager(run, keep_last=1) as ckpt:
        assert trash in ckpt.store.leftovers()
        state = ts.TrainState(model=torch.nn.Linear(512, 512), capture_global_rngs=False)
        assert ckpt.restore(state).generation.name == "gen-000000000002"  # what restore picks is whole
        state.next_update = 3
        ckpt.save(state)  # the next save removes the trash
    assert not (run / trash).exists()
    assert sorted(n for n in os.listdir(run) if n.startswith("gen-")) == ["gen-000000000003"]
