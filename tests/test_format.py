"""The on-disk format: exact round-trips, shared tensors, refusals with key paths, golden bytes."""

from __future__ import annotations

import io
import json
import math
import random
import shutil
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainstate as ts
from trainstate import cli
from trainstate.format import tensorfile
from trainstate.format.codec import TensorTable, decode, encode
from trainstate.format.digest import CHUNK_BYTES, chunk_digest, chunked_top
from trainstate.format.manifest import FileRecord, Manifest, Pointer, parse_manifest, parse_pointer

GOLDEN = Path(__file__).parent / "golden"

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
          torch.complex128]


class Holder:
    """A user component holding arbitrary state."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


def _sample(dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, (3, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    if dtype == torch.bool:
        return raw[..., 0] % 2 == 1
    return raw.view(dtype) if dtype.itemsize <= 16 else raw


def _roundtrip(tmp_path: Path, value, name="holder"):
    state = ts.TrainState(**{name: Holder(value)})
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
        back = ts.TrainState(**{name: Holder(None)})
        ckpt.restore(back)
    return back[name].value


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bitwise(tmp_path, dtype):
    tensor = _sample(dtype)
    back = _roundtrip(tmp_path, {"t": tensor, "scalar": tensor.reshape(-1)[0].clone(), "empty": tensor[:0]})
    for key, original in {"t": tensor, "scalar": tensor.reshape(-1)[0], "empty": tensor[:0]}.items():
        got = back[key]
        assert got.dtype == original.dtype and got.shape == original.shape
        # compare bytes: NaN patterns in float8/float16 must survive too
        assert torch.equal(got.reshape(-1).view(torch.uint8), original.reshape(-1).contiguous().view(torch.uint8))


def test_safetensors_library_reads_our_files(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor(True),
               "c": torch.ones(4, dtype=torch.bfloat16)}
    _roundtrip(tmp_path, tensors)
    loaded = safetensors.torch.load_file(tmp_path / "gen-000000000000" / "tensors.safetensors")
    for key, value in tensors.items():
        assert torch.equal(loaded[f"holder.{key}"], value)


def test_tied_weights_are_stored_once_and_retied(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    state = ts.TrainState(model=model)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    header = tensorfile.parse_header(open(tmp_path / "gen-000000000000" / "tensors.safetensors", "rb"),
                                     (tmp_path / "gen-000000000000" / "tensors.safetensors").stat().st_size, "t")
    assert [e.name for e in header.entries if e.name.startswith("model.")] == ["model.embed.weight"]
    # decoded state dicts hand both keys the same tensor object again
    shared = torch.ones(3)
    back = _roundtrip(tmp_path / "b", {"x": shared, "y": shared, "z": shared.clone()})
    assert back["x"] is back["y"] and back["z"] is not back["x"]
    fresh = Tied()
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(ts.TrainState(model=fresh))
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_views_and_noncontiguous_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value = {"t": base.t(), "slice": base[1:3, ::2], "expand": torch.ones(1).expand(5)}
    back = _roundtrip(tmp_path, value)
    for key in value:
        assert torch.equal(back[key], value[key])


def test_structure_types_survive(tmp_path):
    value = {
        "state": {0: {"step": torch.tensor(3.0)}, 7: {}},
        "betas": (0.9, 0.999),
        "nested": [None, True, 1, -2**70, 2**127 + 1, 0.1, -0.0, float("inf"), float("-inf"), "s", b"\x00\xff"],
        "$dollar": {"(1, 2)": 1, (1, "a"): 2},
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "np_scalar": np.float32(1.5),
        "np_int": np.int64(-3),
        "np_bool": np.bool_(True),
        "np_array": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "od": OrderedDict(b=1, a=2),
    }
    back = _roundtrip(tmp_path, value)
    assert back["state"][0]["step"].item() == 3.0 and list(back["state"]) == [0, 7]
    assert back["betas"] == (0.9, 0.999) and type(back["betas"]) is tuple
    assert back["nested"][:5] == [None, True, 1, -2**70, 2**127 + 1]
    assert math.copysign(1, back["nested"][6]) == -1 and back["nested"][7:] == [math.inf, -math.inf, "s", b"\x00\xff"]
    assert back["$dollar"] == {"(1, 2)": 1, (1, "a"): 2}
    assert back["dtype"] is torch.bfloat16 and back["device"] == torch.device("cpu")
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == 1.5
    assert type(back["np_int"]) is np.int64 and type(back["np_bool"]) is np.bool_
    assert back["np_array"].dtype == np.uint32 and (back["np_array"] == value["np_array"]).all()
    assert list(back["od"]) == ["b", "a"]
    nan = _roundtrip(tmp_path / "nan", {"x": float("nan")})["x"]
    assert math.isnan(nan)


def test_pcg64_state_round_trips_exactly(tmp_path):
    for bitgen in (np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64, np.random.MT19937):
        gen = np.random.Generator(bitgen(2**100 + 17))
        gen.random(5)
        state = ts.TrainState(rngs={"g": gen}, capture_global_rngs=False)
        directory = tmp_path / bitgen.__name__
        with ts.CheckpointManager(directory) as ckpt:
            ckpt.save(state)
        expected = gen.random(4)
        other = np.random.Generator(bitgen(1))
        with ts.CheckpointManager(directory) as ckpt:
            ckpt.restore(ts.TrainState(rngs={"g": other}, capture_global_rngs=False))
        assert (other.random(4) == expected).all(), bitgen.__name__


class WithLambda:
    def state_dict(self):
        return {"base_lrs": [0.1], "lr_lambdas": [lambda epoch: 0.9 ** epoch]}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("value, path", [
    ({"lr_lambdas": [lambda e: e]}, "scheduler.lr_lambdas[0]"),
    ({"obj": object()}, "scheduler.obj"),
    ({"nested": {3: [1, {"x": {1, 2}}]}}, "scheduler.nested[3][1].x"),
    ({"sparse": torch.eye(3).to_sparse()}, "scheduler.sparse"),
])
def test_unsupported_value_fails_at_save_with_key_path(tmp_path, value, path):
    state = ts.TrainState(scheduler=Holder(value))
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.UnsupportedValue) as err:
            ckpt.save(state)
    assert err.value.path == path and path in str(err.value)
    assert isinstance(err.value, TypeError)
    assert not any(p.name.startswith("gen-") for p in tmp_path.iterdir())


def test_contract_value_rejected_at_construction():
    with pytest.raises(ts.UnsupportedValue, match=r"contract\.config\.fn"):
        ts.TrainState(contract={"config": {"fn": print}})


# --- codec properties --------------------------------------------------------------------------
json_leaves = st.none() | st.booleans() | st.integers(min_value=-2**130, max_value=2**130) | st.floats() | st.text()
values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), children, max_size=4),
    max_leaves=25)


def _bits(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if not tensor.numel():
        return b""
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size())
    tensor = tensor.view(carrier) if carrier else tensor  # no copy kernel for sub-byte dtypes; bits kept
    return tensor.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy().tobytes()


def same(a, b) -> bool:
    """Equal value and equal type, recursively and exactly: floats, arrays and tensors bit for bit
    (so NaN payloads, signs of zero and NaN patterns in float8 all count)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))  # keys in order, bit for bit
                and all(same(x, y) for x, y in zip(a.values(), b.values())))
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return a == b


def test_same_is_exact():
    """Negative controls for ``same``: every difference it must see."""
    nan, other_nan = float("nan"), struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    assert same(nan, nan) and same({1: (np.float32(2),)}, {1: (np.float32(2),)})
    for a, b in [(1, True), (1, 1.0), (0.0, -0.0), (nan, other_nan), ((1,), [1]), ({"a": 1}, OrderedDict(a=1)),
                 ({"a": 1, "b": 2}, {"b": 2, "a": 1}), (np.float32(1), np.float64(1)), (np.int64(1), 1),
                 (np.zeros(()), np.zeros(1)), (np.zeros(2, np.int32), np.zeros(2, np.int64)),
                 (torch.zeros(()), torch.zeros(1)), (torch.zeros(2), torch.zeros(2, dtype=torch.float64)),
                 (torch.zeros(2), -torch.zeros(2)), (torch.tensor([nan]), torch.tensor([-nan]))]:
        assert not same(a, b) and not same(b, a), (a, b)


@settings(max_examples=300, deadline=None)
@given(values)
def test_codec_round_trips_through_json(value):
    table = TensorTable()
    skeleton = encode(value, "v", table)
    text = json.dumps(skeleton, allow_nan=False)
    assert same(decode(json.loads(text), "v", table.tensors), value)


# --- a format-1 generation --------------------------------------------------------------------
V1_RUN = GOLDEN / "v1-run"  # written by trainstate at commit aa50f86 (format 1) from _v1_state(); never regenerate


def _v1_state() -> ts.TrainState:
    """The state saved in ``tests/golden/v1-run`` (deterministic: explicit weights, one Adam step, seeded RNGs)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.copy_(torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape) / (i + 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    extra = Holder({
        "tuple": (1, 2.5, "x"), "int_keys": {0: {"step": torch.tensor(2.0)}, -3: None}, "big": 2**70,
        "neg_big": -2**64, "nan": float("nan"), "neg_inf": float("-inf"), "neg_zero": -0.0, "bytes": b"\x00\xff",
        "dtype": torch.bfloat16, "device": torch.device("cpu"), "np_float": np.float32(1.5), "np_int": np.int16(-7),
        "np_bool": np.bool_(False), "array": np.arange(6, dtype=np.int32).reshape(2, 3),
        "nested": [[1, [2, {"k": None}]]], "$key": 1, (1, "a"): 2, "bf16": torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
    })
    state = ts.TrainState(model=model, optimizer=optimizer, extra=extra, capture_global_rngs=False,
                          rngs={"torch": torch.Generator().manual_seed(5), "numpy": np.random.default_rng(6),
                                "python": random.Random(7)},
                          contract={"config": {"lr": 0.01, "betas": [0.8, 0.9]}})
    state.next_update, state.tokens_seen = 7, 1234
    state.counters["epoch"] = 3
    state.facts.update(best=0.25, tag="v1")
    return state


def _draws(state: ts.TrainState) -> list:
    rngs = state.rngs
    return [rngs["torch"].initial_seed(), torch.rand(3, generator=rngs["torch"]), rngs["numpy"].random(3),
            rngs["python"].random()]


def test_format_1_generation_still_restores(tmp_path, capsys):
    """A generation written by a format-1 writer (before $odict and the $np fixes) verifies and restores exactly."""
    run = tmp_path / "run"
    shutil.copytree(V1_RUN, run)
    assert json.loads((run / "gen-000000000007" / "manifest.json").read_bytes())["format_version"] == 1
    assert json.loads((run / "latest").read_bytes())["format_version"] == 1
    assert cli.main(["verify", str(run)]) == 0, capsys.readouterr().out
    expected, live = _v1_state(), _v1_state()
    with torch.no_grad():
        for param in live["model"].parameters():
            param.add_(1)
    live["extra"].value, live.counters, live.facts, live.next_update = None, {}, {}, 0
    _draws(live)
    with ts.CheckpointManager(run) as ckpt:
        info = ckpt.restore(live)
    assert info.generation.name == "gen-000000000007" and not info.rejected
    assert same(live["model"].state_dict(), expected["model"].state_dict())
    assert same(live["optimizer"].state_dict(), expected["optimizer"].state_dict())
    assert same(live["extra"].value, expected["extra"].value)
    assert (live.next_update, live.tokens_seen, live.counters, live.facts) == (7, 1234, {"epoch": 3},
                                                                               {"best": 0.25, "tag": "v1"})
    assert same(_draws(live), _draws(expected))
    # the run continues in format 4 (incremental generations, the default) beside its format-1 one; both verify
    live.next_update += 1
    with ts.CheckpointManager(run) as ckpt:
        ckpt.save(live)
        again = _v1_state()
        assert ckpt.restore(again).generation.name == "gen-000000000008"
    assert json.loads((run / "gen-000000000008" / "manifest.json").read_bytes())["format_version"] == 4
    assert same(again["extra"].value, live["extra"].value) and same(_draws(again), _draws(live))
    assert cli.main(["verify", str(run)]) == 0, capsys.readouterr().out


# --- golden bytes ------------------------------------------------------------------------------
def _golden_payload():
    table = TensorTable()
    shared = torch.arange(4, dtype=torch.float32)
    value = {"w": shared, "tied": shared, "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
             "e8m0": torch.tensor([1.0, 4.0]).to(torch.float8_e8m0fnu), "step": torch.tensor(3, dtype=torch.int64),
             "betas": (0.9, 0.999), "state": {0: {"big": 2**64}}, "nan": float("nan"),
             "odict": OrderedDict(b=1, a={-0.0: -float("nan")}), "np_inf": np.float32("-inf"),
             "np_seed": np.uint64(2**63 + 5), "np_zero_d": np.array(2.5), "device": torch.device("cuda:1")}
    skeleton = encode(value, "c", table)
    layout = tensorfile.plan(table.tensors)
    tensor_bytes = b"".join(bytes(c) for c in tensorfile.chunks(layout, table.tensors))
    return value, json.dumps(skeleton, separators=(",", ":"), allow_nan=False).encode(), tensor_bytes


def _golden_files() -> dict[str, bytes]:
    _, skeleton, tensor_bytes = _golden_payload()
    manifest = Manifest("gen-000000000042", "full", 42, "blake3",
                        (FileRecord("state.json", 10, "ab" * 32), FileRecord("tensors.safetensors", 20, "cd" * 32)),
                        "2026-01-01T00:00:00.000000+00:00", "ef" * 32, {"torch": "x"}, None, format_version=2)
    pointer = Pointer("gen-000000000042", "12" * 32, 300, "blake3", 42, format_version=2)
    chunked = {}
    for algorithm in ("blake3-chunked", "xxh3-chunked"):
        chunks = tuple(chunk_digest(bytes([i]) * 16, algorithm) for i in range(2))
        chunked[algorithm] = Manifest(
            "gen-000000000042", "full", 42, algorithm,
            (FileRecord("state.json", 10, chunked_top(10, chunks[:1], algorithm), chunks[:1]),
             FileRecord("tensors.safetensors", CHUNK_BYTES + 1, chunked_top(CHUNK_BYTES + 1, chunks, algorithm), chunks)),
            "2026-01-01T00:00:00.000000+00:00", "ef" * 32, {"torch": "x"}, None).to_bytes()
    return {"skeleton.json": skeleton, "tensors.safetensors": tensor_bytes,
            "manifest.json": manifest.to_bytes(), "latest": pointer.to_bytes(),
            "manifest-v3.json": chunked["blake3-chunked"], "manifest-v3-xxh3.json": chunked["xxh3-chunked"]}


def test_golden_bytes_pin_format_version_2():
    for name, data in _golden_files().items():
        assert (GOLDEN / name).read_bytes() == data, f"format drift in {name}: bump FORMAT_VERSION and the goldens"
    manifest = parse_manifest((GOLDEN / "manifest.json").read_bytes(), "g")
    assert manifest.format_version == 2 and manifest.to_bytes() == (GOLDEN / "manifest.json").read_bytes()
    assert parse_pointer((GOLDEN / "latest").read_bytes(), "g").format_version == 2
    v3 = parse_manifest((GOLDEN / "manifest-v3.json").read_bytes(), "g")  # format 3: chunk digests per file
    assert v3.format_version == 3 and v3.digest_algorithm == "blake3-chunked"
    fast = parse_manifest((GOLDEN / "manifest-v3-xxh3.json").read_bytes(), "g")  # XXH3-128 per chunk
    assert fast.digest_algorithm == "xxh3-chunked" and all(len(c) == 32 for f in fast.files for c in f.chunks)
    assert len(v3.file("tensors.safetensors").chunks) == 2 and v3.to_bytes() == (GOLDEN / "manifest-v3.json").read_bytes()
    tensor_bytes = (GOLDEN / "tensors.safetensors").read_bytes()
    header = tensorfile.parse_header(io.BytesIO(tensor_bytes), len(tensor_bytes), "g")
    assert [e.name for e in header.entries] == ["c.w", "c.half", "c.e8m0", "c.step", "c.np_zero_d"]
    assert header.entries[2].dtype == torch.float8_e8m0fnu
    # the golden bytes decode to the values they were made from
    stream = io.BytesIO(tensor_bytes)
    tensors = {e.name: tensorfile.read_tensor(stream, header, e, "g") for e in header.entries}
    back = decode(json.loads((GOLDEN / "skeleton.json").read_bytes()), "c", tensors)
    value = _golden_payload()[0]
    assert back["w"] is back["tied"]
    del back["tied"], value["tied"]
    assert same(back, value)


if __name__ == "__main__":  # regenerate goldens deliberately, after bumping FORMAT_VERSION (never v1-run/)
    GOLDEN.mkdir(exist_ok=True)
    for name, data in _golden_files().items():
        (GOLDEN / name).write_bytes(data)
