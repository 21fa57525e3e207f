"""Every public name has a docstring, and the API reference shows every one of them.

Public: each name in ``trainstate.__all__``, and each public method and property its classes define
themselves. A constant's docstring is the string literal right after its assignment (what the reference
renders); the reference page is docs/reference/api.md, one ``::: trainstate.NAME`` per name.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import types

from docsite import page

import trainstate


def attribute_docstring(module: types.ModuleType, name: str) -> str | None:
    """The string literal that follows ``name = ...`` at the top of ``module``'s source."""
    body = ast.parse(inspect.getsource(module)).body
    for node, after in zip(body, body[1:]):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(
                    after.value.value, str):
                return after.value.value
    return None


def home_of(package: types.ModuleType, name: str) -> types.ModuleType:
    """The module that assigns a constant ``name`` exported by ``package``."""
    source = inspect.getsource(package)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            base = package.__name__ if node.level else ""
            return sys.modules[f"{base}.{node.module}" if base else node.module]
    return package


def undocumented(package: types.ModuleType) -> list[str]:
    missing = []
    for name in package.__all__:
        obj = getattr(package, name)
        if isinstance(obj, (int, float, str)):
            if not attribute_docstring(home_of(package, name), name):
                missing.append(name)
            continue
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not (own or "").strip():
            missing.append(name)
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        for member, value in vars(obj).items():
            if member.startswith("_"):
                continue
            if isinstance(value, property):
                doc = value.__doc__
            elif isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
                doc = getattr(value, "__func__", value).__doc__
            else:
                continue
            if not (doc or "").strip():
                missing.append(f"{name}.{member}")
    return missing


def unreferenced(names: list[str], reference: str) -> list[str]:
    """Names without their ``::: trainstate.NAME`` on the reference page, and entries for names not exported."""
    shown = re.findall(r"^::: trainstate\.(\S+)$", reference, re.M)
    return ([f"{n} is not in the reference" for n in names if n not in shown]
            + [f"the reference shows {n}, which trainstate.__all__ does not export" for n in shown if n not in names]
            + [f"the reference shows {n} twice" for n in sorted({n for n in shown if shown.count(n) > 1})])


def test_every_public_name_and_method_has_a_docstring():
    assert undocumented(trainstate) == []


def test_every_public_name_is_in_the_reference_once():
    assert unreferenced(list(trainstate.__all__), page("reference/api.md")) == []


FIXTURE = '''
"""A package."""

LIMIT = 3
"""How many."""

UNDOCUMENTED_LIMIT = 4


def documented():
    """Does it."""


def bare():
    return 1


class Thing:
    """A thing."""

    size = property(lambda self: 1, doc="Its size.")
    width = property(lambda self: 2)

    def run(self):
        """Runs."""

    def stop(self):
        pass


class Plain:
    pass


__all__ = ["LIMIT", "Plain", "Thing", "UNDOCUMENTED_LIMIT", "bare", "documented"]
'''


def test_an_undocumented_name_or_member_is_caught(tmp_path, monkeypatch):
    (tmp_path / "fixturepkg.py").write_text(FIXTURE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fixturepkg

    try:
        assert undocumented(fixturepkg) == ["Plain", "Thing.width", "Thing.stop", "UNDOCUMENTED_LIMIT", "bare"]
    finally:
        sys.modules.pop("fixturepkg", None)


def test_a_name_missing_from_the_reference_is_caught():
    reference = "# API\n\n::: trainstate.TrainState\n\n::: trainstate.Gone\n\n::: trainstate.TrainState\n"
    assert unreferenced(["CheckpointManager", "TrainState"], reference) == [
        "CheckpointManager is not in the reference",
        "the reference shows Gone, which trainstate.__all__ does not export",
        "the reference shows TrainState twice"]
