"""Crash-state enumeration of a real save, and the mutation meta-test that proves the checker has teeth.

Invariants on every crash state the weak model allows:
1. restore succeeds and returns the previous generation or the new one, bitwise;
2. once ``save`` has returned (the whole trace persisted as required), always the new one;
3. a ``latest`` pointer that exists parses and names a generation that fully verifies
   (the protocol never relies on fallback to survive its own crash windows);
4. no partial generation is ever visible: every ``gen-*`` directory fully verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import trainstate as ts
from crashfs import Link, RecordingOps, Sync, Unlink, crash_state, explore, swapped
from trainer import build, full_state, step
from trainstate.state import parts, rng
from trainstate.format.codec import TensorTable, encode
from trainstate.storage.local import LocalStore
from trainstate.storage.verify import verify_generation

SAMPLES = int(os.environ.get("TRAINSTATE_CRASH_SAMPLES", "2000"))
SEED = int(os.environ.get("TRAINSTATE_CRASH_SEED", "20261202"))


def fingerprint(state: ts.TrainState) -> str:
    table = TensorTable()
    skeleton = encode({"state": full_state(state), "blob": state["blob"].value, "rng": rng.capture(state.rngs)},
                      "", table)
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for name in sorted(table.tensors):
        h.update(name.encode() + table.tensors[name].contiguous().reshape(-1).view(-1).numpy().tobytes())
    return h.hexdigest()


class Blob:
    """A component with a few hundred KB of tensor data, so torn writes span many pages."""

    def __init__(self, seed: int):
        self.value = {"w": torch.randn(96 * 1024, generator=torch.Generator().manual_seed(seed))}

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


def make_state(seed: int = 0) -> ts.TrainState:
    state = build(seed=seed)
    state.components["blob"] = Blob(seed)
    return state


def record_save(root: Path, noop_sync: int | None = None, scenario: str = "plain"):
    """Publish gen 1 normally, then record the save of gen 2 (keep_last=1, so gen 1 is pruned).

    ``orphan`` also leaves what a crash of an earlier attempt leaves: a staging
    directory, a pointer temp file and a complete but uncommitted gen 2 of other
    content, which the recorded save must clean up and supersede.
    """
    run = root / "run"
    state = make_state()
    step(state)
    full_every = 5 if scenario == "incremental" else None
    with ts.CheckpointManager(run, keep_last=1, full_every=full_every) as ckpt:
        ckpt.save(state)
        if scenario == "incremental":  # gen 1 lays nothing out; gen 2 puts the unchanged blob in a part file
            step(state)
            ckpt.save(state)
    expected = {ckpt.latest(): fingerprint(state)}
    if scenario == "orphan":
        other = make_state(seed=55)
        other.next_update = 2
        with ts.CheckpointManager(root / "other") as ckpt:
            ckpt.save(other)
        shutil.copytree(root / "other" / "gen-000000000002", run / "gen-000000000002")
        shutil.copytree(root / "other" / "gen-000000000002", run / ".trainstate-staging-gen-000000000002-00000000000000aa")
        (run / ".trainstate-tmp-latest-00000000000000bb").write_bytes(b'{"partial')
    step(state)
    ops = RecordingOps(run, noop_sync=noop_sync)
    with ts.CheckpointManager(run, keep_last=1, store=LocalStore(run, ops=ops), full_every=full_every) as ckpt:
        info = ckpt.save(state)  # incremental: gen 3 links gen 2's part file, then gen 2 is pruned
    expected[info.name] = fingerprint(state)
    return ops, expected


class Checker:
    def __init__(self, root: Path, ops: RecordingOps, expected: dict[str, str]):
        self.root, self.ops, self.expected = root, ops, expected
        self.seen: dict[str, str | None] = {}
        self.states = 0

    def violation(self, trace, case) -> str | None:
        """None if the crash state satisfies every invariant, else what went wrong."""
        tree = crash_state(self.ops.initial, trace, case.crash, dict(case.keep))
        final = case.crash == len(trace)
        key = tree.fingerprint() + ("/final" if final else "")
        if key in self.seen:
            return self.seen[key]
        self.states += 1
        directory = self.root / f"state-{self.states}"
        tree.materialise(directory)
        try:
            self.seen[key] = problem = self._check(directory, final)
        finally:
            shutil.rmtree(directory)
        return problem and f"{problem} [crash after {case.crash}/{len(trace)} ops, {case.how}]"

    @staticmethod
    def _rolled_forward(directory: Path, name: str, info) -> bool:
        """The pointer was one step behind a complete generation (a crash between commit and pointer move):
        restore took the newer one and reported the pointer alone. Not a fallback."""
        try:
            pointed = json.loads((directory / "latest").read_bytes())["generation"]
        except (ValueError, KeyError, TypeError):
            return False  # a torn pointer: restore had to fall back
        return name > pointed and [r.generation for r in info.rejected] == ["latest"]

    def _check(self, directory: Path, final: bool) -> str | None:
        state = make_state(seed=4321)
        try:
            with ts.CheckpointManager(directory) as ckpt:
                info = ckpt.restore(state)
        except ts.TrainStateError as exc:
            return f"restore failed: {exc}"
        if info is None:
            return "restore found nothing"
        name = info.generation.name
        if name not in self.expected:
            return f"restored unexpected {name}"
        if final and name != max(self.expected):
            return f"save had returned but restore chose {name}"
        if fingerprint(state) != self.expected[name]:
            return f"{name} restored but not bitwise equal to what was saved"
        if (directory / "latest").exists() and info.rejected and not self._rolled_forward(directory, name, info):
            return f"the pointer existed but restore had to fall back: {info.rejected}"
        store = LocalStore(directory, create=False)
        for generation in store.generations():
            try:
                verify_generation(store, generation)
            except ts.CorruptGeneration as exc:
                return f"a partial generation is visible: {exc}"
        return None


def run_checker(tmp_path: Path, ops, expected, trace=None, samples=SAMPLES, stop_at_first=False):
    checker = Checker(tmp_path, ops, expected)
    trace = ops.trace if trace is None else trace
    problems = []
    cases = 0
    for case in explore(trace, samples, SEED, ops.groups if trace is ops.trace else ()):
        cases += 1
        problem = checker.violation(trace, case)
        if problem:
            problems.append(problem)
            if stop_at_first:
                break
    return problems, cases, checker.states


@pytest.mark.parametrize("scenario", ["plain", "orphan", "incremental"])
def test_every_crash_state_restores_previous_or_new(tmp_path, scenario, monkeypatch):
    monkeypatch.setattr(parts, "SMALL_BYTES", 64 << 10)  # the blob (384 KB) is a part file of its own
    ops, expected = record_save(tmp_path, scenario=scenario)
    kinds = {type(op).__name__ for op in ops.trace}
    assert kinds == {"Link", "Unlink", "Write", "Sync"}
    if scenario == "incremental":  # the part file is linked (a second name for its inode), never rewritten
        linked = [op for op in ops.trace if isinstance(op, Link) and op.name.startswith("part-")]
        assert linked and all(op.inode in ops.initial.files for op in linked), linked
    problems, cases, states = run_checker(tmp_path, ops, expected)
    print(f"\ncrash states ({scenario}): {len(ops.trace)} recorded operations, {cases} cases explored, "
          f"{states} distinct on-disk states checked")
    assert not problems, "\n".join(problems[:10])
    # Distinct states are far fewer than cases: the protocol syncs everything before it becomes
    # visible, so most lost or torn writes land in names nothing reads. The mutants below show
    # the same exploration finds the states where that is not so.
    assert cases >= SAMPLES and states >= 40


def _syncs(root: Path) -> list[str]:
    ops, _ = record_save(root / "probe")
    return [op.label for op in ops.trace if isinstance(op, Sync)]


def test_each_noop_fsync_is_caught(tmp_path):
    """Mutation meta-test: with any one fsync (file or directory) turned into a no-op, a violation is found."""
    labels = _syncs(tmp_path)
    assert len(labels) >= 8
    survivors = []
    for index, label in enumerate(labels, start=1):
        ops, expected = record_save(tmp_path / f"noop-{index}", noop_sync=index)
        problems, _, _ = run_checker(tmp_path / f"noop-{index}", ops, expected, samples=0, stop_at_first=True)
        if not problems:
            survivors.append(f"fsync #{index} ({label})")
    assert not survivors, f"mutants not caught: {survivors}"


def _is_persistence(op) -> bool:
    return isinstance(op, (Sync, Link, Unlink))


def test_swapped_persistence_operations_are_caught(tmp_path):
    """Mutation meta-test: moving a barrier after an operation that must follow it is caught.

    A swap of two barriers, or of a barrier with an entry change in another
    directory or on a name readers ignore, is an equivalent mutant: it is
    counted, not required to fail. Every other swap must be caught.
    """
    ops, expected = record_save(tmp_path / "base")
    trace = ops.trace
    caught, equivalent, survivors = [], [], []
    for i in range(len(trace) - 1):
        a, b = trace[i], trace[i + 1]
        if not (_is_persistence(a) and _is_persistence(b)) or not (isinstance(a, Sync) or isinstance(b, Sync)):
            continue
        problems, _, _ = run_checker(tmp_path / f"swap-{i}", ops, expected, trace=swapped(trace, i),
                                     samples=0, stop_at_first=True)
        (tmp_path / f"swap-{i}").mkdir(exist_ok=True)
        if problems:
            caught.append(i)
        elif isinstance(a, Sync) and isinstance(b, Sync) or _independent(a, b):
            equivalent.append(i)
        else:
            survivors.append(f"{i}: {a} <-> {b}")
    print(f"\nswap mutants: {len(caught)} caught, {len(equivalent)} equivalent: {caught} / {equivalent}")
    assert caught and not survivors, survivors


def _independent(a, b) -> bool:
    """A sync commutes with an entry change in another directory, or with one on a name that
    readers never look at (staging, pointer temp and trash names): no reader can tell the orders apart."""
    sync, other = (a, b) if isinstance(a, Sync) else (b, a)
    return sync.inode != other.dir or other.name.startswith(".trainstate-")


def test_recorded_trace_follows_the_protocol(tmp_path):
    """The order the crash model sees is the documented one: data and its fsync, the staging
    directory's fsync, rename, the run directory's fsync, pointer, and only then pruning."""
    ops, _ = record_save(tmp_path)
    steps = []
    for op in ops.trace:
        if isinstance(op, Sync):
            steps.append(("sync", op.label.split("-")[0] if op.label.startswith(".trainstate") else op.label))
        elif isinstance(op, Link) and op.dir == 0:
            steps.append(("link", op.name.rsplit("-", 1)[0] if op.name.startswith(".trainstate") else op.name))
    assert steps == [
        ("link", ".trainstate-staging-gen-000000000002"),
        ("sync", "state.json"), ("sync", "tensors.safetensors"), ("sync", "manifest.json"),
        ("sync", ".trainstate"),  # the staging directory
        ("link", "gen-000000000002"), ("sync", "<run dir>"),
        ("link", ".trainstate-tmp-latest"), ("sync", ".trainstate"),  # the new pointer's data
        ("link", "latest"), ("sync", "<run dir>"),
        ("link", ".trainstate-trash-gen-000000000001"), ("sync", "<run dir>"),
    ]
