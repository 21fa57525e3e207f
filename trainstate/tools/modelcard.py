"""The model card (``README.md``) written beside exported weights: what the run recorded, and nothing more.

Pure text from plain records: :func:`render` takes what the export read from a
verified generation and returns Markdown. Every field the run did not record
is written as ``not recorded`` rather than guessed, and the fields a release
needs that a training run cannot know (license, intended use, limitations,
evaluation protocol) are listed as such for the publisher to fill in. The
training compute is what the run measured (updates, tokens seen, world size,
the device kinds its tensors lived on when saved, and the wall time summed over
the updates of the generation's lineage, save stalls excluded: see
:mod:`trainstate.lifecycle.compute`); a generation saved before trainstate
recorded the last two (or whose lineage it could not time) says ``not
recorded`` for them. Files included in the bundle are listed with their SHA-256.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NOT_RECORDED = "not recorded"
RELEASE_FIELDS = ("License", "Intended use", "Limitations", "Evaluation protocol")


@dataclass(frozen=True)
class CardFacts:
    """What the run recorded about the exported generation (read from its manifest and ``state.json``)."""

    generation: str
    location: str
    manifest_digest: str
    digest_algorithm: str
    created: str
    next_update: int
    tokens_seen: int
    contract_fingerprint: str
    versions: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    data_manifest: Any = None  # the contract's ``data_manifest`` field; None when the run recorded none
    component: str = "model"
    dtype: str | None = None  # the cast applied on export; None: as trained
    files: tuple[str, ...] = ()
    total_bytes: int = 0
    tied: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    world_size: int = 1  # the ranks that wrote the generation
    included: tuple[tuple[str, int, str], ...] = ()  # files added to the bundle: name, size, SHA-256
    hf_config: bool = False  # a Hugging Face config.json was written beside the weights
    devices: tuple[str, ...] = ()  # device kinds of the saved tensors (rank 0's); () when not recorded
    wall_s: float | None = None  # seconds of training summed over the lineage's updates; None when not recorded


def _value(value: Any) -> str:
    if value is None or value == "" or value == {}:
        return NOT_RECORDED
    if isinstance(value, str):
        return f"`{value}`"
    return f"`{json.dumps(value, sort_keys=True)}`"


def _seconds(wall_s: float | None) -> str:
    if wall_s is None:
        return NOT_RECORDED
    return f"{wall_s:.3f} s ({wall_s / 3600:.2f} h; save stalls excluded)"


def render(facts: CardFacts) -> str:
    """The model card as Markdown."""
    lines = [
        f"# Weights exported from {facts.generation}",
        "",
        "Exported by `trainstate export` from a verified generation. Every value below was recorded by the "
        f"training run; a value the run did not record says \"{NOT_RECORDED}\".",
        "",
        "## Source",
        "",
        f"- Generation: `{facts.generation}` (`{facts.location}`)",
        f"- Manifest digest: `{facts.digest_algorithm}:{facts.manifest_digest}`",
        f"- Saved at: {facts.created or NOT_RECORDED}",
        f"- Update: {facts.next_update}",
        f"- Tokens seen: {facts.tokens_seen}",
        f"- Contract fingerprint: `{facts.contract_fingerprint}`",
        f"- Data manifest: {_value(facts.data_manifest)}",
        "",
        "## Versions at save time",
        "",
    ]
    if facts.versions:
        lines += [f"- {name}: `{facts.versions[name]}`" for name in sorted(facts.versions)]
    else:
        lines.append(f"- {NOT_RECORDED}")
    lines += ["", f"## Metrics recorded with the save (at update {facts.next_update})", ""]
    if facts.metrics:
        lines += [f"- {name}: {facts.metrics[name]!r}" for name in sorted(facts.metrics)]
    else:
        lines.append(f"- {NOT_RECORDED}")
    lines += ["", "## Weights", "",
              f"- Component: `{facts.component}` (parameters and buffers only: no optimizer, RNG, data position "
              "or clocks)",
              f"- Data type: {facts.dtype or 'as trained'} (integer and bool buffers keep their own)",
              f"- Files: {', '.join(f'`{f}`' for f in facts.files)}",
              f"- Tensor bytes: {facts.total_bytes}"]
    if facts.tied:
        ties = "; ".join(f"`{kept}` also as {', '.join(f'`{n}`' for n in names)}"
                         for kept, names in sorted(facts.tied.items()))
        lines.append(f"- Stored once and re-tied on load (`safetensors.torch.load_model`): {ties}")
    if facts.hf_config:
        lines.append("- `config.json`: the Hugging Face model config, so `AutoModel*.from_pretrained` loads the "
                     "directory")
    lines += ["", "## Training compute (as the run recorded it)", "",
              f"- Updates: {facts.next_update}",
              f"- Tokens seen: {facts.tokens_seen}",
              f"- World size: {facts.world_size}",
              f"- Device kind: {', '.join(facts.devices) or NOT_RECORDED}",
              f"- Wall time summed over updates: {_seconds(facts.wall_s)}"]
    lines += ["", "## Included files", ""]
    if facts.included:
        lines += [f"- `{name}`: {size} bytes, sha256 `{digest}`" for name, size, digest in facts.included]
    else:
        lines.append("- none")
    lines += ["", "Every file of this directory, this card included, is listed with its size and SHA-256 in "
              "`release-manifest.json`; `trainstate verify DIR` checks them.",
              "", "## Needed for a release, not known to the training run", ""]
    lines += [f"- {name}: {NOT_RECORDED}" for name in RELEASE_FIELDS]
    return "\n".join(lines) + "\n"
