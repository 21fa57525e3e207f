"""Trusted reading: check pointer -> manifest -> files before using any byte.

``read_manifest`` and ``verify_generation`` never load tensor data into
objects; ``load_payload`` runs only on a generation that verified and returns
the decoded state. Nothing here calls pickle, ``torch.load`` or ``eval``: JSON
goes through ``json.loads`` with size limits, tensors through the strict
safetensors reader. Every failure is a :class:`CorruptGeneration`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from . import tensorfile
from .codec import decode
from .digest import digest_bytes, digest_stream
from .errors import CorruptGeneration
from .manifest import FORMAT_VERSION, MANIFEST, MAX_JSON_BYTES, STATE, Manifest, Pointer, load_json, parse_manifest
from .storage import Store


@dataclass(frozen=True)
class Verified:
    """A generation whose manifest (and, when ``content`` is true, every file) checked out."""

    manifest: Manifest
    manifest_digest: str
    manifest_size: int
    content: bool


def _read_limited(store: Store, generation: str, file: str, limit: int) -> bytes:
    try:
        with store.open(generation, file) as stream:
            data = read_bounded(stream, limit)
    except FileNotFoundError:
        raise CorruptGeneration(f"{generation}/{file}", "missing") from None
    except OSError as exc:
        raise CorruptGeneration(f"{generation}/{file}", f"unreadable ({exc.strerror})") from None
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


def read_manifest(store: Store, generation: str, pointer: Pointer | None = None) -> tuple[Manifest, str, int]:
    """Parse a generation's manifest; with ``pointer``, check it is the one the pointer names."""
    data = _read_limited(store, generation, MANIFEST, MAX_JSON_BYTES)
    where = f"{generation}/{MANIFEST}"
    algorithm = pointer.digest_algorithm if pointer else None
    manifest = parse_manifest(data, where)
    digest = digest_bytes(algorithm or manifest.digest_algorithm, data)
    if pointer is not None and (digest != pointer.manifest_digest or len(data) != pointer.manifest_size):
        raise CorruptGeneration(where, "does not match the digest and size recorded in the latest pointer")
    if manifest.generation != generation:
        raise CorruptGeneration(where, f"belongs to {manifest.generation!r}; the directory was renamed")
    return manifest, digest, len(data)


def verify_generation(store: Store, generation: str, pointer: Pointer | None = None, *, content: bool = True) -> Verified:
    """Check the file set and sizes, and with ``content`` every file's digest."""
    manifest, digest, size = read_manifest(store, generation, pointer)
    try:
        present = store.files(generation)
    except OSError as exc:
        raise CorruptGeneration(generation, f"cannot list files ({exc.strerror})") from None
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
        for record in manifest.files:
            where = f"{generation}/{record.name}"
            try:
                with store.open(generation, record.name) as stream:
                    got_size, got = digest_stream(stream, manifest.digest_algorithm, record.size)
            except OSError as exc:
                raise CorruptGeneration(where, f"unreadable ({exc.strerror})") from None
            if got_size != record.size or got != record.digest:
                raise CorruptGeneration(where, f"{manifest.digest_algorithm} digest mismatch (content changed)")
    return Verified(manifest, digest, size, content)


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
    need(state.get("format_version") == FORMAT_VERSION, f"format_version is not {FORMAT_VERSION}")
    need(state.get("kind") == kind, f"kind differs from the manifest's {kind!r}")
    expected = {"format", "format_version", "kind", "clocks", "counters", "facts", "components", "contract", "history"}
    optional = {"rng", "pending_gradients", "grads"} if kind == "full" else set()
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
    if kind == "full":
        need(type(state.get("rng")) is dict and type(state.get("pending_gradients")) is bool, "malformed rng record")
        need(type(state.get("grads", {})) is dict, "malformed gradients record")


def tensor_files(manifest: Manifest) -> list[str]:
    return [f.name for f in manifest.files if f.name.endswith(".safetensors")]


def read_layouts(store: Store, manifest: Manifest) -> dict[str, tensorfile.Layout]:
    """Parse every tensor file's header (metadata only, no tensor data)."""
    layouts = {}
    for name in tensor_files(manifest):
        with store.open(manifest.generation, name) as stream:
            layouts[name] = tensorfile.parse_header(stream, manifest.file(name).size, f"{manifest.generation}/{name}")
    return layouts


def load_payload(store: Store, manifest: Manifest, component: str | None = None) -> dict[str, Any]:
    """Decode a verified generation: the state skeleton with its tensors loaded.

    With ``component``, only that component's state is decoded and only the
    tensors it references are read.
    """
    state = read_state_json(store, manifest)
    where_state = f"{manifest.generation}/{STATE}"
    if component is not None:
        components = state.get("components")
        if type(components) is not dict or component not in components:
            raise CorruptGeneration(where_state, f"has no component {component!r}")
        state = components[component]
    try:
        wanted = set(referenced_tensors(state))
        tensors: dict[str, torch.Tensor] = {}
        for name, layout in read_layouts(store, manifest).items():
            where = f"{manifest.generation}/{name}"
            with store.open(manifest.generation, name) as stream:
                for entry in layout.entries:
                    if entry.name in tensors:
                        raise CorruptGeneration(where, f"tensor {entry.name!r:.80} appears in two files")
                    if entry.name in wanted:
                        tensors[entry.name] = tensorfile.read_tensor(stream, layout, entry, where)
        return decode(state, component or "", tensors)
    except RecursionError:
        raise CorruptGeneration(where_state, "nested too deeply") from None


def referenced_tensors(skeleton: Any) -> list[str]:
    """Names of every tensor a skeleton references, in order."""
    out: list[str] = []
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if type(node) is list:
            stack.extend(node)
        elif type(node) is dict:
            if len(node) == 1 and ("$t" in node or "$nd" in node):
                ref = node.get("$t", node.get("$nd"))
                if type(ref) is str:
                    out.append(ref)
                continue
            stack.extend(node.values())
    return out
