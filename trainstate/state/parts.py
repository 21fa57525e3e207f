"""Which tensor files an incremental generation links from its parent, and which it writes: pure planning.

A generation's tensors live in one or more tensor files: ``tensors.safetensors``
for what changed since the parent, and ``part-<id>.safetensors`` files for
tensors that stay the same from one save to the next (a frozen base, frozen
embeddings, a new head's untouched neighbours). A part file of the parent is
*linked* (the same file, none of its bytes written again) when every tensor
in it has the same fingerprint now; any difference, in any tensor of the
part, and the part is not linked, whatever the cost.

The layout follows what changes: the tensors that did not change since the
parent but sit in a file that cannot be linked (the parent's
``tensors.safetensors``, or a part one of whose tensors changed) go to new
part files, so that the save after this one links them; everything else goes
to ``tensors.safetensors``, as does every tensor under ``SMALL_BYTES`` (RNG
states, counters, biases: rewriting them costs nothing, and one of them
starting to change would otherwise cost the rewrite of a large part). Parts
hold tensors in name order, up to
``PART_BYTES`` each (a larger tensor alone), so a tensor that starts changing
later costs a rewrite of its own part only. A generation that must be
self-contained links nothing, but lays its parts out the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import xxhash

from .changes import Fingerprint

TENSORS = "tensors.safetensors"
PART_BYTES = 1 << 30
SMALL_BYTES = 1 << 20


@dataclass(frozen=True)
class Layout:
    """A generation's tensor files: those linked from the parent, and those written now (file -> tensors)."""

    linked: tuple[str, ...]
    written: dict[str, tuple[str, ...]]


def _part_name(names: list[str], now: Mapping[str, Fingerprint], prefix: str) -> str:
    ident = xxhash.xxh3_64("\n".join(f"{n}\t{now[n].xxh3}" for n in names).encode()).hexdigest()
    return f"{prefix}{ident}.safetensors"


def plan(now: Mapping[str, Fingerprint], sizes: Mapping[str, int],
         parent: Mapping[str, Mapping[str, Fingerprint]] | None, *, link: bool,
         part_bytes: int | None = None, small_bytes: int | None = None, main: str = TENSORS,
         prefix: str = "part-", frozen: Collection[str] = ()) -> Layout:
    """The layout of a generation whose tensors have fingerprints ``now`` (and byte sizes ``sizes``).

    ``now`` may lack tensors a save did not fingerprint (see :func:`trainstate.lifecycle.incremental.take`):
    those go to ``main``. ``parent``: the parent's tensor files and their tensors' fingerprints (None when
    unknown: no parent, or one of an older format; then everything goes to ``tensors.safetensors``). ``link``: whether this
    generation may link the parent's files (False for a self-contained one). ``main`` and ``prefix``: the
    names of the file of what changes and of the parts (a multi-rank shard: ``shard-<rank>.safetensors`` and
    ``shard-<rank>-part-``). ``frozen``: the tensors of parameters that do not require gradients, laid out
    in parts when there is no ``parent`` to compare with (a guide only: each part is linked later only if
    every fingerprint in it is the same then).
    """
    part_bytes = PART_BYTES if part_bytes is None else part_bytes
    small_bytes = SMALL_BYTES if small_bytes is None else small_bytes
    if not parent:
        parent, link, before = {}, False, {n: now[n] for n in frozen if n in now and n in sizes}
    else:
        before = {n: fp for prints in parent.values() for n, fp in prints.items()}
    linked = tuple(sorted(
        file for file, prints in parent.items()
        if link and file != main and prints and all(now.get(n) == fp for n, fp in prints.items())))
    covered = {n for file in linked for n in parent[file]}
    steady = sorted(n for n in sizes if n not in covered and n in now and before.get(n) == now[n]
                    and sizes[n] >= small_bytes)
    parts: list[list[str]] = []
    size = 0
    for name in steady:
        if not parts or size + sizes[name] > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += sizes[name]
    written = {main: tuple(sorted(set(sizes) - covered - set(steady)))}
    for names in parts:
        file = _part_name(names, now, prefix)
        if file in written or file in linked:  # the same tensors with the same values: only if linked is False
            file = file.replace(".safetensors", f"-{len(written)}.safetensors")
        written[file] = tuple(names)
    return Layout(linked, written)


def flatten(files: Mapping[str, Mapping[str, Fingerprint]]) -> dict[str, Fingerprint]:
    """Every tensor's fingerprint, whichever file holds it."""
    return {n: fp for prints in files.values() for n, fp in prints.items()}
