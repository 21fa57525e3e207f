"""Pure parsing and planning: generation names, manifest/pointer parsing, retention plans."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainstate.errors import CorruptGeneration
from trainstate.format.manifest import (FileRecord, Manifest, Pointer, _self_digest, generation_name, newest_first,
                                 parse_generation_name, parse_manifest, parse_pointer)
from trainstate.lifecycle.retention import Retention, best_generation, plan

MANIFEST = Manifest("gen-000000000042", "full", 42, "blake3",
                    (FileRecord("state.json", 10, "ab" * 32), FileRecord("tensors.safetensors", 20, "cd" * 32)),
                    "2026-01-01T00:00:00+00:00", "ef" * 32, {"torch": "x"}, "gen-000000000041")
POINTER = Pointer("gen-000000000042", "12" * 32, 300, "blake3", 42)


def test_names_are_zero_padded_and_ordered_numerically():
    assert generation_name(7) == "gen-000000000007"
    assert generation_name(7, "weights") == "gen-000000000007-weights"
    assert parse_generation_name("gen-000000000100") == (100, "full")
    assert parse_generation_name("gen-100") is None and parse_generation_name("gen-000000000100.tmp") is None
    names = ["gen-000000000009", "gen-000000000100", "gen-000000000010", "notes", "gen-000000000010-weights"]
    assert newest_first(names) == ["gen-000000000100", "gen-000000000010-weights", "gen-000000000010",
                                   "gen-000000000009"]
    with pytest.raises(ValueError):
        generation_name(-1)


def test_manifest_and_pointer_round_trip():
    assert parse_manifest(MANIFEST.to_bytes(), "m") == MANIFEST
    assert parse_pointer(POINTER.to_bytes(), "p") == POINTER


def test_the_self_digest_is_checked_on_the_bytes_as_written_without_re_encoding(monkeypatch):
    from trainstate.format import manifest as module
    from trainstate.format.signing import SigningKey

    key = SigningKey(b"k" * 32)
    written = [MANIFEST.to_bytes(), MANIFEST.to_bytes(key)]  # the signature line is left out of the digest too
    calls = []
    slow = module._self_digest
    monkeypatch.setattr(module, "_self_digest", lambda *a: calls.append(1) or slow(*a))
    for data in written:
        assert parse_manifest(data, "m", key if b'"signature"' in data else None) == MANIFEST
    assert calls == [], "a manifest as written needs no re-encoding"
    # laid out otherwise (the same content): checked by re-encoding, accepted
    relaid = json.dumps(json.loads(written[1]), indent=3).encode()
    assert parse_manifest(relaid, "m", key) == MANIFEST and calls == [1]
    # one character changed where the layout is kept: refused by both checks
    for data in written:
        altered = data.replace(b'"next_update": 42', b'"next_update": 43').replace(b"000000000042", b"000000000043")
        with pytest.raises(CorruptGeneration, match="self-digest"):
            parse_manifest(altered, "m")
    # control: the fast check alone, with the lines it removes left in, would refuse what was written
    assert module.digest_bytes("blake3", written[0][:-1]) != json.loads(written[0])["self_digest"]


def _encoded_whole(manifest: Manifest, key=None) -> bytes:
    """The manifest's encoding as written before it was encoded once: ``asdict``, and the whole object dumped."""
    from dataclasses import asdict

    data = {"format": "trainstate", **asdict(manifest)}
    data["files"] = [{k: (list(v) if k == "chunks" else v) for k, v in asdict(f).items() if k != "chunks" or v}
                     for f in manifest.files]
    for optional in ("data", "metrics", "retention", "lineage", "run", "ranks", "compute", "fingerprints", "shares"):
        if not data[optional]:
            del data[optional]
    if data["world_size"] == 1 and "ranks" not in data:
        del data["world_size"]
    data["self_digest"] = _self_digest(data, manifest.digest_algorithm)
    if key is not None:
        data["signature"] = key.sign(data)
    return json.dumps(data, indent=1, sort_keys=True).encode() + b"\n"


def test_encoded_once_is_byte_for_byte_the_whole_encoding():
    """``to_bytes`` encodes once and adds its own lines where ``json.dumps`` of the whole would put them: the same
    bytes for manifests whose last key sorts before and after ``self_digest`` and ``signature``, signed or not."""
    import dataclasses

    from trainstate.format.signing import SigningKey

    key = SigningKey(b"k" * 32)
    multi = dataclasses.replace(
        MANIFEST, files=(*MANIFEST.files, FileRecord("shard-00000.safetensors", 9 << 20, "aa" * 32, ("bb" * 32,) * 3)),
        world_size=2, ranks=[["rank-00000.json"], ["rank-00001.json"]], data={"d": {"epoch": 1}},
        fingerprints={"shard-00000.safetensors": {"w@": ["float32", [2], "00"]}},
        shares={"shard-00000.safetensors": "gen-000000000041"}, lineage=[["ab", None]], run="r" * 32)
    for manifest in (MANIFEST, multi):
        for signing in (None, key):
            assert manifest.to_bytes(signing) == _encoded_whole(manifest, signing)
    from trainstate.format.manifest import _with_top_level
    for body in ({"a": 1}, {"a": [1, {"b": "c"}], "t": {"u": 1}}, {"zz": 1}, {"a": 1, "sz": "q"}):
        own = {"self_digest": "d", "signature": "s"}  # first, last, between, and among the keys
        assert _with_top_level(json.dumps(body, indent=1, sort_keys=True), own) == \
            json.dumps({**body, **own}, indent=1, sort_keys=True)
    assert _encoded_whole(multi).replace(b"shares", b"sharez") != multi.to_bytes()  # control: a difference shows


@pytest.mark.parametrize("edit", [
    lambda d: d.update(format_version=5),  # a version this reader does not know
    lambda d: d.update(format="other"),
    lambda d: d.update(digest_algorithm="md5"),
    lambda d: d.update(next_update=43),
    lambda d: d.update(generation="gen-000000000042-weights"),
    lambda d: d.update(kind="partial"),
    lambda d: d.pop("files"),
    lambda d: d.update(extra=1),
    lambda d: d["files"].append(d["files"][0]),
    lambda d: d["files"][0].update(name="../escape"),
    lambda d: d["files"][0].update(name="manifest.json"),
    lambda d: d["files"][0].update(size=-1),
    lambda d: d["files"][0].update(size="10"),
    lambda d: d["files"][0].update(digest="XYZ"),
    lambda d: d.update(files=[d["files"][1]]),  # no state.json
])
def test_manifest_rejects_each_malformation(edit):
    data = json.loads(MANIFEST.to_bytes())
    edit(data)
    with pytest.raises(CorruptGeneration):
        parse_manifest(json.dumps(data).encode(), "m")


def test_format_4_fields_are_checked_and_round_trip():
    """Incremental generations: fingerprints of listed tensor files (each tensor in one), shares of listed files
    from an older generation; each resealed malformation is refused (resealing alone is accepted)."""
    import dataclasses

    part = FileRecord("part-0123456789abcdef.safetensors", 30, "aa" * 32)
    fp = ["float32", [2, 3], "0f" * 16]
    good = dataclasses.replace(MANIFEST, files=MANIFEST.files + (part,), format_version=4,
                               fingerprints={"tensors.safetensors": {"a": fp}, part.name: {"b": fp}},
                               shares={part.name: "gen-000000000040"})
    assert parse_manifest(good.to_bytes(), "m") == good
    for bad in (dataclasses.replace(good, format_version=3),
                dataclasses.replace(good, shares={part.name: "gen-000000000043"}),  # from a newer generation
                dataclasses.replace(good, shares={"state.json": "gen-000000000040"}),  # not a tensor file
                dataclasses.replace(good, fingerprints={**good.fingerprints, "other.safetensors": {}}),
                dataclasses.replace(good, fingerprints={"tensors.safetensors": {"a": fp}, part.name: {"a": fp}}),
                dataclasses.replace(good, fingerprints={"tensors.safetensors": {"a": ["float32", [2], "xy"]},
                                                        part.name: {"b": fp}})):
        with pytest.raises(CorruptGeneration):
            parse_manifest(bad.to_bytes(), "m")


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_mutated_metadata_only_ever_raises_corrupt_generation(data):
    source = data.draw(st.sampled_from([MANIFEST.to_bytes(), POINTER.to_bytes()]))
    blob = bytearray(source)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "zero", "insert"]))
        at = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        if kind == "flip" and blob:
            blob[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "truncate":
            del blob[at:]
        elif kind == "zero":
            blob[at:at + data.draw(st.integers(1, 16))] = bytes(len(blob[at:at + 16]))
        else:
            blob[at:at] = data.draw(st.binary(max_size=8))
    for parse in (parse_manifest, parse_pointer):
        try:
            parse(bytes(blob), "fuzz")
        except CorruptGeneration:
            pass


POSITION = {"epoch": 2, "cursor": 5, "batches_per_epoch": 10, "samples_seen": 250, "tokens_seen": 0,
            "next_batch": "ab" * 16}
WITH_DATA = Manifest(**{**MANIFEST.__dict__, "data": {"train": POSITION}})


def test_data_position_round_trips_and_is_omitted_when_empty():
    assert parse_manifest(WITH_DATA.to_bytes(), "m") == WITH_DATA
    assert "data" not in json.loads(MANIFEST.to_bytes())  # older generations' bytes are unchanged
    assert json.loads(WITH_DATA.to_bytes())["data"] == {"train": POSITION}


@pytest.mark.parametrize("edit", [
    lambda d: d.update(data=[]),
    lambda d: d["data"].update(train=[]),
    lambda d: d["data"].update({"../x": POSITION}),
    lambda d: d["data"]["train"].update(epoch=-1),
    lambda d: d["data"]["train"].update(cursor="5"),
    lambda d: d["data"]["train"].update(cursor=True),
    lambda d: d["data"]["train"].pop("samples_seen"),
    lambda d: d["data"]["train"].update(extra=1),
    lambda d: d["data"]["train"].update(next_batch="not hex"),
])
def test_sealed_malformed_data_position_is_corrupt(edit):
    data = json.loads(WITH_DATA.to_bytes())
    edit(data)
    data["self_digest"] = _self_digest(data, data["digest_algorithm"])  # sealed: only the schema can catch it
    with pytest.raises(CorruptGeneration):
        parse_manifest(json.dumps(data).encode(), "m")


def test_deeply_nested_json_is_corrupt_not_recursion_error():
    with pytest.raises(CorruptGeneration):
        parse_manifest(b"[" * 100000 + b"]" * 100000, "m")


def test_keep_last_plan():
    names = [generation_name(u) for u in (1, 2, 3, 10, 20)] + ["gen-000000000002-weights", "foreign"]
    newest = {"full": "gen-000000000010", "weights": "gen-000000000002-weights"}
    p = plan(names, policy=Retention(keep_last=2), newest=newest)
    assert p.keep == ("gen-000000000020", "gen-000000000010", "gen-000000000003", "gen-000000000002-weights")
    assert p.prune == ("gen-000000000002", "gen-000000000001")
    assert "newer than the newest" in p.reasons("gen-000000000020")[0]
    lineage = plan(names, policy=Retention(keep_last=2), newest=newest,
                   lineage={"gen-000000000010", "gen-000000000002", "gen-000000000001"})
    assert lineage.prune == ("gen-000000000001",)
    assert "not an ancestor" in lineage.reasons("gen-000000000003")[0]
    nothing = plan(names, policy=Retention(keep_last=1), newest={"full": None, "weights": None})
    assert nothing.prune == ()
    with pytest.raises(ValueError):
        Retention(keep_last=0)


def test_milestones_pins_and_best_are_kept_with_reasons():
    names = [generation_name(u) for u in range(100, 1100, 100)]
    metrics = {n: {"val_loss": float(abs(u - 400))} for u, n in zip(range(100, 1100, 100), names)}
    best = best_generation(metrics, ("val_loss", "min"))
    assert best == "gen-000000000400"
    assert best_generation(metrics, ("val_loss", "max")) == "gen-000000001000"
    p = plan(names, policy=Retention(keep_last=2, milestone_every=500, best=("val_loss", "min")),
             newest={"full": names[-1]}, pins={"final": "gen-000000000200", "rc": "gen-000000000200"}, best=best)
    assert p.keep == ("gen-000000001000", "gen-000000000900", "gen-000000000500", "gen-000000000400",
                      "gen-000000000200")
    assert p.reasons("gen-000000000200") == ("pinned: final, rc",)
    assert p.reasons("gen-000000000400") == ("best val_loss (min)",)
    assert p.reasons("gen-000000000500") == ("milestone (every 500 updates)",)
    assert "keep   gen-000000001000  newest: the recovery point" in p.describe()
    assert "prune  gen-000000000100  older than the last 2 full generations" in p.describe()
