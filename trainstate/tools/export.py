"""Export one component's weights from a verified generation as safetensors, for release.

The order of one export:

1. Open the source through :mod:`.exportread`: a generation directory, or a
   run directory's recovery point, local or an object-store URL, from one
   process or from many ranks. It is verified completely (signature
   included, when a key is configured) in one streaming pass, and the
   component's tensors are planned from headers alone: their names, dtypes,
   shapes, the pieces each is stored in, and which names are one tied tensor.
   Nothing else of the generation (optimizer, RNG, data position, clocks) is
   written.
2. Plan the files (pure): a tied tensor is stored once under the name
   ``safetensors.torch.save_model`` would keep, the others recorded in the
   file's metadata, so ``safetensors.torch.load_model`` re-ties them;
   floating-point tensors are cast to ``dtype``; above ``max_shard_size`` the
   tensors are split into ``model-0000i-of-0000N.safetensors`` with a
   ``model.safetensors.index.json`` (the Hugging Face layout). Each file's
   header is computed before any tensor is read.
3. Publish (:mod:`.bundle`): each weight file is written one tensor at a time
   (assembled from its pieces, cast, written, dropped), so memory holds about
   one tensor, never the model; then ``config.json`` (a Hugging Face config),
   the included files, the model card, and last the release manifest, all
   into a staging directory that is fsynced and renamed to ``out``. A
   non-empty ``out`` is never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..errors import CorruptGeneration, InvalidArgument
from ..format import signing, tensorfile
from ..format.manifest import MANIFEST
from ..format.signing import SigningKey
from ..progress import OnBytes
from ..storage.posix import PosixOps
from . import bundle, modelcard
from .exportread import Source, Spec, open_source

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CARD_FILE = "README.md"
CONFIG_FILE = "config.json"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class ExportInfo:
    """What an export wrote.

    ``files``: the weight files, in order (one, or the shards); ``total_bytes``:
    the bytes of tensor data stored (the index's ``total_size``); ``shards``:
    how many weight files; ``tied``: each stored name and the names re-tied to
    it on load; ``dtype``: the cast applied to floating-point tensors (``None``:
    as trained); ``world_size``: the ranks that wrote the source generation;
    ``config``: whether a Hugging Face ``config.json`` was written;
    ``included``: the files ``include`` added; ``signed``: whether the release
    manifest is signed.
    """

    directory: str
    generation: str
    files: tuple[str, ...]
    total_bytes: int
    shards: int
    tied: Mapping[str, tuple[str, ...]]
    dtype: str | None
    world_size: int = 1
    config: bool = False
    included: tuple[str, ...] = ()
    signed: bool = False


def parse_size(value: int | str) -> int:
    """``5GB`` (10^9), ``500MiB`` (2^20) or a plain number of bytes, as an int."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, 1
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).upper() not in _UNITS:
            raise InvalidArgument(f"max_shard_size={value!r} is not a size; use bytes or a number with "
                                  "KB/MB/GB/TB (powers of 10) or KiB/MiB/GiB/TiB (powers of 2), e.g. '5GB'")
        number, unit = float(match.group(1)), _UNITS[match.group(2).upper()]
    size = int(number * unit)
    if size <= 0:
        raise InvalidArgument(f"max_shard_size={value!r} must be positive")
    return size


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype={dtype!r} is not one of {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


# --- planning (pure) -----------------------------------------------------------------------------------------

def output_dtype(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors in ``target``; integer, bool and complex tensors keep theirs."""
    return target if target is not None and dtype.is_floating_point else dtype


def plan_shards(sizes: Mapping[str, int], max_bytes: int | None) -> list[list[str]]:
    """Names per file, in order: a new file starts when the next tensor would take this one above
    ``max_bytes`` (a tensor larger than that gets a file of its own, as Hugging Face does)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if max_bytes is not None and shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-00001-of-0000N.safetensors`` ..."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def shard_header(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
                 ) -> tuple[bytes, list[str]]:
    """A safetensors header for ``tensors`` (name to dtype and shape) and the order their data follows it.

    The order is the ``safetensors`` library's (larger elements first, then by
    name), so every tensor starts aligned to its element size."""
    order = sorted(tensors, key=lambda n: (-tensors[n][0].itemsize, n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        st_name = tensorfile._ST_NAMES.get(dtype)
        if st_name is None:
            raise InvalidArgument(f"tensor {name!r} is {dtype}, which safetensors has no type for; export it with "
                                  "dtype='bf16', 'fp16' or 'fp32' (--dtype) if it is floating point")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": st_name, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, order


def plan_files(specs: Mapping[str, Spec], tied: Mapping[str, tuple[str, ...]], target: torch.dtype | None,
               max_bytes: int | None, provenance: Mapping[str, str]
               ) -> tuple[list[tuple[str, bytes, list[str]]], bytes | None, int]:
    """Each weight file's name, header and tensor order; the index (``None`` for one file); the tensor bytes."""
    shapes = {n: (output_dtype(s.dtype, target), s.shape) for n, s in specs.items()}
    sizes = {n: math.prod(shape) * dtype.itemsize for n, (dtype, shape) in shapes.items()}
    groups = plan_shards(sizes, max_bytes)
    names = shard_names(len(groups))
    files, weight_map = [], {}
    for file, group in zip(names, groups):
        metadata = {"format": "pt"}
        for kept in group:
            metadata.update({other: kept for other in tied.get(kept, ())})  # as save_model records them
        metadata.update({k: v for k, v in provenance.items() if k not in specs and k not in metadata})
        header, order = shard_header({n: shapes[n] for n in group}, metadata)
        files.append((file, header, order))
        weight_map.update({n: file for n in group})
    total = sum(sizes.values())
    index = None
    if len(names) > 1:
        index = (json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                            indent=2) + "\n").encode()
    return files, index, total


class TensorMapping(Protocol):
    """How an export renames a component's tensors (another framework's layout)."""

    def target(self, name: str, shape: tuple[int, ...]) -> tuple[str, Callable[[torch.Tensor], torch.Tensor] | None] | None:
        """The output name of the stored tensor ``name`` and a conversion of its values (``None``: its bytes as
        stored), or ``None`` to leave it out. A conversion keeps the shape and dtype."""


def _map(source: Source, mapping: TensorMapping) -> None:
    """Rename ``source``'s planned tensors in place; the conversions are kept on it for the writer."""
    specs: dict[str, Spec] = {}
    tied: dict[str, tuple[str, ...]] = {}
    for name, spec in source.specs.items():
        got = mapping.target(name, spec.shape)
        if got is None:
            continue
        new, convert = got
        if new in specs:
            raise InvalidArgument(f"the export mapping gives two tensors the name {new!r}")
        specs[new] = dataclasses.replace(spec, name=new)
        if convert is not None:
            source.conversions[new] = convert
        others = [got[0] for got in (mapping.target(o, spec.shape) for o in source.tied.get(name, ())) if got]
        if others:
            tied[new] = tuple(others)
    source.specs, source.tied = specs, tied


def _streamed(source: Source, header: bytes, order: list[str], target: torch.dtype | None
              ) -> Callable[[], Iterator[bytes | memoryview]]:
    """One weight file's bytes: its header, then each tensor's, read (and cast) a bounded chunk at a time (a
    tensor a mapping converts is read whole, converted, then written)."""
    def chunks() -> Iterator[bytes | memoryview]:
        yield header
        for name in order:
            spec = source.specs[name]
            convert = source.conversions.get(name)
            if convert is None:
                yield from source.stream(spec, output_dtype(spec.dtype, target))
                continue
            converted = convert(source.read(spec))
            if converted.shape != spec.shape or converted.dtype != spec.dtype:
                raise InvalidArgument(f"the export mapping changed {name!r} from {spec.dtype} {list(spec.shape)} to "
                                      f"{converted.dtype} {list(converted.shape)}; a conversion keeps both")
            yield tensorfile.byte_view(converted.to(output_dtype(spec.dtype, target)).contiguous())
    return chunks


def _counted(content: bundle.Content, on_bytes: OnBytes) -> bundle.Content:
    """The same content, telling ``on_bytes`` each batch as the writer takes it."""
    def chunks() -> Iterator[bytes | memoryview]:
        for chunk in ([content] if isinstance(content, bytes) else content()):
            yield chunk
            on_bytes(memoryview(chunk).nbytes)
    return chunks


def _counted_last(last: Callable[[list[bundle.FileDigest]], bytes], on_bytes: OnBytes | None
                  ) -> Callable[[list[bundle.FileDigest]], bytes]:
    if on_bytes is None:
        return last

    def counted(written: list[bundle.FileDigest]) -> bytes:
        data = last(written)
        on_bytes(len(data))
        return data
    return counted


# --- Hugging Face config ---------------------------------------------------------------------------------------

def hf_config(state: Mapping[str, Any], given: Any = None) -> dict[str, Any] | None:
    """The Hugging Face config to write as ``config.json``: ``given`` (a dict, a ``PretrainedConfig``, or a
    path to a ``config.json`` or a directory holding one), else the contract's ``config`` field when it is one
    (a dict with a ``model_type``), else ``None``."""
    if given is None:
        value = state["contract"]["fields"].get("config")
        return dict(value) if type(value) is dict and type(value.get("model_type")) is str else None
    if callable(getattr(given, "to_dict", None)):
        given = given.to_dict()
    elif isinstance(given, (str, Path)):
        path = Path(given) / CONFIG_FILE if Path(given).is_dir() else Path(given)
        try:
            given = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"hf_config={str(given)!r}: cannot read a JSON config from {path} ({exc})") from None
    if type(given) is not dict or type(given.get("model_type")) is not str:
        raise InvalidArgument("hf_config must be a Hugging Face model config: a dict, PretrainedConfig or "
                              "config.json with a 'model_type' (e.g. model.config, or 'path/to/config.json')")
    return given


def _config_bytes(config: Mapping[str, Any], target: torch.dtype | None) -> bytes:
    config = dict(config)
    if target is not None:  # what the weights now are, where the config says
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = str(target).removeprefix("torch.")
    return (json.dumps(config, indent=2, sort_keys=True, default=str) + "\n").encode()


# --- export ---------------------------------------------------------------------------------------------------

def export(generation_or_run: str | Path, out: str | Path, *, component: str = "model",
           dtype: str | torch.dtype | None = None, max_shard_size: int | str | None = None,
           include: Iterable[str | Path] = (), hf_config: Any = None,
           signing_key: SigningKey | bytes | str | None = None, storage_options: dict[str, Any] | None = None,
           ops: PosixOps | None = None, on_bytes: OnBytes | None = None,
           mapping: TensorMapping | Callable[[dict[str, Any]], TensorMapping] | None = None) -> ExportInfo:
    """Write ``component``'s parameters and buffers as safetensors into the new directory ``out``.

    ``generation_or_run``: a generation directory, or a run directory (its
    recovery point is exported), local or an object-store URL, saved by one
    process or by many ranks (read tensor by tensor: no process holds the
    model, no process group is needed; from a URL each object is downloaded
    once into a temporary local file in ``$TMPDIR``, which the verifying pass
    and the tensor reads share: ``storage_options`` as for
    :class:`CheckpointManager`). ``dtype`` (``"bf16"``, ``"fp16"``,
    ``"fp32"``) casts floating-point tensors only. ``max_shard_size``
    (``"5GB"``, bytes) splits larger exports into Hugging Face shards with an
    index. ``include``: files or directories copied into the bundle
    (tokenizer, ``generation_config.json``, a license). ``hf_config``: a
    Hugging Face config written as ``config.json`` (by default the contract's
    ``config`` field, when it is one). ``out`` also gets a ``README.md``
    model card of what the run recorded and a ``release-manifest.json``
    listing every file's size and SHA-256, signed when a key is configured
    (``trainstate verify OUT`` checks it). Raises :class:`GenerationExists`
    for a non-empty ``out``. ``on_bytes`` is told each batch of bytes written
    into the bundle (all files, the release manifest included).

    >>> info = ts.export("runs/exp1", "release/v1", dtype="bf16", max_shard_size="5GB", include=["tokenizer/"])
    >>> safetensors.torch.load_model(model, "release/v1/model.safetensors")  # ties restored
    """
    out = Path(os.path.abspath(out))  # "." and "a/.." name their directory; symlinks are not followed
    target = _dtype(dtype)
    max_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    bundle.check_out(out)  # before the read: a mistake costs nothing
    source = open_source(generation_or_run, component, signing_key, storage_options)
    try:
        key = signing.resolve(signing_key)
        if mapping is not None:
            _map(source, mapping if hasattr(mapping, "target") else mapping(source.state))
        return _export(source, out, target, max_bytes, include, hf_config, key, ops, on_bytes)
    finally:
        source.close()


def _export(source: Source, out: Path, target: torch.dtype | None, max_bytes: int | None,
            include: Iterable[str | Path], given_config: Any, key: SigningKey | None,
            ops: PosixOps | None, on_bytes: OnBytes | None = None) -> ExportInfo:
    manifest, state = source.manifest, source.state
    name = manifest.generation
    digest = f"{manifest.digest_algorithm}:{source.manifest_digest}"
    provenance = {"trainstate.generation": name, "trainstate.next_update": str(manifest.next_update),
                  "trainstate.created": manifest.created, "trainstate.manifest_digest": digest}
    weights, index, total = plan_files(source.specs, source.tied, target, max_bytes, provenance)
    files: dict[str, bundle.Content] = {file: _streamed(source, header, order, target)
                                        for file, header, order in weights}
    if index is not None:
        files[INDEX_FILE] = index
    config = hf_config(state, given_config)
    if config is not None:
        files[CONFIG_FILE] = _config_bytes(config, target)
    included = bundle.includes(include, [*files, CARD_FILE, MANIFEST, bundle.RELEASE_MANIFEST])
    digests = {rel: bundle.file_digest(path) for rel, path in included.items()}
    files.update({rel: bundle.copier(path) for rel, path in included.items()})
    dtype_name = str(target).removeprefix("torch.") if target is not None else None
    weight_files = tuple(file for file, _, _ in weights)
    facts = modelcard.CardFacts(
        generation=name, location=f"{source.location}/{name}", manifest_digest=source.manifest_digest,
        digest_algorithm=manifest.digest_algorithm, created=manifest.created, next_update=manifest.next_update,
        tokens_seen=state["clocks"]["tokens_seen"], contract_fingerprint=manifest.contract_fingerprint,
        versions=manifest.versions, metrics=manifest.metrics,
        data_manifest=state["contract"]["fields"].get("data_manifest"), component=source.component,
        dtype=dtype_name, files=weight_files, total_bytes=total, tied=source.tied,
        world_size=manifest.world_size, devices=tuple(manifest.compute.get("devices", ())),
        wall_s=manifest.compute.get("wall_s"),
        included=tuple((rel, *digests[rel]) for rel in included), hf_config=config is not None)
    files[CARD_FILE] = modelcard.render(facts).encode()
    about = {"generation": name, "manifest_digest": digest, "component": source.component, "dtype": dtype_name}

    def manifest_last(written: list[bundle.FileDigest]) -> bytes:
        changed = [f.name for f in written if f.name in digests and (f.size, f.digest) != digests[f.name]]
        if changed:
            raise CorruptGeneration(str(included[changed[0]]), "changed while it was being copied into the "
                                                               "bundle; nothing was published. Export again")
        return bundle.manifest_bytes(written, about, key)

    if on_bytes is not None:
        files = {rel: _counted(content, on_bytes) for rel, content in files.items()}
    bundle.publish(out, files, ops, last=_counted_last(manifest_last, on_bytes))
    return ExportInfo(str(out), name, weight_files, total, len(weight_files), dict(source.tied), dtype_name,
                      manifest.world_size, config is not None, tuple(included), key is not None)


# --- reading an export back (warm start) ----------------------------------------------------------------------

def is_export(directory: Path) -> bool:
    """A directory of exported weights (ours or any Hugging Face safetensors layout), not a generation."""
    return not (directory / MANIFEST).exists() and ((directory / SINGLE_FILE).is_file()
                                                    or (directory / INDEX_FILE).is_file())


def read_export(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
    """Every tensor of an export (shards merged, tied names re-pointed at their stored tensor), the files'
    metadata, and their total size. safetensors only: nothing is unpickled."""
    from safetensors import SafetensorError, safe_open

    index = directory / INDEX_FILE
    names, weight_map = [SINGLE_FILE], None
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptGeneration(str(index), f"is not a safetensors index ({exc})") from None
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in (".", "..")]
        if bad:
            raise CorruptGeneration(str(index), f"names files outside its directory: {bad[:5]}")
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    size = 0
    for name in names:
        path = directory / name
        try:
            with safe_open(str(path), "pt") as handle:
                metadata.update(handle.metadata() or {})
                tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
            size += path.stat().st_size
        except (SafetensorError, OSError) as exc:
            raise CorruptGeneration(str(path), f"unreadable as safetensors ({exc})") from None
    if weight_map is not None and set(weight_map) != set(tensors):
        raise CorruptGeneration(str(index), "its weight_map does not list exactly the shards' tensors")
    for alias, kept in metadata.items():  # ties recorded as save_model records them
        if alias not in tensors and kept in tensors:
            tensors[alias] = tensors[kept]
    return tensors, metadata, size
