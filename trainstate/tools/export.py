"""Export one component's weights from a verified generation as safetensors, for release.

The order of one export:

1. Resolve the source: a generation directory, or a run directory's recovery
   point (:func:`trainstate.restore.recovery_point`).
2. Read it through the trusted path: the manifest is verified (signature
   included, when a key is configured), ``state.json`` and every tensor file
   are digested against it, and only the named component is decoded. Nothing
   else of the generation (optimizer, RNG, data position, clocks) is written.
3. Plan the files (pure): tensors sharing storage are stored once under the
   name ``safetensors.torch.save_model`` would keep, the others recorded in
   the file's metadata, so ``safetensors.torch.load_model`` re-ties them;
   floating-point tensors are cast to ``dtype``; above ``max_shard_size`` the
   tensors are split into ``model-0000i-of-0000N.safetensors`` with a
   ``model.safetensors.index.json`` (the Hugging Face layout).
4. Publish: write every file and the model card into a staging directory
   beside ``out``, fsync each file and the directory, rename it to ``out``,
   fsync the parent. A non-empty ``out`` is never overwritten.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from ..errors import CorruptGeneration, GenerationExists, InvalidArgument, NoValidGeneration, StateMismatch
from ..format import signing
from ..format.manifest import MANIFEST, STATE, parse_generation_name
from ..format.signing import SigningKey
from ..restore import recovery_point
from ..storage.local import LocalStore
from ..storage.posix import PosixOps, _write_all
from ..storage.verify import Verified, check_state_schema, decode_verified, read_json_file, verify_generation
from . import modelcard

log = logging.getLogger("trainstate")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CARD_FILE = "README.md"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
Content = bytes | Callable[[], bytes]  # a file's bytes, or how to make them when it is written
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class ExportInfo:
    """What an export wrote.

    ``files``: the weight files, in order (one, or the shards); ``total_bytes``:
    the bytes of tensor data stored (the index's ``total_size``); ``shards``:
    how many weight files; ``tied``: each stored name and the names re-tied to
    it on load; ``dtype``: the cast applied to floating-point tensors (``None``:
    as trained).
    """

    directory: str
    generation: str
    files: tuple[str, ...]
    total_bytes: int
    shards: int
    tied: Mapping[str, tuple[str, ...]]
    dtype: str | None


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

def dedupe(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]]]:
    """Tensors sharing storage, stored once: the kept name is the one ``safetensors.torch.save_model`` keeps
    (the first in sorted order among those covering the whole storage), so ``load_model`` re-ties the rest."""
    groups: dict[Any, list[str]] = defaultdict(list)
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage()
        shared = tensor.device.type != "meta" and storage.nbytes() > 0
        groups[(tensor.device, storage.data_ptr()) if shared else ("own", name)].append(name)
    kept, tied = {}, {}
    for names in groups.values():
        if len(names) == 1:
            kept[names[0]] = tensors[names[0]]
            continue
        complete = sorted(n for n in names if _covers_storage(tensors[n]))
        if not complete:
            raise InvalidArgument(f"tensors {sorted(names)} share storage and none covers all of it; safetensors "
                                  "cannot store them once. Export from a model whose shared tensors are whole "
                                  "tensors (tied weights), or clone the views before saving")
        tied[complete[0]] = tuple(sorted(n for n in names if n != complete[0]))
        kept[complete[0]] = tensors[complete[0]]
    return {name: kept[name] for name in tensors if name in kept}, tied


def _covers_storage(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return tensor.data_ptr() == storage.data_ptr() and tensor.nelement() * tensor.element_size() == storage.nbytes()


def cast(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating-point tensors in ``dtype``; integer, bool and complex tensors keep theirs. All contiguous."""
    return {name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
            for name, t in tensors.items()}


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


def build_files(tensors: Mapping[str, torch.Tensor], tied: Mapping[str, tuple[str, ...]],
                max_bytes: int | None, provenance: Mapping[str, str] | None = None
                ) -> tuple[dict[str, Content], list[str], int]:
    """The weight files by name (the index included when sharded), their order, the tensor bytes.

    A shard's bytes are produced only when :func:`publish` writes it, so one
    shard at a time is held serialised beside the tensors."""
    sizes = {name: t.nelement() * t.element_size() for name, t in tensors.items()}
    groups = plan_shards(sizes, max_bytes)
    names = shard_names(len(groups))
    files: dict[str, bytes] = {}
    weight_map = {}
    for file, group in zip(names, groups):
        metadata = {"format": "pt"}
        for kept in group:
            metadata.update({other: kept for other in tied.get(kept, ())})  # as save_model records them
        metadata.update({k: v for k, v in (provenance or {}).items() if k not in tensors and k not in metadata})
        files[file] = partial(safetensors_bytes, {n: tensors[n] for n in group}, metadata=metadata)
        weight_map.update({n: file for n in group})
    total = sum(sizes.values())
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        files[INDEX_FILE] = (json.dumps(index, indent=2) + "\n").encode()
    return files, names, total


# --- reading ---------------------------------------------------------------------------------------------------

def _locate(source: str | Path, key_arg: SigningKey | bytes | str | None
            ) -> tuple[LocalStore, str, SigningKey | None]:
    path = Path(source)
    if parse_generation_name(path.name) and (path / MANIFEST).exists():
        store = LocalStore(path.parent, create=False)
        return store, path.name, signing.resolve(key_arg, store.location)
    store = LocalStore(path, create=False)
    key = signing.resolve(key_arg, store.location)
    name = recovery_point(store, key)
    if name is None:
        raise NoValidGeneration(str(path), [])
    return store, name, key


def _read(store: LocalStore, name: str, component: str, key: SigningKey | None
          ) -> tuple[Verified, dict[str, Any], dict[str, torch.Tensor]]:
    """The verified manifest, ``state.json`` (digest checked) and the component's decoded tensors."""
    verified = verify_generation(store, name, content=False, key=key)
    manifest = verified.manifest
    if manifest.ranks:
        raise StateMismatch(f"{name} was written by several ranks and its weights are sharded across them; "
                            "export reads single-process generations only: restore it under torchrun, gather "
                            "the full state dict into an unsharded model, save that with a single-process "
                            "CheckpointManager and export its generation")
    state = read_json_file(store, manifest, STATE)
    check_state_schema(state, f"{name}/{STATE}", manifest.kind, manifest.next_update)
    if component not in state["components"]:
        raise InvalidArgument(f"{name} has no component {component!r}; it has "
                              f"{', '.join(sorted(state['components'])) or 'none'}: pass component=... (--component)")
    decoded = decode_verified(store, manifest, component)
    saved = decoded["state"]
    if not isinstance(saved, Mapping):
        raise StateMismatch(f"component {component!r} in {name} is not a module's state dict")
    others = sorted(k for k, v in saved.items() if not isinstance(v, torch.Tensor))
    if others:
        raise StateMismatch(f"component {component!r} in {name} holds entries that are not tensors "
                            f"({', '.join(map(str, others[:10]))}); safetensors stores tensors only. Export a "
                            "module's parameters and buffers")
    return verified, state, dict(saved)


# --- publishing -----------------------------------------------------------------------------------------------

def _check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise GenerationExists(f"{out} exists and is not a directory; nothing was written. Choose a new path "
                               "for the export")
    if out.is_dir() and any(out.iterdir()):
        raise GenerationExists(f"{out} is not empty and an export never overwrites; nothing was written. Choose "
                               "a new path, or remove the old export first")
    if not out.parent.is_dir():
        raise InvalidArgument(f"the parent of {out} does not exist; create it first")


def publish(out: Path, files: Mapping[str, Content], ops: PosixOps | None = None) -> None:
    """Write ``files`` into a staging directory beside ``out``, fsync them and it, rename it to ``out``,
    fsync the parent. ``out`` must be absent or an empty directory; a crash leaves at most a
    ``.NAME.trainstate-staging-*`` directory beside it, never a partial ``out``."""
    ops = ops or PosixOps()
    _check_out(out)
    staging = out.parent / f".{out.name}.trainstate-staging-{secrets.token_hex(4)}"
    ops.mkdir(staging)
    try:
        for name, content in files.items():
            data = content() if callable(content) else content
            fd = ops.create(staging / name)
            try:
                _write_all(ops, fd, memoryview(data))
                ops.fsync(fd)
            finally:
                ops.close(fd)
            del data
        ops.fsync_dir(staging)
        try:
            ops.rename(staging, out)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise GenerationExists(f"{out} appeared while exporting and is not empty; nothing was "
                                       "published. Choose a new path") from None
            raise
    except BaseException:
        try:
            ops.rmtree(staging)
        except OSError as cleanup:  # the original error matters more; the leftover is named
            log.warning("export: could not remove the staging directory %s: %s", staging, cleanup)
        raise
    ops.fsync_dir(out.parent)


def export(generation_or_run: str | Path, out: str | Path, *, component: str = "model",
           dtype: str | torch.dtype | None = None, max_shard_size: int | str | None = None,
           signing_key: SigningKey | bytes | str | None = None, ops: PosixOps | None = None) -> ExportInfo:
    """Write ``component``'s parameters and buffers as safetensors into the new directory ``out``.

    ``generation_or_run``: a generation directory, or a run directory (its
    recovery point is exported). ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``)
    casts floating-point tensors only. ``max_shard_size`` (``"5GB"``, bytes)
    splits larger exports into Hugging Face shards with an index. ``out`` also
    gets a ``README.md`` model card of what the run recorded. Raises
    :class:`GenerationExists` for a non-empty ``out``.

    >>> info = ts.export("runs/exp1", "release/v1", dtype="bf16", max_shard_size="5GB")
    >>> safetensors.torch.load_model(model, "release/v1/model.safetensors")  # ties restored
    """
    out = Path(os.path.abspath(out))  # "." and "a/.." name their directory; symlinks are not followed
    target = _dtype(dtype)
    max_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    _check_out(out)  # before the read: a mistake costs nothing
    store, name, key = _locate(generation_or_run, signing_key)
    verified, state, saved = _read(store, name, component, key)
    manifest = verified.manifest
    kept, tied = dedupe(saved)
    tensors = cast(kept, target)
    provenance = {"trainstate.generation": name, "trainstate.next_update": str(manifest.next_update),
                  "trainstate.created": manifest.created,
                  "trainstate.manifest_digest": f"{manifest.digest_algorithm}:{verified.manifest_digest}"}
    files, weight_files, total = build_files(tensors, tied, max_bytes, provenance)
    dtype_name = str(target).removeprefix("torch.") if target is not None else None
    facts = modelcard.CardFacts(
        generation=name, location=f"{store.location}/{name}", manifest_digest=verified.manifest_digest,
        digest_algorithm=manifest.digest_algorithm, created=manifest.created, next_update=manifest.next_update,
        tokens_seen=state["clocks"]["tokens_seen"], contract_fingerprint=manifest.contract_fingerprint,
        versions=manifest.versions, metrics=manifest.metrics,
        data_manifest=state["contract"]["fields"].get("data_manifest"), component=component, dtype=dtype_name,
        files=tuple(weight_files), total_bytes=total, tied=tied)
    files[CARD_FILE] = modelcard.render(facts).encode()
    publish(out, files, ops)
    return ExportInfo(str(out), name, tuple(weight_files), total, len(weight_files), tied, dtype_name)



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
