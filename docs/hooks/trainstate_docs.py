"""Build hooks of the documentation site (``hooks:`` in mkdocs.yml), and the checks the tests run on the same code.

Markers are HTML comments on a line of their own:

- ``<!-- cli: NAME -->`` becomes the reference of ``trainstate NAME``: its usage line, description and every
  argument, generated from ``trainstate.cli.main.build_parser()`` at build time. A flag therefore cannot be in the
  parser and missing from the site; :func:`check_cli` covers the other direction (a flag the prose names that the
  parser does not have, a command without its section).
- ``<!-- include: PATH -->`` becomes the repository file PATH (``RELIABILITY.md``, ``benchmarks/README.md``) as it
  is when the site is built, so the site cannot drift from the file other work records figures in. Its relative
  links are rewritten for the page: to the page that includes the target, to a plain path for a source file, and
  left alone when the target does not exist, so that ``mkdocs build --strict`` fails on it.
- ``<!-- runnable: ID -->`` stays as it is (invisible): the code block after it is executed by a test that calls
  ``docsite.runnable("ID")`` (``tests/docsite.py``, checked by ``tests/test_docs_site.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Repository Markdown files shown on the site, and the page that shows each (relative to docs/).
INCLUDES = {
    "RELIABILITY.md": "reliability.md",
    "benchmarks/README.md": "benchmarks.md",
    "benchmarks/sla_exercise.md": "sla-exercise.md",
    "README.md": "index.md",  # links into the README land on the site's home page
}

CLI_MARK = re.compile(r"^<!-- cli: ([a-z][a-z-]*) -->$", re.M)
INCLUDE_MARK = re.compile(r"^<!-- include: (\S+) -->$", re.M)
RUNNABLE_MARK = re.compile(r"^<!-- runnable: ([a-z0-9][a-z0-9-]*) -->\n```([a-z]*)\n(.*?)^```$", re.M | re.S)
RUNNABLE_ANY = re.compile(r"^<!-- runnable:.*-->$", re.M)
LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMON_FLAGS = {"--json", "--help"}  # every command takes them (build_parser adds --json to each)


# --- the command line --------------------------------------------------------------------------------------------

def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Each subcommand of ``parser``: its own parser and its one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}
    return {}


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_command(name: str, parser: argparse.ArgumentParser, summary: str) -> str:
    """The Markdown reference of one subcommand, from its parser alone."""
    usage = parser.format_usage().removeprefix("usage: ").strip()
    out = [f"```text\n{' '.join(usage.split())}\n```", ""]
    if summary:
        out += [f"*{_cell(summary)}.*", ""]
    if parser.description:
        out += ["```text", parser.description.strip(), "```", ""]
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            shown = ", ".join(f"`{s}`" for s in action.option_strings)
            if action.nargs != 0:
                shown += f" `{action.metavar or action.dest.upper()}`"
        else:
            shown = f"`{action.metavar or action.dest}`" + (" ..." if action.nargs in ("*", "+", "...") else "")
        default = action.default
        default = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
        rows.append(f"| {shown} | {_cell(action.help or '')} | {default} |")
    out += ["| argument | meaning | default |", "|---|---|---|", *rows]
    return "\n".join(out) + "\n"


def expand_cli(markdown: str, parser: argparse.ArgumentParser) -> str:
    commands = subcommands(parser)

    def one(match: re.Match) -> str:
        name = match[1]
        if name not in commands:
            raise ValueError(f"<!-- cli: {name} -->: `trainstate {name}` is not a command "
                             f"(the parser has {', '.join(sorted(commands))})")
        sub, summary = commands[name]
        return render_command(name, sub, summary)

    return CLI_MARK.sub(one, markdown)


def _invocations(text: str) -> list[str]:
    """Command lines that start with ``trainstate`` in code: fenced blocks (``$ `` prompts dropped) and spans."""
    found = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```$", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():  # a line continued with a backslash is one line
            line = line.strip().removeprefix("$ ")
            if line.startswith("trainstate "):
                found.append(line)
    prose = re.sub(r"^```[a-z]*\n.*?^```$", "", text, flags=re.M | re.S)
    found += [s for s in re.findall(r"`([^`\n]+)`", prose) if s.startswith("trainstate ")]
    return found


def _words(command: str) -> list[str]:
    """A command line's words as a shell splits them: a quoted argument (``--launch "torchrun ... --config x"``)
    is one word, its flags not trainstate's."""
    try:
        return shlex.split(command)
    except ValueError:  # an unbalanced quote in prose-like code: plain words
        return command.split()


def check_cli(pages: dict[str, str], parser: argparse.ArgumentParser, cli_page: str = "cli.md") -> list[str]:
    """What the site says about the command line that the parser contradicts; empty when they agree.

    ``pages`` maps a page's path to its Markdown. Checked: ``cli_page`` has exactly one ``<!-- cli: NAME -->``
    per subcommand and none for anything else; every ``trainstate CMD ...`` written in code anywhere names a
    command and only its flags; every flag written in the section of ``cli_page`` that documents a command
    (the ``## `` heading above its marker, to the next ``## `` heading) is one of that command's.
    """
    commands = subcommands(parser)
    errors = []
    marks = CLI_MARK.findall(pages.get(cli_page, ""))
    for name in sorted(commands):
        if marks.count(name) != 1:
            errors.append(f"{cli_page}: `trainstate {name}` has {marks.count(name)} <!-- cli: {name} --> markers "
                          f"(one expected)")
    errors += [f"{cli_page}: <!-- cli: {n} --> names no command" for n in sorted(set(marks) - set(commands))]
    for page, text in sorted(pages.items()):
        for line in _invocations(text):
            words = _words(line.split("#", 1)[0].split("|", 1)[0])
            words = words[: words.index("--")] if "--" in words else words  # after `--`: the child's arguments
            name = words[1] if len(words) > 1 else ""
            if name.startswith("-"):  # `trainstate --help`
                continue
            if name not in commands:
                errors.append(f"{page}: `{line}` names no command `trainstate {name}`")
                continue
            known = flags(commands[name][0])
            errors += [f"{page}: `{line}`: `trainstate {name}` has no flag {w.split('=')[0]}"
                       for w in words[2:] if FLAG.fullmatch(w.split("=")[0]) and w.split("=")[0] not in known]
    text = pages.get(cli_page, "")
    for match in CLI_MARK.finditer(text):
        if match[1] not in commands:
            continue
        start = text.rfind("\n## ", 0, match.start()) + 1
        end = re.search(r"^##? ", text[match.end():], re.M)
        section = text[start: match.end() + end.start() if end else len(text)]
        section = re.sub(r"^```[a-z]*\n.*?^```$", "", section, flags=re.M | re.S)  # command lines: checked above
        known = flags(commands[match[1]][0]) | COMMON_FLAGS
        errors += [f"{cli_page}: the section of `trainstate {match[1]}` names {f}, which it does not take"
                   for f in sorted(set(FLAG.findall(section)) - known)]
    return errors


# --- included repository files -----------------------------------------------------------------------------------

def rewrite_links(markdown: str, source: str, page: str) -> str:
    """Relative links of the repository file ``source`` as seen from the site page ``page``."""
    def one(match: re.Match) -> str:
        text, target = match[1], match[2]
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match[0]
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(source), path)).replace(os.sep, "/")
        hop = lambda doc: os.path.relpath(doc, os.path.dirname(page) or ".").replace(os.sep, "/")  # noqa: E731
        if resolved in INCLUDES:
            return f"[{text}]({hop(INCLUDES[resolved])}{'#' + anchor if anchor else ''})"
        if resolved.startswith("docs/") and (ROOT / resolved).exists():
            return f"[{text}]({hop(resolved.removeprefix('docs/'))}{'#' + anchor if anchor else ''})"
        if not resolved.startswith("..") and (ROOT / resolved).exists():  # source, not a page: name it
            return f"`{resolved}`" if text.strip("`") == path else f"{text} (`{resolved}`)"
        return f"[{text}]({target})"  # nothing there: left for --strict to report

    return LINK.sub(one, markdown)


def expand_includes(markdown: str, page: str) -> str:
    def one(match: re.Match) -> str:
        source = match[1]
        if source not in INCLUDES:
            raise ValueError(f"{page}: <!-- include: {source} -->: not a file the site includes ({sorted(INCLUDES)})")
        return gfm_blocks(rewrite_links((ROOT / source).read_text(), source, page))

    return INCLUDE_MARK.sub(one, markdown)


def gfm_blocks(markdown: str) -> str:
    """A blank line before a list or a table that follows a paragraph line, as GitHub reads those files and
    Python-Markdown does not (it would run the list or the table into the paragraph)."""
    out: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"(- |\* |\d+\. |\|)", line) and out:
            prev = out[-1]
            starts = (" ", "\t", "#", "|", ">") if line.startswith("|") else (" ", "\t", "#", ">")
            if prev.strip() and not prev.startswith(starts) and not re.match(r"(- |\* |\d+\. )", prev):
                out.append("")
        out.append(line)
    return "\n".join(out)


def runnable_blocks(pages: dict[str, str]) -> dict[str, tuple[str, str, str]]:
    """``ID -> (page, language, code)`` for every ``<!-- runnable: ID -->`` block; a malformed marker raises."""
    out: dict[str, tuple[str, str, str]] = {}
    for page, text in sorted(pages.items()):
        matched = {m.start() for m in RUNNABLE_MARK.finditer(text)}
        for m in RUNNABLE_ANY.finditer(text):
            if m.start() not in matched:
                raise ValueError(f"{page}: `{m[0]}` is not a runnable marker (a lowercase id) followed at once by "
                                 "a fenced code block")
        for m in RUNNABLE_MARK.finditer(text):
            if m[1] in out:
                raise ValueError(f"{page}: runnable block {m[1]!r} is also on {out[m[1]][0]}")
            out[m[1]] = (page, m[2], m[3])
    return out


def read_pages(docs: Path = DOCS) -> dict[str, str]:
    return {p.relative_to(docs).as_posix(): p.read_text() for p in sorted(docs.rglob("*.md"))}


# --- mkdocs events -----------------------------------------------------------------------------------------------

_parser: argparse.ArgumentParser | None = None


def _cli_parser() -> argparse.ArgumentParser:
    global _parser
    if _parser is None:
        from trainstate.cli.main import build_parser

        _parser = build_parser()
    return _parser


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' signature)
    path = page.file.src_uri
    markdown = expand_includes(markdown, path)
    if CLI_MARK.search(markdown):
        markdown = expand_cli(markdown, _cli_parser())
    return markdown


def on_page_content(html: str, page, config, files) -> str:  # noqa: ARG001
    """Docstrings use Sphinx roles (``:class:`TrainState```); the reference shows the name alone."""
    return re.sub(r":(?:class|func|meth|mod|attr|exc|data):(<code>)~?", r"\1", html)


def on_pre_build(config) -> None:  # noqa: ARG001
    """Fail the build, as --strict would, when the site and the parser disagree."""
    from mkdocs.exceptions import PluginError

    pages = {**read_pages(), "../README.md": (ROOT / "README.md").read_text()}
    errors = check_cli(pages, _cli_parser())
    if errors:
        raise PluginError("the command-line reference disagrees with the parser:\n  " + "\n  ".join(errors))
    try:
        runnable_blocks(pages)
    except ValueError as exc:
        raise PluginError(str(exc)) from None
