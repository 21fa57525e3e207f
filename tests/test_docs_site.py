"""The site holds together without building it: every runnable block has a test that runs it, every Python
block parses, every relative link lands on a page, every page is in the navigation, and the included
repository files (RELIABILITY.md, benchmarks/README.md) are shown through their links rewritten.

``mkdocs build --strict`` (in ``.ci/run``, with the ``docs`` extra) checks links, anchors, navigation and the API
reference again with the real renderer; these run with the test extra alone, in well under a second.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from docsite import DOCS, ROOT, hooks, pages

TESTS = Path(__file__).resolve().parent


def asked_for(sources: dict[str, str]) -> dict[str, list[str]]:
    """Block ids passed as a literal to ``runnable(...)`` in each test module's source."""
    out: dict[str, list[str]] = {}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source, name)):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "runnable"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                out.setdefault(node.args[0].value, []).append(name)
    return out


def unrun(site: dict[str, str], sources: dict[str, str]) -> list[str]:
    """Marked blocks no test asks for, and ids a test asks for that no block carries."""
    marked, asked = hooks.runnable_blocks(site), asked_for(sources)
    return ([f"{marked[i][0]}: <!-- runnable: {i} --> is run by no test" for i in sorted(set(marked) - set(asked))]
            + [f"{', '.join(asked[i])} asks for runnable {i!r}, which no page marks"
               for i in sorted(set(asked) - set(marked))])


def test_every_runnable_block_is_run_by_a_test():
    sources = {p.name: p.read_text() for p in TESTS.glob("test_*.py")}
    assert unrun(pages(), sources) == []
    assert len(hooks.runnable_blocks(pages())) >= 9


def test_a_runnable_block_without_its_test_is_caught():
    site = {"guide.md": "<!-- runnable: tested -->\n```python\nx = 1\n```\n\n"
                        "<!-- runnable: forgotten -->\n```python\ny = 2\n```\n"}
    sources = {"test_guide.py": 'from docsite import runnable\n\ndef test_it():\n    exec(runnable("tested"), {})\n'}
    assert unrun(site, sources) == ["guide.md: <!-- runnable: forgotten --> is run by no test"]
    sources["test_other.py"] = 'runnable("renamed")\n'
    assert unrun(site, sources)[-1] == "test_other.py asks for runnable 'renamed', which no page marks"


def test_a_broken_runnable_block_fails_the_test_that_runs_it():
    # the same path a guide's test takes: the marked block's code, executed; a renamed function makes it raise
    site = {"guide.md": "<!-- runnable: loop -->\n```python\nimport trainstate as ts\nts.CheckpointManagr\n```\n"}
    code = hooks.runnable_blocks(site)["loop"][2]
    with pytest.raises(AttributeError, match="CheckpointManagr"):
        exec(code, {})


@pytest.mark.parametrize("bad", ["<!-- runnable: loop -->\n\n```python\nx = 1\n```\n",  # not right above its block
                                 "<!-- runnable: Loop One -->\n```python\nx = 1\n```\n",  # not an id
                                 "<!-- runnable: a -->\n```python\n1\n```\n<!-- runnable: a -->\n```sh\nls\n```\n"])
def test_a_malformed_or_duplicate_marker_is_refused(bad):
    with pytest.raises(ValueError):
        hooks.runnable_blocks({"guide.md": bad})


def python_errors(site: dict[str, str]) -> list[str]:
    errors = []
    for name, text in sorted(site.items()):
        for block in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S):
            try:
                compile(block, name, "exec")
            except SyntaxError as exc:
                errors.append(f"{name}: {exc}")
    return errors


def test_every_python_block_on_the_site_and_the_readme_parses():
    site = {**pages(), "README.md": (ROOT / "README.md").read_text()}
    assert python_errors(site) == []
    assert python_errors({"guide.md": "```python\nckpt.save(state\n```\n"})  # control: an unclosed call


def broken_links(site: dict[str, str], docs: Path) -> list[str]:
    """Relative links that land on no page (anchors are left to mkdocs --strict)."""
    errors = []
    for name, text in sorted(site.items()):
        text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
        for target in re.findall(r"(?<!!)\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            if not (docs / Path(name).parent / path).resolve().is_file():
                errors.append(f"{name}: ({target}) is not a file")
    return errors


def test_every_relative_link_lands_on_a_page():
    assert broken_links(pages(), DOCS) == []
    assert broken_links({"guides/a.md": "[the loop](../getting-started.md) [gone](../renamed.md#x)"}, DOCS) == [
        "guides/a.md: (../renamed.md#x) is not a file"]


def nav_pages(config: str) -> list[str]:
    return re.findall(r"^\s+- (?:[^:\n]+: )?([\w/.-]+\.md)$", config.split("\nnav:\n", 1)[1], re.M)


def test_every_page_is_in_the_navigation_once():
    listed = nav_pages((ROOT / "mkdocs.yml").read_text())
    assert sorted(listed) == sorted(pages()), "mkdocs.yml's nav and docs/*.md differ"
    assert len(set(listed)) == len(listed)
    assert nav_pages("site_name: x\nnav:\n  - Home: index.md\n  - Guides:\n      - One: guides/one.md\n") == [
        "index.md", "guides/one.md"]  # control: the parser sees nested entries


def test_included_files_are_shown_with_their_links_rewritten():
    for source, page in hooks.INCLUDES.items():
        if source != "README.md":
            assert f"<!-- include: {source} -->" in (DOCS / page).read_text(), page
    text = ("[claims](../RELIABILITY.md) [suite](bench_suite.py) [`bench_order.py`](bench_order.py) "
            "[gone](bench_gone.py) [web](https://example.org/x) [here](#machine) [exercise](sla_exercise.md#a)")
    assert hooks.rewrite_links(text, "benchmarks/README.md", "benchmarks.md") == (
        "[claims](reliability.md) suite (`benchmarks/bench_suite.py`) `benchmarks/bench_order.py` "
        "[gone](bench_gone.py) [web](https://example.org/x) [here](#machine) [exercise](sla-exercise.md#a)")
    assert hooks.rewrite_links("[guide](docs/guides/tiers.md)", "README.md", "concepts/x.md") == \
        "[guide](../guides/tiers.md)"
    with pytest.raises(ValueError, match="not a file the site includes"):
        hooks.expand_includes("<!-- include: SECRET.md -->\n", "x.md")
    shown = hooks.expand_includes((DOCS / "reliability.md").read_text(), "reliability.md")
    expected = hooks.gfm_blocks(
        hooks.rewrite_links((ROOT / "RELIABILITY.md").read_text(), "RELIABILITY.md", "reliability.md"))
    assert shown.rstrip("\n") == expected.rstrip("\n")
    assert "## Claims and evidence" in shown


def test_a_list_or_table_right_after_a_paragraph_line_is_set_apart_as_github_shows_it():
    text = "What this shows:\n- a\n  more\n- b\n\ntext\n| a |\n|---|\n```\nx:\n- y\n```\n"
    assert hooks.gfm_blocks(text) == (
        "What this shows:\n\n- a\n  more\n- b\n\ntext\n\n| a |\n|---|\n```\nx:\n- y\n```\n")
