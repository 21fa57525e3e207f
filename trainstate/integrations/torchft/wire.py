"""A rank's restart state as one verified, pickle-free stream: pure framing, no torchft, no sockets.

What a healing replica receives from a live peer (:mod:`.transport`) is the
same thing a generation holds for one process (:func:`trainstate.state.snapshot.capture`):
a JSON skeleton, which names every tensor it references, and the tensors, as
the bytes of one safetensors file. On the wire::

    magic "TSHEAL\\0\\1"
    u64 big-endian length, then the head: canonical JSON
        {"format": "trainstate-heal", "version": 1, "step": N, "torchft": {...},
         "skeleton": {...}, "shards": {key path: a DTensor's layout, for each local shard sent},
         "size": body bytes, "algorithm": "xxh3-chunked" | "blake3-chunked"}
    the body: a safetensors file of ``size`` bytes
    u64 big-endian length, then the seal: canonical JSON
        {"head": digest of the head's bytes, "chunks": [one digest per 4 MiB of the body],
         "signature": HMAC-SHA256 of the rest, with the run's key (absent without one)}

The sender digests the body as it sends it (one pass over the tensors); the
receiver reads it straight into fresh memory, each tensor into storage of its
own (the body's safetensors header, bounded, says where each begins; one that
does not parse leaves the body in one buffer for the digests to judge), and
digests it there. Only once the seal is read and every digest (and with a
key, the signature) matches does it decode the head's skeleton and hand the
tensors out: a flipped bit, a stream
cut short or anything after the seal raises :class:`~trainstate.errors.CorruptGeneration`,
and no byte of it reaches a live tensor (that happens later, on the training
thread, from what :func:`receive` returned). Nothing here calls ``pickle`` or
``torch.load``.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CorruptGeneration, InvalidArgument
from ...format import strictjson, tensorfile
from ...format.digest import CHUNK_BYTES, CHUNKED, FAST_CHUNKED, ChunkedHasher, digest_bytes
from ...format.signing import SigningKey, canonical, check_signable

MAGIC = b"TSHEAL\x00\x01"
FORMAT, VERSION = "trainstate-heal", 1
MAX_HEAD_BYTES = 64 << 20  # a skeleton is metadata: a head larger than this is refused before it is read
MAX_SEAL_BYTES = 64 << 20


@dataclass
class Outgoing:
    """One rank's state framed for sending: iterate :meth:`pieces` once per receiver."""

    head: bytes
    layout: tensorfile.Layout
    tensors: dict[str, torch.Tensor]
    algorithm: str
    key: SigningKey | None

    def pieces(self) -> Iterator[memoryview | bytes]:
        """The stream, the body as views of the tensors' memory (valid until the next piece), digested as sent."""
        yield MAGIC + struct.pack(">Q", len(self.head)) + self.head
        hasher = ChunkedHasher(self.algorithm)
        with ThreadPoolExecutor(1, thread_name_prefix="trainstate-heal-digest") as digester:  # beside the socket
            pending = []
            for view in tensorfile.chunks(self.layout, self.tensors, CHUNK_BYTES):
                pending.append(digester.submit(hasher.update, view))  # (the view holds its buffer alive)
                yield view
            for done in pending:
                done.result()
        hasher.hexdigest()
        seal = self._seal(hasher.chunks)
        yield struct.pack(">Q", len(seal)) + seal

    def _seal(self, digests: list[str]) -> bytes:
        body: dict[str, Any] = {"head": digest_bytes(CHUNKED, self.head), "chunks": digests}
        if self.key is not None:
            body["signature"] = self.key.sign(body)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def frame(skeleton: dict, tensors: dict[str, torch.Tensor], *, step: int, torchft: dict, user: str = "default",
          key: SigningKey | None = None, algorithm: str | None = None, shards: dict | None = None) -> Outgoing:
    """``skeleton`` and ``tensors`` (:func:`trainstate.state.snapshot.capture`) framed for step ``step``;
    ``torchft``: the manager's own state (``step``, ``batches_committed``); ``user``: the key the manager
    registered the state's functions under; ``shards``: the layout of each DTensor whose local shard the
    skeleton holds (:mod:`.shards`). ``algorithm``: ``xxh3-chunked``
    (corruption) unless a key signs, which needs ``blake3-chunked`` (authentication)."""
    algorithm = algorithm or (CHUNKED if key is not None else FAST_CHUNKED)
    if algorithm not in (CHUNKED, FAST_CHUNKED):
        raise InvalidArgument(f"a heal is digested with {CHUNKED!r} or {FAST_CHUNKED!r}, not {algorithm!r}")
    check_signable(algorithm, key)
    layout = tensorfile.plan(tensors)
    head = canonical({"format": FORMAT, "version": VERSION, "step": int(step), "torchft": torchft, "user": user,
                      "skeleton": skeleton, "shards": shards or {}, "size": layout.size,
                      "algorithm": algorithm})
    return Outgoing(head, layout, tensors, algorithm, key)


@dataclass
class Incoming:
    """What :func:`receive` verified: the sender's skeleton and tensors (fresh CPU memory) and torchft's state."""

    step: int
    torchft: dict
    user: str
    skeleton: dict
    tensors: dict[str, torch.Tensor]
    shards: dict


def receive(stream: Any, *, step: int, key: SigningKey | None, where: str) -> Incoming:
    """Read one stream from ``stream`` (``read(n)``, fewer bytes only at its end, and ``readinto``), verify all of
    it, then decode it: the tensors are the verified bytes, in fresh storage nothing else holds.

    Refused (:class:`CorruptGeneration` naming ``where``): another magic or version, a head or seal over its
    bound, a stream cut short or with bytes after the seal, a head or chunk digest that does not match, a
    missing or wrong signature when ``key`` is set, another step than ``step``."""
    read = stream.read
    if _exact(read, len(MAGIC), where) != MAGIC:
        raise CorruptGeneration(where, "is not a trainstate heal stream (another transport on the other side?)")
    head = _exact(read, _length(read, MAX_HEAD_BYTES, where, "head"), where)
    try:
        claimed = strictjson.loads(head, f"{where} (head)")
        size, algorithm = int(claimed["size"]), claimed["algorithm"]
    except (CorruptGeneration, KeyError, TypeError, ValueError) as exc:
        raise CorruptGeneration(where, f"its head does not parse ({exc}); refusing it") from None
    if algorithm not in (CHUNKED, FAST_CHUNKED) or size < 0:
        raise CorruptGeneration(where, f"its head names algorithm {algorithm!r} and size {size}")
    layout, buffers, digests = _read_body(stream, size, algorithm, where)
    seal_bytes = _exact(read, _length(read, MAX_SEAL_BYTES, where, "seal"), where)
    if read(1):
        raise CorruptGeneration(where, "has bytes after its seal; refusing it")
    try:
        seal = strictjson.loads(seal_bytes, f"{where} (seal)")
        expected_head, expected = seal["head"], seal["chunks"]
    except (CorruptGeneration, KeyError, TypeError) as exc:
        raise CorruptGeneration(where, f"its seal does not parse ({exc}); refusing it") from None
    if key is not None:
        key.check(seal, seal.get("signature"), where)
        if algorithm != CHUNKED:
            raise CorruptGeneration(where, f"is digested with {algorithm!r}, which cannot back its signature")
    if digest_bytes(CHUNKED, head) != expected_head:
        raise CorruptGeneration(where, "its head differs from what the sender sealed (damaged in transit)")
    if digests != expected:
        bad = next((i for i, (a, b) in enumerate(zip(digests, expected)) if a != b), min(len(digests), len(expected)))
        raise CorruptGeneration(where, f"chunk {bad} of its body differs from what the sender sealed (damaged in "
                                       "transit); refusing it")
    if claimed.get("format") != FORMAT or claimed.get("version") != VERSION:
        raise CorruptGeneration(where, f"is {claimed.get('format')!r} version {claimed.get('version')!r}, which this "
                                       f"trainstate does not read")
    if claimed.get("step") != step:
        raise CorruptGeneration(where, f"holds step {claimed.get('step')}, not the step {step} the quorum named")
    if type(claimed.get("skeleton")) is not dict or type(claimed.get("torchft")) is not dict or type(
            claimed.get("user")) is not str or type(claimed.get("shards")) is not dict:
        raise CorruptGeneration(where, "its head lacks the skeleton, torchft's state, the user key or the shards")
    if layout is None:  # the sealed body's header did not parse: the sender's fault, not the link's
        tensorfile.parse_header(io.BytesIO(b"".join(bytes(b.numpy()) for b in buffers)), size, where)
        raise CorruptGeneration(where, "its body is not a safetensors file")
    tensors = {e.name: buf.view(e.dtype).reshape(e.shape) if e.nbytes else torch.empty(e.shape, dtype=e.dtype)
               for e, buf in zip(layout.entries, buffers)}
    return Incoming(step, claimed["torchft"], claimed["user"], claimed["skeleton"], tensors, claimed["shards"])


def _length(read: Callable[[int], bytes], bound: int, where: str, what: str) -> int:
    (length,) = struct.unpack(">Q", _exact(read, 8, where))
    if length > bound:
        raise CorruptGeneration(where, f"declares a {what} of {length} bytes, over the {bound} this reads")
    return length


def _exact(read: Callable[[int], bytes], n: int, where: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = read(n - len(out))
        if not got:
            raise CorruptGeneration(where, f"ended after {len(out)} of {n} bytes (cut short in transit)")
        out += got
    return bytes(out)


def _read_body(stream: Any, size: int, algorithm: str, where: str
               ) -> tuple[tensorfile.Layout | None, list[torch.Tensor], list[str]]:
    """Read the body's ``size`` bytes, each tensor into fresh storage of its own (allocated as ``torch.load``
    allocates, so that a heal costs the allocator no more than the stock transport does), digested in order
    beside the socket: the layout (``None`` when the header does not parse, a damage the digests then name),
    the buffers in data order, and the chunk digests. Nothing read is decoded until the digests match."""
    hasher = ChunkedHasher(algorithm)
    with ThreadPoolExecutor(1, thread_name_prefix="trainstate-heal-digest") as digester:  # beside the socket
        def take(buffer: torch.Tensor) -> None:
            view = tensorfile.byte_view(buffer) if buffer.numel() else memoryview(b"")
            for start in range(0, len(view), CHUNK_BYTES):
                piece = view[start:start + CHUNK_BYTES]
                got = tensorfile.fill(stream, piece)
                if got < len(piece):
                    raise CorruptGeneration(where, f"ended {size - taken[0] - got} bytes short of its body (cut "
                                                   "short in transit)")
                taken[0] += got
                pending.append(digester.submit(hasher.update, piece))

        pending: list = []
        taken = [0]
        prefix = torch.empty(min(8, size), dtype=torch.uint8)
        take(prefix)
        length = int.from_bytes(prefix.numpy().tobytes(), "little") if size >= 8 else 0
        header = torch.empty(min(length, tensorfile.MAX_HEADER_BYTES, max(0, size - 8)), dtype=torch.uint8)
        take(header)
        try:
            layout = tensorfile.parse_header(io.BytesIO(prefix.numpy().tobytes() + header.numpy().tobytes()), size,
                                             where)
        except CorruptGeneration:
            layout = None
        if layout is None or layout.data_start != taken[0]:
            layout, buffers = None, [prefix, header, torch.empty(size - taken[0], dtype=torch.uint8)]
            take(buffers[-1])
        else:
            buffers = [torch.empty(e.nbytes, dtype=torch.uint8) for e in layout.entries]
            for buffer in buffers:
                take(buffer)
        for done in pending:
            done.result()
    hasher.hexdigest()
    return layout, buffers, hasher.chunks
