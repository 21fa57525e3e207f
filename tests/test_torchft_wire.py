"""The heal stream (``trainstate.integrations.torchft.wire``): a rank's restart state, verified before it is decoded.

No torchft and no sockets here: the stream a live peer sends, read back from memory. A round trip is bitwise; a
flipped bit anywhere, a stream cut at any point, bytes after the seal, a missing or wrong signature and another
step are refused before anything is decoded; the reader calls neither ``pickle`` nor ``torch.load``.
"""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch

import trainstate as ts
from trainstate.errors import CorruptGeneration, InvalidArgument
from trainstate.format.signing import SigningKey
from trainstate.integrations.torchft import wire
from trainstate.state import snapshot


def _state() -> ts.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16384), torch.nn.ReLU(), torch.nn.Linear(16384, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = ts.TrainState(model=model, optimizer=opt, rngs={"data": torch.Generator().manual_seed(3)},
                          contract={"config": {"width": 16384}})
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state.next_update = 1
    return state


def _stream(key: SigningKey | None = None, step: int = 7) -> bytes:
    skeleton, tensors = snapshot.capture(_state())
    out = bytearray()
    for piece in wire.frame(skeleton, tensors, step=step, torchft={"step": step, "batches_committed": 14},
                            key=key).pieces():
        out += piece
    return bytes(out)


def _receive(data: bytes, key: SigningKey | None = None, step: int = 7) -> wire.Incoming:
    return wire.receive(io.BytesIO(data), step=step, key=key, where="test stream")


def test_a_round_trip_is_bitwise_and_the_body_spans_several_chunks():
    data = _stream()
    assert len(data) > 3 * (4 << 20)  # the body crosses several 4 MiB digest chunks, and ends mid-chunk
    got = _receive(data)
    skeleton, tensors = snapshot.capture(_state())
    assert got.skeleton == skeleton and got.torchft == {"step": 7, "batches_committed": 14} and got.user == "default"
    assert set(got.tensors) == set(tensors)
    assert all(torch.equal(got.tensors[n], tensors[n]) and got.tensors[n].dtype == tensors[n].dtype for n in tensors)


@pytest.mark.parametrize("where", ["magic", "head length", "head", "body start", "body middle", "body end",
                                   "seal length", "seal"])
def test_a_flipped_bit_anywhere_is_refused(where):
    data = bytearray(_stream())
    head = int.from_bytes(data[8:16], "big")
    body_start = 16 + head
    seal_at = body_start + json.loads(data[16:body_start])["size"] + 8
    seal_len = len(data) - seal_at
    offset = {"magic": 3, "head length": 15, "head": 16 + head // 2, "body start": body_start + 3,
              "body middle": (body_start + seal_at) // 2, "body end": seal_at - 9, "seal length": seal_at - 1,
              "seal": seal_at + seal_len // 2}[where]
    data[offset] ^= 0x10
    with pytest.raises(CorruptGeneration):
        _receive(bytes(data))


def test_a_stream_cut_anywhere_or_with_bytes_after_its_seal_is_refused():
    data = _stream()
    for cut in (0, 5, 12, 40, len(data) // 3, len(data) - 300, len(data) - 1):
        with pytest.raises(CorruptGeneration, match="cut short|ended|parse"):
            _receive(data[:cut])
    with pytest.raises(CorruptGeneration, match="after its seal"):
        _receive(data + b"\0")


def test_a_signed_stream_needs_the_same_key_and_an_unsigned_one_is_refused_by_a_keyed_receiver():
    key, other = SigningKey(b"k" * 32), SigningKey(b"o" * 32)
    signed = _stream(key)
    assert _receive(signed, key).step == 7
    with pytest.raises(CorruptGeneration, match="signature does not match"):
        _receive(signed, other)
    with pytest.raises(CorruptGeneration, match="not signed"):
        _receive(_stream(), key)
    skeleton, tensors = snapshot.capture(_state())
    with pytest.raises(InvalidArgument, match="cannot back a signature"):
        wire.frame(skeleton, tensors, step=1, torchft={}, key=key, algorithm="xxh3-chunked")


def test_another_step_than_the_quorum_named_is_refused():
    with pytest.raises(CorruptGeneration, match="holds step 7, not the step 8"):
        _receive(_stream(), step=8)


def test_receiving_never_unpickles(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle or torch.load called on the load path")

    data = _stream()
    for target, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, name, forbidden)
    assert _receive(data).step == 7


def test_the_control_a_pickled_payload_is_not_a_heal_stream():
    """What torchft's own transports send (a pickle stream) is refused at its first bytes, never unpickled."""
    buffer = io.BytesIO()
    torch.save({"user": {"default": {"w": torch.ones(3)}}, "torchft": {"step": 7}}, buffer)
    with pytest.raises(CorruptGeneration, match="not a trainstate heal stream"):
        _receive(buffer.getvalue())


def test_a_sealed_body_that_is_not_safetensors_is_refused_after_its_digests_match():
    """A sender that seals a broken header (its digests match what it sent): the receiver, which reads the header
    first to give each tensor its own storage, keeps the body whole for the digests and then refuses it."""
    import dataclasses

    skeleton, tensors = snapshot.capture(_state())
    good = wire.frame(skeleton, tensors, step=7, torchft={})
    broken = bytearray(good.layout.header)
    broken[8] = ord("[")  # the JSON header is no longer an object
    bad = dataclasses.replace(good, layout=dataclasses.replace(good.layout, header=bytes(broken)))
    data = b"".join(bytes(p) for p in bad.pieces())
    with pytest.raises(CorruptGeneration, match="header"):
        _receive(data)
