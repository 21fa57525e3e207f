"""The library says what it did on the ``trainstate`` logger, one line per save and restore, and never prints."""

from __future__ import annotations

import logging

import torch

import trainstate as ts


def _state() -> ts.TrainState:
    torch.manual_seed(0)
    return ts.TrainState(model=torch.nn.Linear(64, 64), capture_global_rngs=False)


def test_one_info_line_per_save_and_restore_a_warning_per_fallback_and_nothing_on_stdout(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="trainstate")
    state = _state()
    with ts.CheckpointManager(tmp_path, keep_last=3) as ckpt:
        for update in (1, 2):
            state.next_update = update
            ckpt.save(state)
        state.next_update = 3
        ckpt.save(state, blocking=False).wait()
        ckpt.status()
        ckpt.plan()
    saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved gen-")]
    assert len(saved) == 3 and all(" bytes in " in m and "GB/s" in m for m in saved)
    assert "in the background" in saved[-1]
    damaged = tmp_path / "gen-000000000003" / "tensors.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    caplog.clear()
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(_state())
    restored = [r for r in caplog.records if r.getMessage().startswith("restored gen-")]
    assert len(restored) == 1 and restored[0].levelno == logging.INFO
    assert info.generation.name in restored[0].getMessage() and "passing over gen-000000000003" in \
        restored[0].getMessage()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "gen-000000000003" in r.getMessage()]
    assert len(warnings) == 1  # one WARNING for the fallback
    assert capsys.readouterr().out == ""  # the library itself prints nothing


def test_the_control_a_print_would_be_caught(capsys):
    print("x")
    assert capsys.readouterr().out == "x\n"
