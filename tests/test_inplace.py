"""In-place restore: tensors read straight into the live ones, after the whole generation verified.

Bitwise continuation as with the copying restore; live storage is reused
(no second copy of the state); every check still runs before the first live
byte changes; a generation that changes between the verifying pass and the
loading pass is reported as such.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import trainstate as ts
import trainstate.restore as restore_mod
from trainer import assert_same, build, full_state, next_draws, step


def _pointers(state: ts.TrainState) -> list[int]:
    out = [p.data_ptr() for p in state["model"].parameters()]
    for s in state["optimizer"].state.values():
        out += [v.data_ptr() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    return out


def _seed_globals(seed: int = 7) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    _seed_globals()
    state = build()
    for _ in range(10):
        step(state)
    return full_state(state), next_draws(state)


def _saved_at_5(tmp_path, digest="blake3-chunked"):
    _seed_globals()
    state = build()
    with ts.CheckpointManager(tmp_path, keep_last=5, digest=digest) as ckpt:
        for _ in range(4):
            step(state)
        ckpt.save(state)
        step(state)
        ckpt.save(state)
    return state


@pytest.mark.parametrize("digest", ["blake3-chunked", "blake3"], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("stepped", [True, False], ids=["live-optimizer-state", "fresh-optimizer"])
def test_in_place_restore_continues_bitwise_into_live_storage(tmp_path, reference, stepped, digest):
    _saved_at_5(tmp_path, digest)
    live = build(seed=99)
    if stepped:
        step(live)  # the optimizer now holds moments: they are read into, not replaced
    before = _pointers(live)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(live, in_place=True)
    assert info.generation.name == "gen-000000000005"
    if stepped:
        assert _pointers(live) == before  # every parameter and moment kept its storage
    else:
        assert _pointers(live)[:len(before)] == before  # parameters kept theirs
    while live.next_update < 10:
        step(live)
    assert_same(full_state(live), reference[0])
    assert next_draws(live) == reference[1]


def test_copying_restore_replaces_optimizer_storage(tmp_path):
    """The control: without in_place, moments arrive as new tensors (the extra copy in-place avoids)."""
    _saved_at_5(tmp_path)
    live = build(seed=99)
    step(live)
    before = _pointers(live)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(live, in_place=False)
    assert _pointers(live) != before


def _damage_tensors(run, name):
    path = run / name / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_latest_falls_back_and_all_damaged_touches_nothing(tmp_path):
    _saved_at_5(tmp_path)
    _damage_tensors(tmp_path, "gen-000000000005")
    live = build(seed=99)
    step(live)
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(live, in_place=True)
    assert info.generation.name == "gen-000000000004" and info.rejected
    _damage_tensors(tmp_path, "gen-000000000004")
    untouched = build(seed=7)
    step(untouched)
    snapshot = full_state(untouched)
    with ts.CheckpointManager(tmp_path) as ckpt, pytest.raises(ts.NoValidGeneration):
        ckpt.restore(untouched, in_place=True)
    assert_same(full_state(untouched), snapshot)


@pytest.mark.parametrize("problem", ["contract", "shape", "rng"])
def test_refusals_happen_before_any_live_byte_changes(tmp_path, problem):
    _saved_at_5(tmp_path)
    live = build(seed=3, contract={"config": {"lr": 1.0}} if problem == "contract" else None)
    step(live)
    allow = []
    if problem == "shape":  # past the contract (architecture change allowed), the shape check must still refuse
        live.components["model"][0] = torch.nn.Linear(6, 16, bias=False)
        allow = ["architecture"]
    if problem == "rng":
        del live.rngs["noise"]
    snapshot = {k: v.clone() for k, v in live["model"].state_dict().items()}
    error = ts.ContractMismatch if problem == "contract" else ts.StateMismatch
    with ts.CheckpointManager(tmp_path) as ckpt, pytest.raises(error):
        ckpt.restore(live, in_place=True, allow_changes=allow)
    for key, value in live["model"].state_dict().items():
        assert torch.equal(value, snapshot[key])


def test_generation_changed_between_passes_is_reported(tmp_path, monkeypatch):
    """Generations with one digest per file (formats 1-2) load in two passes; format 3 reads once."""
    _saved_at_5(tmp_path, "blake3")
    real = restore_mod.decode_verified

    def tamper_then_load(store, manifest, component=None, *, preview=False, into=None, **options):
        if into is not None:
            _damage_tensors(tmp_path, manifest.generation)  # after the verifying pass, before the loading one
        return real(store, manifest, component, preview=preview, into=into, **options)

    monkeypatch.setattr(restore_mod, "decode_verified", tamper_then_load)
    live = build(seed=99)
    with ts.CheckpointManager(tmp_path) as ckpt, pytest.raises(ts.StateMismatch, match="changed on disk"):
        ckpt.restore(live, in_place=True)


def test_auto_mode_switches_on_size(tmp_path, monkeypatch):
    _saved_at_5(tmp_path, "blake3")
    monkeypatch.setattr(restore_mod, "IN_PLACE_BYTES", 0)
    live = build(seed=99)
    step(live)
    before = _pointers(live)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(live)  # in_place=None: above the (patched) threshold
    assert _pointers(live) == before


PEAK = textwrap.dedent("""
    import sys, torch, trainstate as ts
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])  # ~100 MB of parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 1024)).sum().backward(); opt.step(); opt.zero_grad()
    state = ts.TrainState(model=model, optimizer=opt, capture_global_rngs=False)
    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    import gc; gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS: the peak of the restore alone
    base = kib("VmRSS")
    with ts.CheckpointManager(sys.argv[1]) as ckpt:
        info = ckpt.restore(state, in_place=sys.argv[2] == "in-place")
    assert info is not None and info.generation.name == "gen-000000000001", info
    print((kib("VmHWM") - base) * 1024)
""")


def test_in_place_peak_memory_is_bounded(tmp_path):
    """About 300 MB of state (100 MB parameters + AdamW moments): in place adds a small fraction of it;
    the copying restore adds about a full copy. The peak is the kernel's high-water mark, reset just before
    the restore (the training step before it peaks higher than either restore, which hid the control)."""
    run = tmp_path / "run"

    def go(mode):
        out = subprocess.run([sys.executable, "-c", PEAK, str(run), mode], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip() or 0)

    torch.manual_seed(0)  # the save in this process: the same state the child builds (one launch fewer)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()
    opt.zero_grad()
    state = ts.TrainState(model=model, optimizer=opt, capture_global_rngs=False)
    state.next_update = 1
    with ts.CheckpointManager(run) as ckpt:
        ckpt.save(state)
    del state, model, opt
    state_bytes = 3 * 24 * (1024 * 1024 + 1024) * 4
    in_place, copying = go("in-place"), go("copy")
    assert in_place < 0.10 * state_bytes, (in_place, copying)
    assert copying > 0.5 * state_bytes, (in_place, copying)  # the control: a second copy of the state, briefly
