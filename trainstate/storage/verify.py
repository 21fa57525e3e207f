"""Trusted reading: check pointer -> manifest -> files before using any byte.

``read_manifest`` and ``verify_generation`` never load tensor data into
objects; ``load_verified`` reads each file once, checks its digest, and returns
the decoded state. Nothing here calls pickle, ``torch.load`` or ``eval``: JSON
goes through ``json.loads`` with size limits, tensors through the strict
safetensors reader. Every failure is a :class:`CorruptGeneration`.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..format import tensorfile
from ..format.codec import decode
from ..format.digest import digest_bytes, digest_stream, is_chunked, new_hasher
from ..errors import CorruptGeneration, StorageUnavailable
from ..format.manifest import (MANIFEST, MAX_JSON_BYTES, POINTER, STATE, WEIGHTS_POINTER, Manifest, Pointer,
                               check_version, load_json, parse_manifest, parse_pointer)
from ..format.signing import SigningKey
from ..progress import OnBytes
from . import chunked
from .base import Store, pinned


@dataclass(frozen=True)
class Verified:
    """A generation whose manifest, file set and sizes checked out (and, where the
    caller asked for it, every file's digest)."""

    manifest: Manifest
    manifest_digest: str
    manifest_size: int



def read_pointed(store: Store, pointer_file: str, key: SigningKey | None) -> Pointer | None:
    """The pointer ``pointer_file`` holds, parsed but not verified; None when it is absent or unreadable."""
    data = store.read_pointer(pointer_file)
    if data is None:
        return None
    try:
        return parse_pointer(data, f"{store.location}/{pointer_file}", key)
    except CorruptGeneration:
        return None


def point_at(store: Store, verified: Verified, key: SigningKey | None) -> None:
    """Replace ``latest`` (or ``latest-weights``) with a pointer to a generation that just verified: its name,
    manifest digest and size, digest algorithm, update and kind, all taken from what verified."""
    m = verified.manifest
    pointer = Pointer(m.generation, verified.manifest_digest, verified.manifest_size, m.digest_algorithm,
                      m.next_update, m.kind)
    store.write_pointer(POINTER if m.kind == "full" else WEIGHTS_POINTER, pointer.to_bytes(key))


def _read_limited(store: Store, generation: str, file: str, limit: int) -> bytes:
    try:
        with store.open(generation, file) as stream:
            data = read_bounded(stream, limit)
    except FileNotFoundError:
        raise CorruptGeneration(f"{generation}/{file}", "missing") from None
    except OSError as exc:
        raise unreadable(f"{generation}/{file}", exc) from None
    if len(data) > limit:
        raise CorruptGeneration(f"{generation}/{file}", f"larger than the {limit}-byte limit")
    return data


def read_bounded(stream: BinaryIO, limit: int) -> bytes:
    """Read at most ``limit + 1`` bytes, allocating no more than the data needs."""
    chunks, total = [], 0
    while total <= limit:
        chunk = stream.read(min(1 << 20, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_manifest(store: Store, generation: str, pointer: Pointer | None = None,
                  key: SigningKey | None = None) -> tuple[Manifest, str, int]:
    """Parse a generation's manifest; with ``pointer``, check it is the one the pointer names."""
    data = _read_limited(store, generation, MANIFEST, MAX_JSON_BYTES)
    where = f"{generation}/{MANIFEST}"
    algorithm = pointer.digest_algorithm if pointer else None
    manifest = parse_manifest(data, where, key)
    digest = digest_bytes(algorithm or manifest.digest_algorithm, data)
    if pointer is not None and (digest != pointer.manifest_digest or len(data) != pointer.manifest_size):
        raise CorruptGeneration(where, "does not match the digest and size recorded in the latest pointer")
    if manifest.generation != generation:
        raise CorruptGeneration(where, f"belongs to {manifest.generation!r}; the directory was renamed")
    return manifest, digest, len(data)


def verify_generation(store: Store, generation: str, pointer: Pointer | None = None, *, content: bool = True,
                      key: SigningKey | None = None, on_bytes: OnBytes | None = None,
                      listed: dict[str, int | None] | None = None) -> Verified:
    """Check the file set and sizes, and with ``content`` every file's digest and that the state decodes.

    With ``content`` it decodes the state exactly as restore does (a preview:
    large tensors are digested, not kept), so a generation that passes
    ``trainstate verify`` is one restore accepts, short of a mismatch with the
    live objects it is restored into. ``listed``: ``store.files(generation)``
    as the caller listed it a moment ago (not listed again).
    """
    with pinned(store):  # an object store reads the commit record once, not once per file
        return _verify_generation(store, generation, pointer, content=content, key=key, on_bytes=on_bytes,
                                  listed=listed)


def _verify_generation(store: Store, generation: str, pointer: Pointer | None, *, content: bool,
                       key: SigningKey | None, on_bytes: OnBytes | None, listed: dict | None = None) -> Verified:
    manifest, digest, size = read_manifest(store, generation, pointer, key)
    try:
        present = store.files(generation) if listed is None else listed
    except OSError as exc:
        raise unreadable(generation, exc, "cannot list files") from None
    expected = {f.name: f for f in manifest.files}
    unknown = sorted(set(present) - set(expected) - {MANIFEST})
    if unknown:
        raise CorruptGeneration(generation, f"unexpected files {unknown!r:.200}; a published generation is immutable")
    for record in manifest.files:
        where = f"{generation}/{record.name}"
        if record.name not in present:
            raise CorruptGeneration(where, "missing")
        if present[record.name] is None:
            raise CorruptGeneration(where, "is not a regular file")
        if present[record.name] != record.size:
            raise CorruptGeneration(where, f"is {present[record.name]} bytes, the manifest says {record.size}")
    if content:
        decode_verified(store, manifest, preview=True, on_bytes=on_bytes)  # digests state.json and tensor files
        decoded = {STATE, *tensor_files(manifest)}
        for record in manifest.files:
            if record.name in decoded:
                continue
            where = f"{generation}/{record.name}"
            try:
                with store.open(generation, record.name) as stream:
                    if record.chunks:  # a chunked digest: every chunk checked on its own, on every core
                        chunked.verify_file(stream, record, where, manifest.digest_algorithm, on_bytes=on_bytes)
                        continue
                    got_size, got = digest_stream(stream, manifest.digest_algorithm, record.size)
            except OSError as exc:
                raise unreadable(where, exc) from None
            if got_size != record.size or got != record.digest:
                raise CorruptGeneration(where, f"{manifest.digest_algorithm} digest mismatch (content changed)")
            if on_bytes is not None:
                on_bytes(record.size)
    return Verified(manifest, digest, size)


def read_state_json(store: Store, manifest: Manifest) -> dict[str, Any]:
    record = manifest.file(STATE)
    data = _read_limited(store, manifest.generation, STATE, min(record.size, MAX_JSON_BYTES))
    where = f"{manifest.generation}/{STATE}"
    state = load_json(data, where)
    check_state_schema(state, where, manifest.kind, manifest.next_update)
    return state


def check_state_schema(state: dict, where: str, kind: str, next_update: int) -> None:
    """The top-level shape of state.json; the values inside are checked as they are decoded."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CorruptGeneration(where, what)

    need(state.get("format") == "trainstate-state", "not a trainstate state file")
    check_version(where, state.get("format_version"))
    need(state.get("kind") == kind, f"kind differs from the manifest's {kind!r}")
    expected = {"format", "format_version", "kind", "clocks", "counters", "facts", "components", "contract", "history"}
    optional = ({"rng", "pending_gradients", "grads"} if kind == "full" else set()) | {"sharded"}
    need(expected <= set(state) <= expected | optional, f"fields {sorted(state)!r:.200} are not those of a {kind} state")
    clocks = state["clocks"]
    need(type(clocks) is dict and set(clocks) == {"next_update", "tokens_seen"}
         and all(type(v) is int and v >= 0 for v in clocks.values()), "malformed clocks")
    need(clocks["next_update"] == next_update, "next_update differs from the manifest's")
    need(type(state["counters"]) is dict and all(type(v) is int for v in state["counters"].values()),
         "malformed counters")
    components = state["components"]
    need(type(components) is dict and all(type(c) is dict and set(c) == {"type", "state"} and type(c["type"]) is str
                                          for c in components.values()), "malformed components")
    contract = state["contract"]
    need(type(contract) is dict and set(contract) == {"fields", "versions"}
         and type(contract["fields"]) is dict and type(contract["versions"]) is dict, "malformed contract")
    need(type(state["history"]) is list, "malformed history")
    if "sharded" in state:  # multi-rank: RNG and what differs between ranks are in the per-rank records
        need(type(state["sharded"]) is dict and not {"rng", "grads"} & set(state), "malformed multi-rank record")
    elif kind == "full":
        need(type(state.get("rng")) is dict and type(state.get("pending_gradients")) is bool, "malformed rng record")
        need(type(state.get("grads", {})) is dict, "malformed gradients record")


def tensor_files(manifest: Manifest) -> list[str]:
    """The tensor files ``state.json`` refers to (in a multi-rank generation: the global one only; the
    per-rank records and DCP's shards are read by :mod:`trainstate.distributed`)."""
    if manifest.ranks:
        return [f.name for f in manifest.files if f.name == "tensors.safetensors"]
    return [f.name for f in manifest.files if f.name.endswith(".safetensors")]


def read_layouts(store: Store, manifest: Manifest) -> dict[str, tensorfile.Layout]:
    """Parse every tensor file's header (metadata only, no tensor data)."""
    layouts = {}
    for name in tensor_files(manifest):
        with store.open(manifest.generation, name) as stream:
            layouts[name] = tensorfile.parse_header(stream, manifest.file(name).size, f"{manifest.generation}/{name}")
    return layouts


PREVIEW_BYTES = 1 << 16  # in a preview, tensors larger than this are digested but not kept (RNG states are smaller)


class _DigestingReader:
    """Reads a file strictly in order while a worker thread digests every byte read.

    Lets restore read each tensor once, straight into a fresh tensor, and check
    the file's digest from the same buffers instead of a second full read.
    """

    def __init__(self, stream: BinaryIO, algorithm: str, pool: ThreadPoolExecutor):
        self._stream, self._hasher, self._pool = stream, new_hasher(algorithm), pool
        self._pending: deque[Future] = deque()
        self.position = 0

    def _digest(self, data: bytes | memoryview) -> None:
        self._pending.append(self._pool.submit(self._hasher.update, data))
        self.position += len(data)
        while len(self._pending) > 8:
            self._pending.popleft().result()

    def read(self, n: int) -> bytes:
        data = self._stream.read(n)
        self._digest(data)
        return data

    def readinto(self, view: memoryview) -> int:
        n = self._stream.readinto(view)
        if n:
            self._digest(memoryview(view)[:n])
        return n

    def seek(self, offset: int) -> int:
        if offset != self.position:  # entries are contiguous and read in order
            raise CorruptGeneration("tensor file", f"non-sequential read to {offset} at {self.position}")
        return offset

    def hexdigest(self) -> str:
        while self._pending:
            self._pending.popleft().result()
        return self._hasher.hexdigest()


def load_verified(store: Store, generation: str, pointer: Pointer | None = None,
                  component: str | None = None, key: SigningKey | None = None) -> tuple[Verified, dict[str, Any]]:
    """Verify a generation completely and decode it, reading every byte once.

    Structure first (manifest against the pointer, file set, sizes); then each
    file is read once, its digest checked, and tensors land in freshly
    allocated memory. Nothing reaches a live object here: the caller loads the
    returned payload only after this returns. With ``component``, only that
    component is decoded (every file is still read and verified).
    """
    verified = verify_generation(store, generation, pointer, content=False, key=key)
    return verified, decode_verified(store, verified.manifest, component)


def decode_verified(store: Store, manifest: Manifest, component: str | None = None, *, preview: bool = False,
                    into: dict[str, torch.Tensor] | None = None,
                    progress: chunked.Progress | None = None, on_bytes: OnBytes | None = None) -> dict[str, Any]:
    """Read every file of a structurally verified generation once, check each digest, decode the payload.

    ``preview``: tensors above ``PREVIEW_BYTES`` are read (and digested) but
    not kept; the payload holds meta tensors of their shape and dtype, enough
    for every structural check. ``into``: tensors whose name, shape and dtype
    match are read straight into those live tensors; callers pass it only for
    a generation that has already verified completely, or (``blake3-chunked``,
    where each chunk verifies before its bytes are copied) with ``progress``
    to learn whether live tensors changed before a failure.
    """
    generation = manifest.generation
    state = _read_verified_state(store, manifest)
    if on_bytes is not None:
        on_bytes(manifest.file(STATE).size)
    where_state = f"{generation}/{STATE}"
    if component is not None:
        if component not in state["components"]:
            raise CorruptGeneration(where_state, f"has no component {component!r}")
        state = state["components"][component]
    try:
        wanted = set(referenced_tensors(state))
        tensors: dict[str, torch.Tensor] = {}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainstate-verify") as pool:
            for name in tensor_files(manifest):
                _read_tensor_file(store, manifest, name, wanted, tensors, pool, preview=preview, into=into,
                                  progress=progress, on_bytes=on_bytes)
        if component is not None:
            return {"type": state["type"], "state": decode(state["state"], component, tensors)}
        payload = decode_state(state, tensors)
        check_decoded(payload, where_state)
        return payload
    except RecursionError:
        raise CorruptGeneration(where_state, "nested too deeply") from None
    except OSError as exc:
        raise unreadable(generation, exc) from None


def preview_headers(store: Store, manifest: Manifest) -> dict[str, Any]:
    """A ``blake3-chunked`` generation's payload for every check before a live object changes, reading only
    ``state.json``, each tensor file's header and the RNG tensors (all verified); meta tensors for the rest."""
    state = _read_verified_state(store, manifest)
    where_state = f"{manifest.generation}/{STATE}"
    try:
        tensors, _ = chunked.header_preview(store, manifest, tensor_files(manifest),
                                            set(referenced_tensors(state.get("rng", {}))))
        payload = decode_state(state, tensors)
        check_decoded(payload, where_state)
        return payload
    except RecursionError:
        raise CorruptGeneration(where_state, "nested too deeply") from None
    except OSError as exc:
        raise unreadable(manifest.generation, exc) from None


def decode_state(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Decode the sections the writer encoded; the others (clocks, counters, contract, history) were
    written as plain JSON and are read as such, so a contract value like ``{"$t": ...}`` stays a dict.
    Facts are encoded from format 2 on; format 1 wrote them as plain JSON."""
    payload = dict(state)
    payload["components"] = {name: {"type": c["type"], "state": decode(c["state"], name, tensors)}
                             for name, c in state["components"].items()}
    if state["format_version"] >= 2:
        payload["facts"] = decode(state["facts"], "facts", tensors)
    if "rng" in state:
        payload["rng"] = decode(state["rng"], "rng", tensors)
    if "grads" in state:
        payload["grads"] = {name: decode(g, f"grads.{name}", tensors) for name, g in state["grads"].items()}
    return payload


def check_decoded(payload: dict[str, Any], where: str) -> None:
    """The sections restore relies on have the right types after tags are decoded.

    ``check_state_schema`` sees raw JSON, where ``{"$int": 5}`` is a dict; this
    sees what decoding made of it.
    """
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CorruptGeneration(where, f"malformed {what} after decoding")

    def str_dict(value: Any) -> bool:
        return type(value) is dict and all(type(k) is str for k in value)

    need(str_dict(payload["counters"]) and all(type(v) is int for v in payload["counters"].values()), "counters")
    need(str_dict(payload["components"]) and all(
        type(c) is dict and set(c) == {"type", "state"} and type(c["type"]) is str
        for c in payload["components"].values()), "components")
    contract = payload["contract"]
    need(str_dict(contract) and str_dict(contract.get("fields")) and str_dict(contract.get("versions")), "contract")
    need(type(payload["history"]) is list, "history")
    if "rng" in payload:
        need(str_dict(payload["rng"]) and str_dict(payload["rng"].get("named", {})), "RNG record")
    grads = payload.get("grads", {})
    need(str_dict(grads) and all(str_dict(g) and all(isinstance(t, torch.Tensor) for t in g.values())
                                 for g in grads.values()), "gradients")


def _read_verified_state(store: Store, manifest: Manifest) -> dict[str, Any]:
    record = manifest.file(STATE)
    where = f"{manifest.generation}/{STATE}"
    data = _read_limited(store, manifest.generation, STATE, min(record.size, MAX_JSON_BYTES))
    if len(data) != record.size or digest_bytes(manifest.digest_algorithm, data) != record.digest:
        raise CorruptGeneration(where, f"{manifest.digest_algorithm} digest mismatch (content changed)")
    state = load_json(data, where)
    check_state_schema(state, where, manifest.kind, manifest.next_update)
    return state


def read_json_file(store: Store, manifest: Manifest, name: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON file of a structurally verified generation, its digest checked against the manifest; ``limit``: the
    most bytes it may hold (DCP's metadata, which grows with the ranks, has a limit of its own)."""
    record = manifest.file(name)
    where = f"{manifest.generation}/{name}"
    data = _read_limited(store, manifest.generation, name, min(record.size, limit))
    if len(data) != record.size or digest_bytes(manifest.digest_algorithm, data) != record.digest:
        raise CorruptGeneration(where, f"{manifest.digest_algorithm} digest mismatch (content changed)")
    return load_json(data, where, limit)


def read_tensors(store: Store, manifest: Manifest, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of one tensor file of a structurally verified generation, its digest checked."""
    tensors: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainstate-verify") as pool:
        _read_tensor_file(store, manifest, name, _ALL, tensors, pool)
    return tensors


class _Everything(set):
    def __contains__(self, item: object) -> bool:
        return True


_ALL = _Everything()


_fits = chunked.fits


def _read_tensor_file(store: Store, manifest: Manifest, name: str, wanted: set[str],
                      tensors: dict[str, torch.Tensor], pool: ThreadPoolExecutor, *,
                      preview: bool = False, into: dict[str, torch.Tensor] | None = None,
                      progress: chunked.Progress | None = None, on_bytes: OnBytes | None = None) -> None:
    """Read and digest one tensor file; with ``preview``, large tensors become meta placeholders
    (checked for shape and dtype only); with ``into``, matching tensors are read straight into those."""
    if is_chunked(manifest.digest_algorithm):  # every chunk verified on its own, on every core
        chunked.read_file(store, manifest, name, wanted, tensors, preview=preview, preview_bytes=PREVIEW_BYTES,
                          into=into, progress=progress, on_bytes=on_bytes)
        return
    record = manifest.file(name)
    where = f"{manifest.generation}/{name}"
    with store.open(manifest.generation, name) as stream:
        reader = _DigestingReader(stream, manifest.digest_algorithm, pool)
        mismatch = CorruptGeneration(where, f"{manifest.digest_algorithm} digest mismatch (content changed)")
        try:
            layout = tensorfile.parse_header(reader, record.size, where)
            for entry in layout.entries:
                if entry.name in tensors:
                    raise CorruptGeneration(where, f"tensor {entry.name!r:.80} appears in two files")
                if preview and entry.nbytes > PREVIEW_BYTES:
                    tensorfile.skip_tensor(reader, layout, entry, where)
                    tensor = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
                elif into is not None and _fits(into.get(entry.name), entry):
                    tensor = tensorfile.read_tensor_into(reader, layout, entry, where, into[entry.name])
                else:
                    tensor = tensorfile.read_tensor(reader, layout, entry, where)
                if entry.name in wanted:
                    tensors[entry.name] = tensor
        except CorruptGeneration as exc:
            # Name the root cause: a file that fails to parse has almost always been altered.
            while reader.position <= record.size and reader.read(1 << 20):
                pass
            if reader.hexdigest() != record.digest:
                raise mismatch from exc
            raise
        if reader.position != record.size or reader.hexdigest() != record.digest:
            raise mismatch
    if on_bytes is not None:
        on_bytes(record.size)


_SCALARS = frozenset((type(None), bool, str, int, float))


def referenced_tensors(skeleton: Any) -> list[str]:
    """Names of every tensor a skeleton references, in order."""
    out: list[str] = []
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if type(node) is list:
            if not _SCALARS.issuperset(map(type, node)):  # (a list of scalars, an RNG's state words, has none)
                stack.extend(node)
        elif type(node) is dict:
            if len(node) == 1 and ("$t" in node or "$nd" in node):
                ref = node.get("$t", node.get("$nd"))
                if type(ref) is str:
                    out.append(ref)
                continue
            stack.extend(node.values())
    return out


def unreadable(where: str, exc: OSError, what: str = "unreadable") -> OSError:
    """What an ``OSError`` met while reading ``where`` means: damage to the generation (:class:`CorruptGeneration`
    naming it; a restore passes over it), unless the store did not answer at all (:class:`StorageUnavailable`,
    returned as it is). Those bytes may well be intact: a restore that passed over them would resume from an
    older generation, or find none and call a transient outage permanent, so it raises instead."""
    if isinstance(exc, StorageUnavailable):
        return exc
    return CorruptGeneration(where, f"{what} ({_why(exc)})")


def _why(exc: OSError) -> str:
    """What an OSError says: its strerror (a system error), else its message (a store's error, raised with one)."""
    return exc.strerror or str(exc) or type(exc).__name__
