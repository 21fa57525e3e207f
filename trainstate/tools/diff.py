"""``ts.diff(a, b)``: two generations compared in causal order, and the first category that differs.

The order is the order in which a difference *causes* others: a changed
contract explains different parameters; different parameters explain
different optimizer moments; and so on down to the data position. The
verdict (``DiffReport.first``) is the earliest category with a difference,
but every category is reported.

    report = ts.diff("runs/a@12", "runs/b@12")
    if not report.identical:
        print(report.first, report.category(report.first).summary)

Components are put in categories by what the skeleton records for them: an
optimizer's state has ``state`` and ``param_groups``; a scheduler's type is a
``torch.optim.lr_scheduler`` class; a grad scaler's is a ``GradScaler``; a data
loader is a component with a recorded data position; other ``torch.nn``
components are model state; anything else counts with the clocks and counters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..progress import OnBytes
from . import diffranks
from .diffread import CHUNK_BYTES, Side, TensorDiff, TensorReader, load_side

CATEGORIES = ("contract", "model", "optimizer", "scheduler", "clocks", "rng", "data")
_TITLES = {"contract": "contract and history", "model": "model parameters and buffers",
           "optimizer": "optimizer state", "scheduler": "scheduler and grad-scaler state",
           "clocks": "clocks and counters", "rng": "RNG streams", "data": "data position"}


@dataclass(frozen=True)
class Entry:
    """One difference: the key path (a tensor's stored name where it is one) and what differs."""

    path: str
    message: str
    tensor: TensorDiff | None = None


@dataclass(frozen=True)
class Category:
    """One category's verdict: a one-line summary and every difference found in it."""

    name: str
    summary: str
    entries: list[Entry] = field(default_factory=list)
    tensors: int = 0  # tensors compared in this category

    @property
    def identical(self) -> bool:
        return not self.entries


@dataclass(frozen=True)
class DiffReport:
    """The comparison of generation ``a`` with ``b``; ``first`` is the earliest category (causal order) that
    differs, ``None`` when the two are identical."""

    a: str
    b: str
    identical: bool
    first: str | None
    categories: list[Category]

    def category(self, name: str) -> Category:
        """The category called ``name`` (``"optimizer"``, ``"rng"``, ...); ``StopIteration`` if none."""
        return next(c for c in self.categories if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (a NaN difference becomes the string ``"nan"``)."""
        return _finite(asdict(self))


def _finite(node: Any) -> Any:
    if type(node) is dict:
        return {k: _finite(v) for k, v in node.items()}
    if type(node) is list:
        return [_finite(v) for v in node]
    if type(node) is float and node != node:
        return "nan"
    return node


class _Ref:
    """A tensor reference in a skeleton (``{"$t": name}`` or ``{"$nd": name}``)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def _plain(node: Any, file: str = "") -> Any:
    """A skeleton with the codec's containers opened up, tensor references as :class:`_Ref`, other tags kept
    as leaves (compared by their exact JSON text). ``file``: the tensor file a rank record's references point
    into (its entries are registered as ``<file>/<name>``)."""
    if type(node) is list:
        return [_plain(v, file) for v in node]
    if type(node) is dict:
        if len(node) == 1:
            (tag, value), = node.items()
            if tag in ("$t", "$nd") and type(value) is str:
                return _Ref(f"{file}/{value}" if file else value)
            if tag == "$odict" and type(value) is dict:
                return {k: _plain(v, file) for k, v in value.items()}
            if tag == "$map" and type(value) is list:
                return {(p[0] if type(p[0]) is str else json.dumps(p[0])): _plain(p[1], file) for p in value
                        if type(p) is list and len(p) == 2}
            if tag == "$tuple" and type(value) is list:
                return [_plain(v, file) for v in value]
        return {k: _plain(v, file) for k, v in node.items()}
    return node


_MISSING = object()


def _join(path: str, key: Any) -> str:
    return f"{path}[{key}]" if type(key) is int or (type(key) is str and key.lstrip("-").isdigit()) else \
        f"{path}.{key}" if path else str(key)


def _short(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    if isinstance(value, _Ref):
        return f"tensor {value.name}"
    text = json.dumps(value, default=lambda v: f"tensor {v.name}" if isinstance(v, _Ref) else repr(v))
    return text if len(text) <= 80 else text[:77] + "..."


class _Walker:
    """Walks two skeleton trees side by side, collecting differences and comparing tensors as it meets them."""

    def __init__(self, reader: TensorReader):
        self.reader = reader
        self.entries: list[Entry] = []
        self.tensors = 0

    def walk(self, a: Any, b: Any, path: str) -> None:
        if isinstance(a, _Ref) and isinstance(b, _Ref):
            self._tensor(a, b, path)
        elif type(a) is dict and type(b) is dict and not (_tagged(a) or _tagged(b)):
            for key in list(a) + [k for k in b if k not in a]:
                self.walk(a.get(key, _MISSING), b.get(key, _MISSING), _join(path, key))
        elif type(a) is list and type(b) is list and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                self.walk(x, y, _join(path, i))
        elif isinstance(a, _Ref) or isinstance(b, _Ref) or not _same(a, b):
            self.entries.append(Entry(path, f"{_short(a)} vs {_short(b)}"))

    def _tensor(self, a: _Ref, b: _Ref, path: str) -> None:
        self.tensors += 1
        got = self.reader.compare(a.name, b.name)
        name = a.name if a.name == b.name else f"{path} ({a.name} vs {b.name})"
        if got.mismatch:
            self.entries.append(Entry(name, f"dtype/shape differ: {got.mismatch}", got))
        elif got.differing:
            numbers = "" if got.max_abs is None else f", max abs diff {got.max_abs:.6g}, max rel {got.max_rel:.6g}"
            self.entries.append(Entry(name, f"{got.differing} of {got.elements} elements differ (first at flat "
                                            f"index {got.first_index}){numbers}", got))


def _tagged(node: dict) -> bool:
    """A codec tag the walk does not open (``$int``, ``$float``, ...): compared whole, by its exact text."""
    return len(node) == 1 and next(iter(node)).startswith("$")


def _same(a: Any, b: Any) -> bool:
    """Exact equality for JSON values: ``0.0`` and ``-0.0`` differ, ``1`` and ``1.0`` differ, NaN equals NaN."""
    if a is _MISSING or b is _MISSING:
        return a is b
    return type(a) is type(b) and _text(a) == _text(b)


def _text(value: Any) -> str:
    return json.dumps(value, default=lambda v: f"tensor {v.name}" if isinstance(v, _Ref) else repr(v))


def classify(name: str, record: Any, data_names: set[str]) -> str:
    """The category of a component, from what its skeleton records (see the module docstring)."""
    kind = record.get("type", "") if type(record) is dict else ""
    state = record.get("state") if type(record) is dict else None
    if name in data_names or kind.endswith("ResumableLoader"):
        return "data"
    if type(state) is dict and "param_groups" in state and "state" in state:
        return "optimizer"
    if kind.startswith("torch.optim.lr_scheduler.") or "GradScaler" in kind:
        return "scheduler"
    if kind.startswith("torch.nn.") or kind.startswith("torch.distributed."):
        return "model"
    if type(state) is dict and "$odict" in state:  # a module's state_dict is an OrderedDict of tensors
        return "model"
    return "clocks"


def _trees(side: Side) -> dict[str, dict[str, Any]]:
    """Per category, the named subtrees of one generation to compare."""
    s, m = side.state, side.manifest
    out: dict[str, dict[str, Any]] = {c: {} for c in CATEGORIES}
    out["contract"] = {"contract_fingerprint": m.contract_fingerprint, "contract": s.get("contract"),
                       "history": s.get("history"), "kind": m.kind}
    components = s.get("components") or {}
    for name, record in components.items():
        out[classify(name, record, set(m.data))][name] = record.get("state") if type(record) is dict else record
    out["clocks"].update(clocks=s.get("clocks"), counters=s.get("counters"), facts=s.get("facts"),
                         next_update=m.next_update)
    rng = s.get("rng") or {}
    out["rng"].update({f"named.{k}": v for k, v in (rng.get("named") or {}).items()})
    out["rng"].update({k: v for k, v in rng.items() if k != "named"})
    out["data"].update({f"position.{k}": v for k, v in m.data.items()})
    trees = {c: {k: _plain(v) for k, v in t.items()} for c, t in out.items()}
    if m.ranks:
        _rank_trees(side, trees)
    return trees


def _rank_trees(side: Side, trees: dict[str, dict[str, Any]]) -> None:
    """Each rank's own record (RNG streams, rank-local components and clocks) as ``rank<r>.<name>`` entries."""
    for rank, raw in sorted(diffranks.rank_records(side).items()):
        file, tag = f"rank-{rank:05d}.safetensors", f"rank{rank}"
        rng = raw.get("rng") or {}
        trees["rng"].update({f"{tag}.named.{k}": _plain(v, file) for k, v in (rng.get("named") or {}).items()})
        trees["rng"].update({f"{tag}.{k}": _plain(v, file) for k, v in rng.items() if k != "named"})
        for name, record in (raw.get("components") or {}).items():
            state = record.get("state") if type(record) is dict else record
            trees[classify(name, record, set(side.manifest.data))][f"{tag}.{name}"] = _plain(state, file)
        for key in ("counters", "facts", "tokens_seen"):
            if key in raw:
                trees["clocks"][f"{tag}.{key}"] = _plain(raw[key], file)


def _walk_sharded(walker: _Walker, category: str, a: Side, b: Side, items: tuple[dict, dict]) -> None:
    """The DCP items of the sharded components in ``category`` (modules: model; optimizers: optimizer)."""
    wanted = {"module": "model", "optimizer": "optimizer"}
    kinds = {**diffranks.component_kinds(b), **diffranks.component_kinds(a)}
    names = list(items[0]) + [n for n in items[1] if n not in items[0]]
    for fqn in names:
        if wanted.get(kinds.get(fqn.split(".", 1)[0], "")) != category:
            continue
        item_a, item_b = items[0].get(fqn), items[1].get(fqn)
        if (item_a or item_b).dtype is not None:
            walker.tensors += 1
        message, got = diffranks.compare_item(walker.reader, fqn, item_a, item_b)
        if message:
            walker.entries.append(Entry(fqn, message, got if got is not None and got.differing else None))


def _walk_streams(walker: _Walker, a: dict[str, Any], b: dict[str, Any]) -> None:
    """RNG states are long integer tables: one entry per stream (named), plus any tensor that differs."""
    for key in list(a) + [k for k in b if k not in a]:
        before = len(walker.entries)
        walker.walk(a.get(key, _MISSING), b.get(key, _MISSING), f"rng.{key}")
        found = walker.entries[before:]
        values = [e for e in found if e.tensor is None]
        if values:
            del walker.entries[before:]
            plural = "s" if len(values) != 1 else ""
            walker.entries.append(Entry(f"rng.{key}", f"stream state differs in {len(values)} value{plural} "
                                                     f"(first: {values[0].path}: {values[0].message})"))
            walker.entries.extend(e for e in found if e.tensor is not None)


def _summary(name: str, walker: _Walker) -> str:
    title = _TITLES[name]
    if not walker.entries:
        suffix = f" ({walker.tensors} tensors bitwise equal)" if walker.tensors else ""
        return f"{title}: identical{suffix}"
    tensors = [e for e in walker.entries if e.tensor is not None]
    others = len(walker.entries) - len(tensors)
    parts = []
    if tensors:
        head = tensors[0]
        parts.append(f"{len(tensors)} of {walker.tensors} tensors differ (first: {head.path}: {head.message})")
    if others:
        first = next(e for e in walker.entries if e.tensor is None)
        parts.append(f"{others} other value{'s' if others != 1 else ''} differ (first: {first.path}: {first.message})")
    return f"{title}: DIFFERENT: " + "; ".join(parts)


def diff(a: str | Path, b: str | Path, *, chunk_bytes: int = CHUNK_BYTES, on_bytes: OnBytes | None = None
         ) -> DiffReport:
    """Compare two generations (a generation directory, ``RUN@UPDATE``, or a run for its recovery point).

    Both are fully verified first (every digest, as ``trainstate verify``);
    tensors are then compared bitwise, ``chunk_bytes`` at a time per side, so memory stays bounded.
    ``on_bytes`` is told each batch of bytes read: verified on either side, then compared (both sides').
    """
    side_a, side_b = load_side(a, on_bytes), load_side(b, on_bytes)
    sharded = ({}, {})
    for i, side in enumerate((side_a, side_b)):
        if side.manifest.ranks:  # multi-rank: rank files and shards too (see trainstate.tools.diffranks)
            diffranks.register(side)
            sharded[i].update(diffranks.items(side))
    trees_a, trees_b = _trees(side_a), _trees(side_b)
    categories = []
    with TensorReader(side_a, side_b, chunk_bytes, on_bytes) as reader:
        for name in CATEGORIES:
            walker = _Walker(reader)
            if name == "rng":
                _walk_streams(walker, trees_a[name], trees_b[name])
            else:
                walker.walk(trees_a[name], trees_b[name], "")
            _walk_sharded(walker, name, side_a, side_b, sharded)
            categories.append(Category(name, _summary(name, walker), walker.entries, walker.tensors))
    first = next((c.name for c in categories if c.entries), None)
    return DiffReport(str(a), str(b), first is None, first, categories)


def render(report: DiffReport) -> str:
    """The human-readable form: the verdict, one line per category, then each difference."""
    lines = [f"a: {report.a}", f"b: {report.b}",
             "identical" if report.identical else f"first difference: {report.first}"]
    for c in report.categories:
        lines.append(f"  {c.summary}")
        for e in c.entries[:50]:
            lines.append(f"    {e.path}: {e.message}")
        if len(c.entries) > 50:
            lines.append(f"    ... and {len(c.entries) - 50} more")
    return "\n".join(lines)
