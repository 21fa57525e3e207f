"""The documentation site (docs/), for tests: its pages, its runnable blocks by id, a section by heading.

A code block marked ``<!-- runnable: ID -->`` on the site is executed by the test that calls ``runnable("ID")``;
``tests/test_docs_site.py`` checks that every marked block has such a test. The parsing is the build hook's own
(``docs/hooks/trainstate_docs.py``), so the tests and the site read the pages the same way.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load_hooks():
    spec = importlib.util.spec_from_file_location("trainstate_docs_hooks", DOCS / "hooks" / "trainstate_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


def pages() -> dict[str, str]:
    """Every page of the site by its path under docs/."""
    return hooks.read_pages(DOCS)


def page(path: str) -> str:
    return (DOCS / path).read_text()


def runnable(block_id: str) -> str:
    """The code of the block marked ``<!-- runnable: block_id -->``: the caller runs it."""
    blocks = hooks.runnable_blocks(pages())
    if block_id not in blocks:
        raise KeyError(f"no block is marked <!-- runnable: {block_id} --> on the site (marked: {sorted(blocks)})")
    return blocks[block_id][2]


def section(path: str, heading: str) -> str:
    """The text under ``heading`` (e.g. ``"## Accelerate"``) up to the next heading of the same or a higher level."""
    text = page(path)
    level = len(heading.split(" ", 1)[0])
    body = text.split(f"\n{heading}\n", 1)[1]
    end = re.search(rf"^#{{1,{level}}} ", body, re.M)
    return body[: end.start()] if end else body


def blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of ``lang`` in ``text``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)
