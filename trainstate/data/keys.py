"""Seeds derived from tuples of ints and labels: the one source of every key the data layer uses."""

from __future__ import annotations

import hashlib
import struct


def derive(*words: int | str) -> int:
    """A 64-bit seed derived from any tuple of ints and labels (BLAKE2b, so unrelated tuples do not collide)."""
    h = hashlib.blake2b(digest_size=8, person=b"trainstate.v1")
    for w in words:
        data = b"s" + w.encode() if isinstance(w, str) else b"i" + str(int(w)).encode()
        h.update(struct.pack("<I", len(data)) + data)
    return int.from_bytes(h.digest(), "little")
