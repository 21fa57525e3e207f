"""Issue 14 (in part): the buffers a background save copies into can be allocated, and faulted in, ahead of it."""

from __future__ import annotations

import torch

import trainstate as ts
from trainer import build, step


def _buffers(ckpt: ts.CheckpointManager) -> dict[str, int]:
    return {name: t.data_ptr() for slot in ckpt._writer._pool for name, t in slot._buffers.items()}


def test_the_first_background_save_copies_into_the_preallocated_buffers(tmp_path):
    state = build(seed=1)
    step(state)
    with ts.CheckpointManager(tmp_path, max_in_flight=2) as ckpt:
        nbytes = ckpt.preallocate(state)
        tensor_bytes = sum(p.nbytes for p in state["model"].parameters())
        assert nbytes >= 2 * tensor_bytes  # both slots, every tensor (parameters, buffers, moments)
        before = _buffers(ckpt)
        assert before and all(t.abs().sum() == 0 for slot in ckpt._writer._pool for t in slot._buffers.values()
                              if t.is_floating_point())  # written once: faulted in
        ckpt.save(state, blocking=False).wait()
        assert _buffers(ckpt) == before  # nothing allocated by the save itself
    with ts.CheckpointManager(tmp_path) as ckpt:
        again = build(seed=2)
        assert ckpt.restore(again).identical_continuation
        assert torch.equal(again["model"][0].weight, state["model"][0].weight)


def test_control_without_preallocation_the_first_save_allocates(tmp_path):
    state = build(seed=1)
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert _buffers(ckpt) == {}
        ckpt.save(state, blocking=False).wait()
        assert _buffers(ckpt)
