"""Nothing published that cannot be restored (issue 11, item 1).

The contract: every value ``encode`` accepts comes back from the bytes the
writer produces, through the reader's strict parser and tensor reader, as an
equal value of the same type (floats, arrays and tensors bit for bit); or the
save refuses it with :class:`~trainstate.UnsupportedValue` naming its key
path. Never a decode error, never a generation that ``trainstate verify``
passes and restore rejects.

The property draws from the encoder's whole domain: nested dicts,
OrderedDicts, lists and tuples; str, ints of any size, floats of any bit
pattern (NaN payloads, infinities, -0.0, subnormals), bool, None, bytes;
every numpy scalar type, arrays of every dtype (0-d, empty, non-contiguous,
read-only); torch tensors of every dtype (0-d, empty, non-contiguous,
conjugate and negative views); ``torch.dtype``, ``torch.device``; dict keys of
every supported type. Values the encoder must refuse are mixed in too
(complex and long-double scalars, byte-swapped and string arrays, nested and
sparse tensors, bytes keys), and a refusal is accepted only for them.

Scale with ``TRAINSTATE_FUZZ_EXAMPLES=N`` (as ``test_fuzz``): ``EXAMPLES_PER_N * N``
examples, derandomized (default N=40: 1,200 examples, about 10 s on two busy cores).
"""

from __future__ import annotations

import collections
import io
import json
import os
import random
import struct
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainstate as ts
from test_format import Holder, same
from test_hostile import HOSTILE_STATES, G3, STATE, pristine, reseal, restore_outcome, run  # noqa: F401
from trainstate import cli
from trainstate.format import strictjson, tensorfile
from trainstate.format.codec import TensorTable, decode, encode
from trainstate.format.manifest import load_json
from trainstate.state.snapshot import state_json

pytestmark = [pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
              pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")]

EXAMPLES_PER_N = 30
EXAMPLES = EXAMPLES_PER_N * int(os.environ.get("TRAINSTATE_FUZZ_EXAMPLES", "40"))
OUTCOMES: collections.Counter = collections.Counter()


# --- the writer's bytes and the reader's path, in memory ---------------------------------------


def through_files(value: object) -> object:
    """Encode ``value`` as a save does, serialise it as the writer does, and decode it as restore does."""
    table = TensorTable()
    skeleton = encode(value, "v", table)
    text = state_json({"v": skeleton})
    layout = tensorfile.plan(table.tensors)
    data = b"".join(bytes(chunk) for chunk in tensorfile.chunks(layout, table.tensors))
    header = tensorfile.parse_header(io.BytesIO(data), len(data), "tensors")
    stream = io.BytesIO(data)
    tensors = {e.name: tensorfile.read_tensor(stream, header, e, "tensors") for e in header.entries}
    return decode(load_json(text, "state.json")["v"], "v", tensors)


# --- the domain --------------------------------------------------------------------------------


def _double(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


NAN = float("nan")
floats = st.one_of(
    st.floats(),
    st.sampled_from([NAN, -NAN, float("inf"), float("-inf"), -0.0, 5e-324, -2.2250738585072014e-308,
                     1.7976931348623157e308, _double(0x7FF0000000000001), _double(0xFFF4000000000000)]),
    st.integers(0, 2**64 - 1).map(_double))
ints = st.one_of(st.integers(), st.integers(-2**200, 2**200),
                 st.sampled_from([2**53, 2**53 + 1, -2**53 - 1, 2**63, -2**63, 2**64, -2**64 - 1]))

SCALAR_TYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                np.float16, np.float32, np.float64)
ARRAY_DTYPES = tuple(np.dtype(t) for t in SCALAR_TYPES) + (np.dtype(np.complex64), np.dtype(np.complex128))


def _scalar(kind: type) -> st.SearchStrategy:
    if kind is np.bool_:
        return st.booleans().map(np.bool_)
    dtype = np.dtype(kind)
    if dtype.kind == "f":  # any bit pattern: NaN payloads, signalling NaNs, subnormals, infinities
        return st.integers(0, 2 ** (8 * dtype.itemsize) - 1).map(
            lambda b, d=dtype: np.frombuffer(b.to_bytes(d.itemsize, "little"), d)[0])
    info = np.iinfo(dtype)
    return st.integers(int(info.min), int(info.max)).map(kind)


np_scalars = st.one_of(*[_scalar(k) for k in SCALAR_TYPES],
                       st.integers(0, 2**31).map(lambda s: np.random.default_rng(s).integers(0, 2**63)))


def _bytes_array(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    if dtype.kind == "b":
        return np.random.default_rng(seed).integers(0, 2, shape).astype(bool)
    data = random.Random(seed).randbytes(int(np.prod(shape)) * dtype.itemsize)
    return np.frombuffer(data, dtype).reshape(shape).copy()


shapes = st.one_of(st.just(()), st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple))


@st.composite
def np_arrays(draw, dtypes=st.sampled_from(ARRAY_DTYPES)) -> np.ndarray:
    array = _bytes_array(draw(dtypes), draw(shapes), draw(st.integers(0, 2**32)))
    view = draw(st.sampled_from(["plain", "transposed", "strided", "reversed", "read-only"]))
    if view == "transposed":
        array = array.T
    elif view == "strided" and array.ndim:
        array = array[::2]
    elif view == "reversed" and array.ndim:
        array = array[::-1]
    elif view == "read-only":
        array.flags.writeable = False
    return array


def _printable(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():  # complex32 is "experimental", quantized dtypes "deprecated"
            warnings.simplefilter("ignore")
            repr(torch.zeros(1, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(1, dtype=dtype))
    except (NotImplementedError, RuntimeError):
        return False
    return True


ALL_TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype) and v.itemsize}, key=str)
# Hypothesis prints a failing example with repr(), which torch has not implemented for sub-byte, bits and
# quantized dtypes: those are covered by test_unprintable_dtypes_round_trip instead.
TORCH_DTYPES = [d for d in ALL_TORCH_DTYPES if _printable(d)]


def _bits_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Any bit pattern, through uint8: NaN payloads in float8, every quantized and sub-byte dtype."""
    raw = random.Random(seed).randbytes(int(np.prod(shape)) * dtype.itemsize)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.reshape(*shape, dtype.itemsize).view(dtype).reshape(shape)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype, shape = draw(st.sampled_from(TORCH_DTYPES)), draw(shapes)
    seed = draw(st.integers(0, 2**32))
    if dtype == torch.bool:
        tensor = torch.from_numpy(_bytes_array(np.dtype(bool), shape, seed))
    else:
        tensor = _bits_tensor(dtype, shape, seed)
    view = draw(st.sampled_from(["plain", "transposed", "strided", "expanded", "conj", "neg"]))
    if view == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    elif view == "strided" and tensor.dim():
        tensor = tensor[::2]
    elif view == "expanded" and tensor.dim() == 0:
        tensor = tensor.expand(3)
    elif view == "conj" and dtype.is_complex and dtype != torch.complex32:
        tensor = tensor.conj()
    elif view == "neg" and dtype.is_complex and dtype != torch.complex32:
        tensor = tensor.conj().imag  # a view with the negative bit set
    return tensor


devices = st.sampled_from(["cpu", "cpu:0", "cuda", "cuda:0", "cuda:7", "cuda:127", "meta", "mps", "xpu:1"]).map(
    torch.device)


class Refused:
    """Values the encoder must refuse (a refusal is accepted only when one of these is inside)."""

    SCALARS = (np.longdouble(1.5), np.clongdouble(1j), np.complex64(1 + 2j), np.complex128(-1j), np.longlong(3),
               np.ulonglong(4), np.datetime64("2020-01-01"), np.str_("s"), np.bytes_(b"b"))

    @staticmethod
    def values() -> st.SearchStrategy:
        return st.one_of(
            st.sampled_from(Refused.SCALARS),
            np_arrays(st.sampled_from([np.dtype(np.longdouble), np.dtype(">f4"), np.dtype(">i8"), np.dtype("U3"),
                                       np.dtype("M8[s]")])),
            st.sampled_from([0, 1]).map(lambda i: [torch.eye(2).to_sparse(),
                                                   torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])][i]),
            st.builds(set), st.builds(object))

    @staticmethod
    def inside(value: object) -> bool:
        if isinstance(value, (list, tuple)):
            return any(Refused.inside(v) for v in value)
        if isinstance(value, dict):
            return any(type(k) is bytes or Refused.inside(k) or Refused.inside(v) for k, v in value.items())
        if isinstance(value, np.ndarray):
            return value.dtype not in ARRAY_DTYPES or not value.dtype.isnative
        if isinstance(value, np.generic):
            return type(value) not in SCALAR_TYPES
        if isinstance(value, torch.Tensor):
            return value.is_nested or value.layout != torch.strided
        return type(value) in (set, object)


def _tuple_keys(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(children, max_size=3).map(tuple)


key_leaves = st.one_of(st.text(max_size=6), st.sampled_from(["$t", "$map", "$odict", "", "a.b"]), ints,
                       st.booleans(), st.none(), floats)
keys = st.recursive(key_leaves, _tuple_keys, max_leaves=4)
leaves = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=8), st.binary(max_size=8), np_scalars,
                   np_arrays(), tensors(), st.sampled_from(TORCH_DTYPES + [torch.quint8]), devices)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    pairs = st.lists(st.tuples(keys, children), max_size=4)
    return st.one_of(st.lists(children, max_size=4), st.lists(children, max_size=3).map(tuple),
                     st.dictionaries(st.text(max_size=5), children, max_size=4),
                     pairs.map(dict), pairs.map(OrderedDict))


domain = st.recursive(leaves, _containers, max_leaves=12)
with_refused = st.recursive(st.one_of(leaves, Refused.values()), lambda c: _containers(c)
                            | st.lists(st.tuples(st.binary(max_size=2), c), min_size=1, max_size=2).map(dict),
                            max_leaves=8)


def test_every_accepted_value_round_trips_exactly():
    """encode -> the writer's JSON and safetensors bytes -> strict parse -> decode: equal value, same type."""

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.one_of(domain, domain, domain, with_refused))
    def prop(value):
        try:
            back = through_files(value)
        except ts.UnsupportedValue:
            assert Refused.inside(value), "refused a value the codec supports"
            OUTCOMES["refused"] += 1
            return
        assert not Refused.inside(value), "accepted a value the codec cannot store"
        assert same(back, value)
        OUTCOMES["round-tripped"] += 1

    prop()
    print(f"\ncodec round trip: {dict(OUTCOMES)} (TRAINSTATE_FUZZ_EXAMPLES scales it)")
    assert OUTCOMES["round-tripped"] > EXAMPLES // 2 and OUTCOMES["refused"]


@pytest.mark.parametrize("dtype", [d for d in ALL_TORCH_DTYPES if not _printable(d)], ids=str)
def test_unprintable_dtypes_round_trip(dtype):
    base = _bits_tensor(dtype, (3, 4), 7)
    value = {"t": base, "view": base.t()[1:], "zero_d": _bits_tensor(dtype, (), 8), "empty": base[:0].t()}
    back = through_files(value)
    assert same(back, value), dtype  # same() compares bits, not repr


def test_round_trip_oracle_sees_type_and_bit_changes():
    """Negative control: ``same`` after ``through_files`` would catch the bugs this file guards against."""
    assert not same(np.array(3.5).reshape(1), np.array(3.5))  # 0-d came back 1-d
    assert not same({"a": 1}, OrderedDict(a=1))  # an OrderedDict came back a dict
    assert not same(float("nan"), -float("nan"))
    assert not same(np.float32("nan"), np.frombuffer(b"\x01\x00\xc0\x7f", np.float32)[0])
    x = torch.tensor([1 + 2j])
    assert not same(x.conj().resolve_conj(), x)


# --- the values issue 11 found, end to end -----------------------------------------------------


MODULE_STATE = torch.nn.Linear(2, 2).state_dict()


def _found_values() -> dict:
    return {
        "np_inf": np.float64("inf"), "np_nan": np.float32("nan"), "np_neg_nan": -np.float32("nan"),
        "np_u64": np.uint64(2**63 + 5), "np_i64": np.int64(-2**60),
        "seed": np.random.default_rng(0).integers(0, 2**63), "zero_d": np.array(3.5),
        "zero_d_int": np.array(2**62, dtype=np.int64), "odict": OrderedDict(b=1, a=(2, 3)),
        "module_state": MODULE_STATE,
    }


def test_values_that_saved_but_never_restored(tmp_path, capsys):
    """Each value saved, ``verify`` passed, and every restore rejected the generation; now all come back."""
    facts = {"best": float("inf"), "worst": float("-inf"), "nan": float("nan"), "pair": (1, 2), 3: "int key",
             "od": OrderedDict(x=1), "np": np.float32(0.5), "big": 2**80}
    state = ts.TrainState(holder=Holder(_found_values()))
    state.facts.update(facts)
    state.counters["seen"] = 2**62
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    assert cli.main(["verify", str(tmp_path)]) == 0, capsys.readouterr().out
    fresh = ts.TrainState(holder=Holder(None))
    with ts.CheckpointManager(tmp_path) as ckpt:
        info = ckpt.restore(fresh)
    assert not info.rejected
    assert same(fresh["holder"].value, _found_values())
    assert same(fresh.facts, facts) and same(fresh.counters, {"seen": 2**62})


def test_module_state_comes_back_an_ordered_dict(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    back = through_files(model.state_dict())
    assert type(back) is OrderedDict and same(back, model.state_dict())
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(ts.TrainState(model=model))
        fresh = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
        ckpt.restore(ts.TrainState(model=fresh))
    assert same(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_conjugate_and_negative_views_store_the_values_they_read_as(tmp_path, blocking):
    """A conj/neg view's memory holds the unconjugated values: both save paths store what the view reads as,
    and a view and its base are two tensors, not one stored twice."""
    base = torch.randn(4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    value = {"base": base, "conj": base.conj(), "neg": base.conj().imag, "real": base.real}
    if hasattr(torch, "_neg_view"):
        value["neg_contiguous"] = torch._neg_view(base.real.contiguous())
    state = ts.TrainState(holder=Holder(value))
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state, blocking=blocking)
        ckpt.wait()
        fresh = ts.TrainState(holder=Holder(None))
        ckpt.restore(fresh)
    back = fresh["holder"].value
    for key, original in value.items():
        assert not back[key].is_conj() and not back[key].is_neg()
        assert same(back[key], original.resolve_conj().resolve_neg()), key
    assert not same(back["conj"], back["base"])  # negative control: conjugation changed the stored values


def test_nested_tensor_refused_with_key_path(tmp_path):
    """(A jagged nested tensor is a tensor subclass, refused as one; importing its machinery takes seconds.)"""
    packed = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    state = ts.TrainState(holder=Holder({"buffers": [1, {"packed": packed}]}))
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.UnsupportedValue) as err:
            ckpt.save(state)
    assert err.value.path == "holder.buffers[1].packed"
    assert not any(p.name.startswith("gen-") for p in tmp_path.iterdir())


def test_counter_keys_must_be_names(tmp_path):
    state = ts.TrainState(holder=Holder(1))
    state.counters[5] = 1
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.UnsupportedValue) as err:
            ckpt.save(state)
        assert err.value.path == "counters[5]"
        state.counters = {"5": 1}  # control: the same counter, named
        ckpt.save(state)


def test_plain_json_sections_are_read_as_written(tmp_path, capsys):
    """Counters, the contract and history are written as plain JSON: a value shaped like a tag stays a value
    (they were decoded, so a contract value {"$t": ...} made every restore fail)."""
    contract = {"config": {"$t": "not.a.tensor"}, "note": {"$float": "nan"}, "$map": [[1, 2]]}
    state = ts.TrainState(holder=Holder(1), contract=contract)
    state.counters.update({"$int": 5, "$t": 6})
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(state)
    assert cli.main(["verify", str(tmp_path)]) == 0, capsys.readouterr().out
    fresh = ts.TrainState(holder=Holder(None), contract=contract)
    with ts.CheckpointManager(tmp_path) as ckpt:
        assert not ckpt.restore(fresh).rejected
    assert fresh.counters == {"$int": 5, "$t": 6}


def test_state_restore_would_refuse_is_refused_at_save(tmp_path, monkeypatch):
    """A state.json over the reader's limits (size, or containers per byte) is refused at save, naming the
    part that holds the bulk, instead of being published unreadable. (The floor is lowered from a million
    containers to keep the test fast: writer and reader share it.)"""
    monkeypatch.setattr(strictjson, "MIN_CONTAINERS", 4096)
    state = ts.TrainState(holder=Holder(1))
    state.facts["steps"] = [[] for _ in range(5000)]  # 3 bytes per container
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.UnsupportedValue) as err:
            ckpt.save(state)
        assert err.value.path == "facts"
        state.facts["steps"] = [[] for _ in range(3000)]  # control: within the floor, it saves and restores
        ckpt.save(state)
        fresh = ts.TrainState(holder=Holder(None))
        ckpt.restore(fresh)
    assert fresh.facts == state.facts


def test_oversized_state_refused_at_save(tmp_path):
    state = ts.TrainState(holder=Holder({"blob": "x" * (65 << 20)}))
    with ts.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(ts.UnsupportedValue) as err:
            ckpt.save(state)
    assert err.value.path == "holder"
    assert not any(p.name.startswith("gen-") for p in tmp_path.iterdir())


# --- verify decodes as restore does -------------------------------------------------------------


@pytest.mark.parametrize("mutate", HOSTILE_STATES.values(), ids=HOSTILE_STATES.keys())
def test_verify_fails_exactly_where_restore_rejects(run, capsys, mutate):
    """Digest-consistent hostile state.json files: ``trainstate verify`` fails on G3 iff restore rejects it."""
    state_json_ = json.loads((run / G3 / STATE).read_bytes())
    raw = mutate(state_json_)
    text = json.dumps(state_json_)
    (run / G3 / STATE).write_bytes((text.replace('"@@RAW@@"', raw) if raw else text).encode())
    reseal(run, G3)
    capsys.readouterr()
    rc = cli.main(["verify", str(run / G3)])
    out = capsys.readouterr().out
    outcome = restore_outcome(run)
    rejected = not (isinstance(outcome, ts.RestoreInfo) and outcome.generation.name == G3)
    assert rejected, "every hostile state here is one restore rejects"
    assert rc == 1 and G3 in out, out


def test_verify_passes_what_restore_accepts(run, capsys):
    """Control for the test above: the untouched generation verifies and restores."""
    assert cli.main(["verify", str(run)]) == 0, capsys.readouterr().out
    outcome = restore_outcome(run)
    assert isinstance(outcome, ts.RestoreInfo) and outcome.generation.name == G3 and not outcome.rejected


@pytest.mark.parametrize("dtype", [torch.uint4, torch.int1, torch.bits8, torch.float8_e4m3fn],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_a_background_save_of_a_dtype_without_a_copy_kernel_matches_a_blocking_one(tmp_path, dtype):
    """Before: the background save's staging copy raised NotImplementedError ("copy_kernel" not implemented)."""
    import trainstate as ts

    class Holder:
        def __init__(self, t):
            self.t = t

        def state_dict(self):
            return {"t": self.t}

        def load_state_dict(self, saved):
            self.t = saved["t"]

    source = torch.randint(0, 200, (6, 4), dtype=torch.uint8).view(dtype)[:, ::2]  # non-contiguous too
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(ts.TrainState(h=Holder(source)), blocking=False).wait()
    restored = Holder(None)
    with ts.CheckpointManager(tmp_path) as ckpt:
        ckpt.restore(ts.TrainState(h=restored))
    assert restored.t.dtype == dtype and torch.equal(restored.t.view(torch.uint8), source.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
def test_a_one_element_strided_slice_saves(dtype):
    """Found by the property test: a one-element slice of a strided view reports itself contiguous with a
    stride of 2, and viewing it as bytes failed for 2- to 8-byte dtypes."""
    value = torch.arange(6).to(dtype)[::2][1:2]
    assert value.stride() == (2,) and value.is_contiguous()
    assert same(through_files(value), value)
