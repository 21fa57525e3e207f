"""Issue 11, items 9 and 10 (the parts outside the format): typed errors everywhere, errors that pickle,
read-only and vanished run directories, links, and messages that say what happened.
"""

from __future__ import annotations

import inspect
import os
import pickle
import shutil
from pathlib import Path

import pytest

import trainstate as ts
import trainstate.errors as errors
from trainer import build, step
from trainstate.asyncsave import AsyncSaveFailed
from trainstate.drill import DrillError


def _examples() -> list[BaseException]:
    """One instance of every error class trainstate defines, built with the arguments it takes."""
    out = [
        errors.CorruptGeneration("gen-000000000001/state.json", "digest mismatch"),
        errors.NoValidGeneration("/runs/x", [errors.Rejection("gen-000000000001", "truncated")]),
        errors.ContractMismatch("gen-000000000001", [errors.FieldChange("config.lr", 0.1, 0.2)], fixed=[]),
        errors.UnsupportedValue("scheduler.lr_lambdas[0]", lambda: 0),
        errors.InsufficientSpace("/runs/x", "gen-000000000002", 10_000, 5),
        errors.PinNotFound("no pin named 'final'"),
        errors.CheckpointFailed("write", {1: "OSError: disk full"}, peer_lost=True),
        AsyncSaveFailed("background save of gen-000000000003 failed"),
        DrillError("a worker hung"),
    ]
    simple = [c for _, c in inspect.getmembers(errors, inspect.isclass)
              if issubclass(c, errors.TrainStateError) and c not in {type(e) for e in out}
              and c is not errors.TrainStateError]
    return out + [c(f"{c.__name__}: something specific") for c in simple] + [errors.TrainStateError("root")]


@pytest.mark.parametrize("error", _examples(), ids=lambda e: type(e).__name__)
def test_every_error_survives_pickle_with_its_message_and_attributes(error):
    """Before: CorruptGeneration(where, reason) and others failed to unpickle (TypeError in __init__)."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error) and again.args == error.args
    assert {k: v for k, v in vars(again).items() if k != "__traceback__"} == \
        {k: v for k, v in vars(error).items() if k != "__traceback__"} or type(error) is errors.UnsupportedValue
    if isinstance(error, OSError):
        assert (again.errno, again.strerror) == (error.errno, error.strerror)


def test_every_error_derives_from_the_root_and_names_its_builtin():
    assert issubclass(ts.InvalidArgument, ValueError) and issubclass(ts.InvalidType, TypeError)
    assert issubclass(ts.ReadOnlyDirectory, PermissionError) and issubclass(ts.RunDirectoryGone, FileNotFoundError)
    assert issubclass(ts.ExistingRun, FileExistsError)
    for name in ts.__all__:
        obj = getattr(ts, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, ts.ContinuationWarning):
            assert issubclass(obj, ts.TrainStateError), name


@pytest.mark.parametrize("call, error", [
    (lambda d: ts.CheckpointManager(d, keep_last=0), ts.InvalidArgument),
    (lambda d: ts.CheckpointManager(d, keep_last=2, retention=ts.Retention()), ts.InvalidArgument),
    (lambda d: ts.CheckpointManager(d, verify="sometimes"), ts.InvalidArgument),
    (lambda d: ts.CheckpointManager(d, headroom=-1), ts.InvalidArgument),
    (lambda d: ts.CheckpointManager(d, max_in_flight=0), ts.InvalidArgument),
    (lambda d: ts.CheckpointManager(d, rehearse="not a function"), ts.InvalidType),
    (lambda d: ts.Retention(keep_last=0), ts.InvalidArgument),
    (lambda d: ts.Retention(best=("loss", "lowest")), ts.InvalidArgument),
    (lambda d: ts.Cadence(mtbf_s=-1), ts.InvalidArgument),
    (lambda d: ts.PreemptionHandler(grace_s=-1), ts.InvalidArgument),
    (lambda d: ts.TrainState(model=object()), ts.InvalidType),
    (lambda d: ts.sample_generator(ts.SampleIndex(1, epoch=0, seed=1), kind="jax"), ts.InvalidArgument),
], ids=["keep_last=0", "keep_last+retention", "verify", "headroom", "max_in_flight", "rehearse", "Retention",
        "best-mode", "Cadence", "grace", "TrainState", "sample_generator"])
def test_api_misuse_raises_typed_errors(tmp_path, call, error):
    with pytest.raises(error):
        call(tmp_path)


def test_save_time_misuse_raises_typed_errors(tmp_path):
    state = build()
    step(state)
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.InvalidArgument, match="metric"):
            ckpt.save(state, metrics={"bad name!": 1.0})
        with pytest.raises(ts.InvalidArgument, match="finite"):
            ckpt.save(state, metrics={"loss": float("nan")})
        state.next_update = 10**12
        with pytest.raises(ts.InvalidArgument, match="next_update"):
            ckpt.save(state)
        with pytest.raises(ts.InvalidArgument, match="cadence"):
            ckpt.due(state)
        with pytest.raises(ts.GenerationNotFound):
            ckpt.pin("final", "gen-000000000077")
        with pytest.raises(ts.PinNotFound, match="no pin named 'final'"):
            ckpt.unpin("final")


# read-only and vanished directories ---------------------------------------------------------------------
def test_a_read_only_run_directory_restores_and_refuses_saves_by_name(tmpfs):
    """Before: restore-only use failed on the lock file with a raw OSError (EROFS)."""
    mount = tmpfs.mount("16m")
    run = mount / "run"
    state = build()
    with ts.CheckpointManager(run) as ckpt:
        step(state)
        ckpt.save(state)
    tmpfs.remount_ro(mount)
    with ts.CheckpointManager(run) as ckpt:
        assert ckpt.restore(evaluation := build(seed=5)).generation.name == "gen-000000000001"
        assert ckpt.status().recovery_point == "gen-000000000001"
        step(evaluation)
        with pytest.raises(ts.ReadOnlyDirectory, match=str(run)):
            ckpt.save(evaluation)
        with pytest.raises(ts.ReadOnlyDirectory):
            ckpt.pin("final", "gen-000000000001")
    from trainstate.cli import main
    assert main(["verify", str(run)]) == 0 and main(["ls", str(run)]) == 0


def test_a_run_directory_deleted_while_open_is_named(tmp_path):
    """Before: a raw FileNotFoundError naming a staging path."""
    state = build()
    with ts.CheckpointManager(tmp_path / "run") as ckpt:
        step(state)
        ckpt.save(state)
        shutil.rmtree(tmp_path / "run")
        step(state)
        with pytest.raises(ts.RunDirectoryGone, match="was deleted while this manager had it open"):
            ckpt.save(state)


def test_a_recreated_run_directory_is_not_shared_with_a_second_writer(tmp_path):
    """Before: after the directory was recreated, a second manager took the lock while the first still saved there."""
    state = build()
    first = ts.CheckpointManager(tmp_path / "run").__enter__()
    try:
        step(state)
        first.save(state)
        shutil.rmtree(tmp_path / "run")
        with ts.CheckpointManager(tmp_path / "run") as second:  # a new directory: its lock is free
            other = build(seed=1)
            step(other)
            second.save(other)
            step(state)
            with pytest.raises(ts.RunDirectoryGone, match="created again"):
                first.save(state)
            assert second.generations() == ["gen-000000000001"]
    finally:
        first.close()


def test_two_managers_in_one_process_are_told_apart_from_another_process(tmp_path):
    with ts.CheckpointManager(tmp_path):
        with pytest.raises(ts.DirectoryLocked, match="another CheckpointManager in this process"):
            ts.CheckpointManager(tmp_path).__enter__()


def test_a_pointer_to_a_symlinked_generation_is_refused_like_the_listing_refuses_it(tmp_path):
    """Before: the pointer path read through a linked generation directory that fallback skipped."""
    state = build()
    with ts.CheckpointManager(tmp_path / "run", keep_last=5) as ckpt:
        for _ in range(2):
            step(state)
            ckpt.save(state)
    run = tmp_path / "run"
    os.rename(run / "gen-000000000002", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", run / "gen-000000000002")
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(build(seed=3))
    assert info.generation.name == "gen-000000000001"
    assert any("symbolic link" in r.reason for r in info.rejected)
    assert Path(run / "gen-000000000002").is_symlink()  # nothing deleted
