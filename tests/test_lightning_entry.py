"""The Lightning checkpoint entry and the one-state-per-step rule: pure logic, no Lightning import."""

from __future__ import annotations

import re
from pathlib import PurePath

import pytest

from trainstate.errors import CorruptGeneration, GenerationExists
from trainstate.format.manifest import check_name
from trainstate.integrations.lightning_entry import (Entry, apply_overrides, bridge_name, bridged, entry_bytes,
                                                     found_as_last, is_last, looks_like_entry, parse_entry, pin_name,
                                                     referenced_paths, same_state_overrides)

MC = "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 3}"


def _checkpoint(last_model_path: str = "", step_tensor: str = "lightning.state_dict.w") -> dict:
    return {"global_step": 3, "state_dict": {"w": {"$t": step_tensor}}, "loops": {"fit_loop": {"done": 1}},
            "callbacks": {MC: {"best_model_path": "/c/epoch=0-step=3.ckpt", "last_model_path": last_model_path,
                               "kth_value": {"$t": "lightning.callbacks.kth"}}}}


def test_entry_round_trips_and_is_recognised():
    entry = Entry(".", "gen-000000000018", "ab" * 32, 18, ((("callbacks", MC, "last_model_path"), "/c/last.ckpt"),))
    data = entry_bytes(entry)
    assert looks_like_entry(data) and len(data) < 1024
    assert parse_entry(data, "last.ckpt") == entry


@pytest.mark.parametrize("data", [b"\x80\x04garbage", b"PK\x03\x04zip", b"{}", b'{"format": "other"}'])
def test_anything_else_is_not_an_entry(data):
    with pytest.raises(CorruptGeneration):
        parse_entry(data, "x.ckpt")


def test_a_malformed_entry_is_refused():
    good = entry_bytes(Entry(".", "gen-000000000003", "00", 3))
    for broken in (good.replace(b"gen-000000000003", b"../../etc"),
                   good.replace(b'"next_update": 3', b'"next_update": "3"'),
                   good.replace(b'"format_version": 1', b'"format_version": 9'), good[:-10]):
        with pytest.raises(CorruptGeneration):
            parse_entry(broken, "x.ckpt")


def test_last_files_are_recognised_as_lightning_does():
    assert is_last("last.ckpt") and is_last("last-v1.ckpt") and is_last("last-3.ckpt")
    assert not is_last("epoch=0-step=3.ckpt") and not is_last("lastly.ckpt") and not is_last("my-last.ckpt")


def _lightning_takes_for_last(filename: str) -> bool:
    """ModelCheckpoint._find_last_checkpoints (Lightning 2.6), written out: the oracle for found_as_last."""
    path = PurePath(filename)
    return path.suffix == ".ckpt" and bool(re.match(r"^last(-(\d+))?", path.stem))


@pytest.mark.parametrize("name", ["last.ckpt", "last-v1.ckpt", "last-3.ckpt", "lastly.ckpt", "last.trainstate-x.ckpt",
                                  "my-last.ckpt", "last", "last.ckpt.tmp", ".last.ckpt", "epoch=0-step=3.ckpt",
                                  bridge_name("gen-000000000003"), bridge_name("gen-000000000003-r001")])
def test_found_as_last_is_lightnings_own_search(name):
    assert found_as_last(name) == _lightning_takes_for_last(name)


def test_a_bridge_is_found_as_last_and_never_a_name_modelcheckpoint_writes():
    for generation in ("gen-000000000003", "gen-000000000018-r002"):
        name = bridge_name(generation)
        assert found_as_last(name) and not is_last(name) and bridged(name) == generation
    assert [bridged(n) for n in ("last.ckpt", "last-v1.ckpt", "last.trainstate-gen-3.ckpt", "x.ckpt")] == [None] * 4


def test_referenced_paths_are_every_modelcheckpoints_files():
    checkpoint = {"callbacks": {
        MC: {"best_k_models": {"/c/a.ckpt": 1.0, "/c/b.ckpt": 2.0}, "best_model_path": "/c/a.ckpt",
             "kth_best_model_path": "/c/b.ckpt", "last_model_path": "", "kth_value": 2.0},
        "ModelCheckpoint{'monitor': None}": {"last_model_path": "/d/last.ckpt"},
        "TrainStateCallback": {"best_model_path": "/not/a/checkpoint.ckpt"}}}
    assert sorted(set(referenced_paths(checkpoint))) == ["/c/a.ckpt", "/c/b.ckpt", "/d/last.ckpt"]
    assert referenced_paths({}) == [] and referenced_paths({"callbacks": [1]}) == []


def test_pin_names_are_valid_and_distinct():
    names = {pin_name(p) for p in ("last.ckpt", "epoch=0-step=3.ckpt", "sub/epoch=0-step=3.ckpt", "x" * 300)}
    assert len(names) == 4
    for name in names:
        assert check_name("pin", name) == name


def test_the_last_save_of_a_step_differs_only_in_its_path_bookkeeping():
    overrides = same_state_overrides(_checkpoint(""), _checkpoint("/c/last.ckpt"), "gen-000000000003")
    assert overrides == ((("callbacks", MC, "last_model_path"), "/c/last.ckpt"),)
    loaded = _checkpoint("")
    apply_overrides(loaded, overrides, "last.ckpt")
    assert loaded == _checkpoint("/c/last.ckpt")


def test_any_other_difference_at_a_published_step_is_refused():
    """Negative control: the same-step rule catches a changed loop, a new key and a different tensor."""
    base = _checkpoint()
    changed_loop = _checkpoint()
    changed_loop["loops"]["fit_loop"]["done"] = 2
    new_key = _checkpoint()
    new_key["extra"] = 1
    other_tensor = _checkpoint(step_tensor="lightning.state_dict.w#2")
    for again, where in ((changed_loop, "loops.fit_loop.done"), (new_key, "extra"), (other_tensor, "state_dict.w")):
        with pytest.raises(GenerationExists, match=where.replace(".", r"\.")):
            same_state_overrides(base, again, "gen-000000000003")


def test_an_override_that_no_longer_fits_is_refused():
    with pytest.raises(CorruptGeneration):
        apply_overrides(_checkpoint(), ((("callbacks", MC, "kth_value"), "x"),), "last.ckpt")
    with pytest.raises(CorruptGeneration):
        apply_overrides(_checkpoint(), ((("callbacks", "Other", "last_model_path"), "x"),), "last.ckpt")
