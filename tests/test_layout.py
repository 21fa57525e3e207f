"""The house's shape: layers as folders, small modules, no import cycle, a stable public surface."""

from __future__ import annotations

import ast
from pathlib import Path

import trainstate

PACKAGE = Path(trainstate.__file__).parent
LAYERS = ("state", "format", "storage", "data", "lifecycle", "cli", "drill", "tools", "integrations")

# Every public name before the layout change (issue 10); the surface may grow, never silently shrink.
PUBLIC_BEFORE = {
    "AsyncSaveFailed", "Cadence", "CheckpointManager", "ContinuationWarning", "ContractMismatch",
    "CorruptGeneration", "DataMismatch", "DirectoryLocked", "EXIT_PREEMPTED", "FieldChange", "GenerationExists",
    "GenerationInfo", "InsufficientSpace", "NoValidGeneration", "PendingGradients", "PreemptionHandler",
    "Rehearsal", "Rejection", "RestoreInfo", "ResumableLoader", "Retention", "SampleIndex", "SaveHandle",
    "SigningKey", "StateMismatch", "Status", "TopologyMismatch", "TrainState", "TrainStateError",
    "UnsupportedValue", "WeightsOnlyGeneration", "__version__", "data_manifest", "evaluating", "fingerprint",
    "sample_generator", "warm_start",
}


def modules() -> dict[str, Path]:
    """Dotted module name (``trainstate.storage.local``; a package is its ``__init__``) -> file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its body (lazy imports included)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import sub` needs the submodule (its package is already being imported when pkg is an
            # ancestor); `from mod import name` needs mod itself
            subs = [f"{origin}.{alias.name}" for alias in node.names]
            ancestor = name.startswith(origin + ".")
            targets = subs if ancestor and all(s in known for s in subs) else [origin, *subs]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_package():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_cycle_check_catches_a_cycle():
    # negative control: the checker sees a two-module cycle and a lazy import inside a function
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    found = cycles({**graph(), "trainstate.errors": {"trainstate.manager"}})
    assert any("trainstate.errors" in c and "trainstate.manager" in c for c in found)


def test_lazy_and_package_imports_are_seen():
    edges = graph()
    assert "trainstate.cli.demo" in edges["trainstate.cli.main"]  # imported inside a function
    assert "trainstate.format.signing" in edges["trainstate.manager"]  # `from .format import signing`


def test_layers_are_packages_and_the_top_stays_small():
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file(), f"{layer}/ is not a package"
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 10, f"{len(top)} modules at the top of trainstate/: {top}"


def test_no_module_over_500_lines_and_a_small_manager():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    too_long = {name: n for name, n in sizes.items() if n > 500}
    assert not too_long, f"modules over 500 lines: {too_long}"
    # the face only: 360 lines before multi-rank and object-store options; their logic lives in their layers
    assert sizes["trainstate.manager"] <= 450, f"manager.py has {sizes['trainstate.manager']} lines"


def test_public_surface_is_sorted_and_keeps_every_earlier_name():
    names = list(trainstate.__all__)
    assert names == sorted(names), "trainstate.__all__ is not sorted"
    assert len(set(names)) == len(names), "trainstate.__all__ lists a name twice"
    missing = PUBLIC_BEFORE - set(names)
    assert not missing, f"public names dropped from trainstate.__all__: {sorted(missing)}"
    for name in names:
        assert hasattr(trainstate, name), f"trainstate.__all__ names {name!r}, which trainstate does not define"
