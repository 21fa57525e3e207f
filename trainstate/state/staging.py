"""The host buffers a background save copies the state into, and the copy itself.

One :class:`StagingBuffers` per writer slot (:mod:`trainstate.asyncsave`):
allocated once per layout and reused from save to save, pinned when the
source is on a GPU (then copied on a side stream that waits for the current
one, and synchronized before ``save`` returns, so training may change the
sources at once), counted by :meth:`StagingBuffers.held` for ``status()``
and let go at ``close()``. A multi-rank save keeps its owned copy of the
sharded state here too (``sharded``, set by its session).
"""

from __future__ import annotations

from typing import Any

import torch


class StagingBuffers:
    """Host buffers for one in-flight save, reused while the layout stays the same."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
        buffer = self._buffers.get(name)
        pin = pinned and tensor.device.type == "cuda"
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or \
                buffer.is_pinned() != pin:  # (one allocated for a CPU source stays unpinned otherwise)
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[name] = buffer
        return buffer

    def held(self) -> tuple[int, int]:
        """The host bytes these buffers hold, and how many of them are pinned (page-locked): the staging
        copies, and a multi-rank save's owned copy of its sharded state (``sharded``, set by its session)."""
        tensors = list(self._buffers.values()) + tensor_leaves(getattr(self, "sharded", None))
        return sum(t.nbytes for t in tensors), sum(t.nbytes for t in tensors if t.is_pinned())

    def release(self) -> None:
        """Drop every buffer. A pinned one goes back to torch's caching host allocator, which keeps the block
        (rounded up to a power of two) for reuse: :meth:`Writer.shutdown` then asks it to return them."""
        self._buffers.clear()
        self.sharded = None

    def preallocate(self, tensors: dict[str, torch.Tensor]) -> int:
        """Allocate the buffers ``tensors`` will need and fault their pages in now; returns their bytes.

        A first background save otherwise pays for page faults on every byte
        it copies (its stall is several times the steady one); after this it
        copies into memory that is already there.
        """
        pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values())
        for name, tensor in tensors.items():
            buffer = self._buffer(name, tensor, pinned)
            if buffer.numel():
                try:
                    buffer.view(-1).view(torch.uint8).fill_(0)  # every page written once: faulted in
                except RuntimeError:  # a dtype with no byte view
                    buffer.zero_()
        return self.nbytes

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into owned buffers; returns the copies, complete when this returns."""
        pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values())
        for name in [n for n in self._buffers if n not in tensors]:
            del self._buffers[name]
        copies: dict[str, torch.Tensor] = {}
        streams: dict[torch.device, Any] = {}
        for name, tensor in tensors.items():
            buffer = self._buffer(name, tensor, pinned)
            if tensor.device.type == "cuda":
                stream = streams.get(tensor.device)
                if stream is None:
                    stream = streams[tensor.device] = torch.cuda.Stream(tensor.device)
                    stream.wait_stream(torch.cuda.current_stream(tensor.device))  # pending kernels first
                with torch.cuda.stream(stream):
                    _copy(buffer, tensor, non_blocking=buffer.is_pinned())
            else:
                _copy(buffer, tensor)
            copies[name] = buffer
        for stream in streams.values():
            stream.synchronize()  # the copy must be complete before the caller may mutate the source
        return copies

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The plain tensors of a nested state dict (a DTensor by its local shard)."""
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensor_leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensor_leaves(v)]
    if isinstance(tree, torch.Tensor):
        return [tree.to_local() if hasattr(tree, "to_local") else tree]
    return []


def _copy(buffer: torch.Tensor, tensor: torch.Tensor, non_blocking: bool = False) -> None:
    """``buffer.copy_(tensor)``, also for dtypes torch has no copy kernel for (sub-byte, bits, some float8).

    Those are copied as same-size integers, which keeps every bit at any strides.
    """
    source = tensor.detach()
    try:
        buffer.copy_(source, non_blocking=non_blocking)
    except NotImplementedError:
        carrier = _CARRIERS.get(source.element_size())
        if carrier is None:
            raise
        buffer.view(carrier).copy_(source.view(carrier), non_blocking=non_blocking)
