"""The reader accepts only what the writer produces, in bounded memory (issue 11, item 9).

From files whose digests match (sealed the way anyone who can write the run
directory could), the reader used to accept things no save writes: ``NaN`` and
``Infinity`` literals, duplicate JSON keys (the last one silently won), a
``$tuple`` holding an object (its keys became the tuple), and any string
``torch.device`` would take (``"cuda:256"`` read as ``cuda:0``). Each is now a
:class:`~trainstate.CorruptGeneration`: restore falls back past it and
``trainstate verify`` fails it. And a 57 MiB state.json of empty objects,
which took ``json.loads`` gigabytes, is refused before parsing.
"""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import trainstate as ts
from test_codec_roundtrip import through_files
from test_hostile import (G2, G3, MANIFEST, POINTER, STATE, pristine, reseal, restore_outcome, run,  # noqa: F401
                          seal_pointer)
from trainstate import cli
from trainstate.format import codec, strictjson
from trainstate.format.codec import decode
from trainstate.format.manifest import load_json
from trainstate.state.snapshot import state_json

# --- the parser ---------------------------------------------------------------------------------

NOT_WRITTEN = {
    "nan-literal": b'{"x": NaN}',
    "infinity-literal": b'{"x": [1, Infinity]}',
    "minus-infinity-literal": b'{"x": {"y": -Infinity}}',
    "overflowing-number": b'{"x": 1e400}',
    "overflowing-negative-number": b'{"x": -1e400}',
    "duplicate-key": b'{"kind": "weights", "kind": "full"}',
    "duplicate-nested-key": b'{"x": {"a": 1, "b": 2, "a": 1}}',
    "invalid-utf8": b'{"x": "\xff"}',
    "utf8-bom": b'\xef\xbb\xbf{"x": 1}',
}


@pytest.mark.parametrize("data", NOT_WRITTEN.values(), ids=NOT_WRITTEN.keys())
def test_load_json_refuses_what_no_writer_produces(data):
    json.loads(data.decode("utf-8", "replace").lstrip("\ufeff"))  # control: the permissive parser takes it
    with pytest.raises(ts.CorruptGeneration):
        load_json(data, "f")


def test_load_json_takes_the_writers_output():
    value = {"x": [1.5, -0.0, 1e308, 2**80, "\ud800", "é", None, True, {}], "y": {"$float": "nan"}}
    assert load_json(state_json(value), "f") == json.loads(state_json(value))


# --- the decoder --------------------------------------------------------------------------------

DEVICES_WRITTEN = ["cpu", "cpu:0", "cuda", "cuda:0", "cuda:127", "meta", "mps", "xpu:3", "privateuseone"]
DEVICES_NOT_WRITTEN = ["cuda:128", "cuda:255", "cuda:256", "cuda:-1", "cuda:01", "cuda:+1", "cuda: 1", " cpu",
                       "cpu ", "CPU", "Cuda", "cuda:1:2", "", "cuda:", "foo", "metal", "__import__('os')",
                       "cuda:" + "9" * 30, 5, None, ["cpu"], {"type": "cpu"}]


def test_device_strings_are_those_str_of_a_device_writes(monkeypatch):
    seen = []
    real = torch.device

    def spy(*args):
        seen.append(args)
        return real(*args)

    for text in DEVICES_WRITTEN:
        assert str(decode({"$device": text}, "d", {})) == text
    monkeypatch.setattr(torch, "device", spy)
    for text in DEVICES_NOT_WRITTEN:
        with pytest.raises(ts.CorruptGeneration, match=r"malformed \$device"):
            codec.decode({"$device": text}, "d", {})
    assert seen == [], "an unchecked string reached torch.device"


MALFORMED_TAGS = {
    "tuple-of-object": {"$tuple": {"a": 1, "b": 2}},
    "tuple-of-string": {"$tuple": "ab"},
    "map-of-object": {"$map": {"ab": 1}},
    "map-pair-a-string": {"$map": ["ab"]},
    "map-duplicate-key": {"$map": [[1, 2], [1, 3]]},
    "odict-of-list": {"$odict": [["a", 1]]},
    "odict-of-tuple": {"$odict": {"$tuple": [1]}},
    "int-not-a-string": {"$int": 5.5},
    "int-with-spaces": {"$int": " 12"},
    "int-with-underscores": {"$int": "1_000"},
    "float-finite-bits": {"$float": "nan:3ff0000000000000"},
    "np-finite-as-bytes": {"$np": ["<f4", "0000803f"]},
    "np-bytes-wrong-length": {"$np": ["<f4", "0000c07f00"]},
    "np-int-out-of-range": {"$np": ["|i1", 300]},
    "np-float-for-int": {"$np": ["<i8", 1.0]},
    "np-inexact-float16": {"$np": ["<f2", 0.1]},
    "np-unknown-dtype": {"$np": ["<f16", 1.0]},
    "np-bytes-for-int": {"$np": ["<i4", "00000000"]},
    "bytes-not-a-string": {"$bytes": ["AA=="]},
    "tensor-name-a-list": {"$t": ["x"]},
}


@pytest.mark.parametrize("skeleton", MALFORMED_TAGS.values(), ids=MALFORMED_TAGS.keys())
def test_decoder_refuses_forms_the_encoder_never_writes(skeleton):
    with pytest.raises(ts.CorruptGeneration):
        decode(skeleton, "v", {"x": torch.ones(1)})


def test_decoder_takes_what_format_1_writers_wrote_for_numpy_scalars():
    """Format-1 writers tagged a non-finite or huge numpy scalar's value (and no reader could read it)."""
    assert np.isposinf(decode({"$np": ["<f8", {"$float": "inf"}]}, "v", {}))
    assert decode({"$np": ["<u8", {"$int": str(2**63 + 5)}]}, "v", {}) == np.uint64(2**63 + 5)
    assert type(decode({"$np": ["<f4", {"$float": "nan"}]}, "v", {})) is np.float32


def test_decoder_controls():
    """The well-formed neighbours of the refused forms decode (so the refusals above are about the form)."""
    assert through_files((1, 2)) == (1, 2)
    assert decode({"$np": ["<f2", 0.0999755859375]}, "v", {}) == np.float16(0.1)
    assert decode({"$np": ["<f4", "0000c07f"]}, "v", {}).tobytes() == np.float32("nan").tobytes()
    assert decode({"$int": "-12"}, "v", {}) == -12 and decode({"$map": [[1, 2], [2, 3]]}, "v", {}) == {1: 2, 2: 3}


# --- sealed into a real generation --------------------------------------------------------------


def _splice_state(text: str):
    """Replace the facts of G3's state.json by raw JSON text (too hostile for json.dumps)."""
    def edit(run):
        state = json.loads((run / G3 / STATE).read_bytes())
        state["facts"] = "@@RAW@@"
        (run / G3 / STATE).write_text(json.dumps(state).replace('"@@RAW@@"', text))
        reseal(run, G3)
    return edit


def _prefix(name: str, text: str):
    """Insert raw text after the opening brace of a file: a duplicate key read first, then overridden."""
    def edit(run):
        path = run / POINTER if name == POINTER else run / G3 / name
        data = path.read_bytes()
        path.write_bytes(b"{" + text.encode() + b", " + data.lstrip()[1:])
        if name == MANIFEST:
            seal_pointer(run, G3)
        elif name == STATE:
            reseal(run, G3)
    return edit


SEALED = {
    "state-nan-literal": (_splice_state('{"best": NaN}'), G3),
    "state-infinity-literal": (_splice_state('{"best": Infinity}'), G3),
    "state-duplicate-key": (_prefix(STATE, '"kind": "weights"'), G3),
    "state-tuple-of-object": (_splice_state('{"x": {"$tuple": {"a": 1}}}'), G3),
    "state-device-wraps": (_splice_state('{"d": {"$device": "cuda:256"}}'), G3),
    "manifest-duplicate-key": (_prefix(MANIFEST, '"kind": "weights"'), G3),
    "pointer-duplicate-key": (_prefix(POINTER, '"generation": "gen-000000000001"'), POINTER),
}


@pytest.mark.parametrize("edit, rejected", SEALED.values(), ids=SEALED.keys())
def test_sealed_forms_no_writer_produces_are_corrupt(run, capsys, edit, rejected):
    edit(run)
    outcome = restore_outcome(run)
    assert isinstance(outcome, ts.RestoreInfo), outcome
    assert [r.generation for r in outcome.rejected][:1] == [rejected], outcome.rejected
    assert outcome.generation.name == (G2 if rejected == G3 else G3)
    capsys.readouterr()
    assert cli.main(["verify", str(run)]) == 1
    assert rejected in capsys.readouterr().out


def test_sealed_edit_control(run, capsys):
    """Control: the same edits in the writer's own form restore (so the rejections above are the form's)."""
    _splice_state('{"best": {"$float": "nan"}, "x": {"$tuple": [1]}, "d": {"$device": "cuda:0"}}')(run)
    outcome = restore_outcome(run)
    assert isinstance(outcome, ts.RestoreInfo) and outcome.generation.name == G3 and not outcome.rejected
    assert cli.main(["verify", str(run)]) == 0, capsys.readouterr().out


# --- bounded memory -----------------------------------------------------------------------------

NESTED_EMPTIES_BYTES = 57 << 20


def _empties(n: int) -> str:
    return "[" + "{}," * (n - 1) + "{}]"


def _peak(call) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_nested_empties_state_json_is_refused_in_bounded_memory(run):
    """A 57 MiB state.json of empty objects, sealed in: restore falls back, allocating under 4x the file."""
    state = json.loads((run / G3 / STATE).read_bytes())
    state["facts"] = {"x": "@@RAW@@"}
    text = json.dumps(state, separators=(",", ":"))
    data = text.replace('"@@RAW@@"', _empties((NESTED_EMPTIES_BYTES - len(text)) // 3)).encode()
    (run / G3 / STATE).write_bytes(data)
    size = len(data)
    del data, text
    reseal(run, G3)
    outcome = []
    peak = _peak(lambda: outcome.append(restore_outcome(run)))
    info = outcome[0]
    assert isinstance(info, ts.RestoreInfo) and info.generation.name == G2, info
    assert info.rejected[0].generation == G3 and "objects and arrays" in info.rejected[0].reason
    print(f"\n57 MiB of empty objects: restore peak {peak:,} B = {peak / size:.2f} x the file")
    assert peak <= 4 * size


def test_unbounded_parse_of_nested_empties_would_take_far_more(monkeypatch):
    """Control: without the container bound, the same shape costs the parser over 10x its size in memory
    (at 57 MiB, well over the 4x the bounded reader stays within)."""
    data = _empties((4 << 20) // 3).encode()
    plain = _peak(lambda: json.loads(data)) / len(data)
    with pytest.raises(ts.CorruptGeneration, match="objects and arrays"):
        load_json(b'{"x": ' + data + b"}", "f")
    monkeypatch.setattr(strictjson, "container_limit", lambda size: 1 << 62)
    strict = _peak(lambda: strictjson.loads(data, "f")) / len(data)
    print(f"\nparsing empty objects without the bound: json.loads {plain:.1f} x, strict parser {strict:.1f} x")
    assert plain > 10 and strict > 10


def test_real_generations_sit_far_below_the_container_bound(tmp_path, run):
    """Headroom: real state.json files use several times the bytes per container the bound requires."""
    layers = [torch.nn.Linear(8, 8) for _ in range(300)] + [torch.nn.LayerNorm(8) for _ in range(100)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    state = ts.TrainState(model=model, optimizer=optimizer,
                          scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 3),
                          rngs={"numpy": np.random.default_rng(1), "legacy": np.random.RandomState(2)})
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    golden = Path(__file__).parent / "golden" / "v1-run" / "gen-000000000007" / STATE
    ratios = {}
    for path in [tmp_path / "gen-000000000000" / STATE, run / G3 / STATE, golden]:
        data = path.read_bytes()
        ratios[path.parent.parent.name] = len(data) / strictjson.containers(data)
        assert load_json(data, str(path))
    print(f"\nbytes per container: {ratios}; the bound needs {strictjson.BYTES_PER_CONTAINER}")
    assert min(ratios.values()) >= 2 * strictjson.BYTES_PER_CONTAINER
