"""The command-line reference cannot drift from the parsers.

Each command's usage and arguments on docs/cli.md are generated from ``build_parser()`` when the site is built
(the hook's ``<!-- cli: NAME -->``), so a flag the parser has is on the page. ``check_cli`` covers the rest: one
section per command, no section for a command that is gone, and no flag written anywhere on the site (or in the
README) that the command it is written for does not take.
"""

from __future__ import annotations

import argparse

import pytest
from docsite import ROOT, hooks, page, pages

from trainstate.cli.main import build_parser


def site() -> dict[str, str]:
    return {**pages(), "../README.md": (ROOT / "README.md").read_text()}


def toy() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainstate")
    sub = parser.add_subparsers(dest="command")
    ls = sub.add_parser("ls", help="list generations")
    ls.add_argument("directory")
    ls.add_argument("--full", action="store_true", help="every digest")
    sub.add_parser("pin", help="keep a generation").add_argument("name")
    return parser


TOY_PAGE = """# Command line

```sh
trainstate ls runs/exp1 --full      # every digest
```

## trainstate ls

<!-- cli: ls -->

`--full` reads every byte.

## trainstate pin

<!-- cli: pin -->
"""


def test_the_site_and_the_parser_agree():
    assert hooks.check_cli(site(), build_parser()) == []


def test_every_flag_of_every_command_is_on_the_generated_page():
    parser = build_parser()
    shown = hooks.expand_cli(page("cli.md"), parser)
    for name, (sub, _) in hooks.subcommands(parser).items():
        section = shown.split(f"\n## trainstate {name}\n", 1)[1].split("\n## ", 1)[0]
        for flag in hooks.flags(sub) - {"-h", "--help"}:
            assert f"`{flag}`" in section, f"trainstate {name}: {flag} is not in its generated table"
        assert sub.format_usage().split()[1] == "trainstate"


def test_a_checked_toy_page_passes():
    assert hooks.check_cli({"cli.md": TOY_PAGE}, toy()) == []
    child = {"cli.md": TOY_PAGE, "guide.md": "`trainstate pin first -- python train.py --lr 3`"}
    assert hooks.check_cli(child, toy()) == []  # what follows `--` is the child's, not trainstate's


def test_a_command_without_its_section_is_caught():
    errors = hooks.check_cli({"cli.md": TOY_PAGE.replace("<!-- cli: pin -->", "")}, toy())
    assert errors == ["cli.md: `trainstate pin` has 0 <!-- cli: pin --> markers (one expected)"]


def test_a_section_for_a_command_that_is_gone_is_caught():
    errors = hooks.check_cli({"cli.md": TOY_PAGE + "\n## trainstate unpin\n\n<!-- cli: unpin -->\n"}, toy())
    assert errors == ["cli.md: <!-- cli: unpin --> names no command"]
    with pytest.raises(ValueError, match="`trainstate unpin` is not a command"):
        hooks.expand_cli("<!-- cli: unpin -->", toy())


def test_a_flag_the_parser_lacks_is_caught_in_prose_and_in_command_lines():
    prose = TOY_PAGE.replace("`--full` reads every byte.", "`--quick` skips the digests.")
    assert hooks.check_cli({"cli.md": prose}, toy()) == [
        "cli.md: the section of `trainstate ls` names --quick, which it does not take"]
    line = {"cli.md": TOY_PAGE, "guide.md": "Run `trainstate ls runs/exp1 --quick` first.\n"}
    assert hooks.check_cli(line, toy()) == ["guide.md: `trainstate ls runs/exp1 --quick`: `trainstate ls` has no "
                                            "flag --quick"]
    continued = {"cli.md": TOY_PAGE, "guide.md": "```sh\n$ trainstate ls runs/exp1 \\\n    --quick=1\n```\n"}
    assert [e.rsplit(": ", 1)[1] for e in hooks.check_cli(continued, toy())] == ["`trainstate ls` has no flag --quick"]
    gone = {"cli.md": TOY_PAGE, "README.md": "```sh\ntrainstate lst runs/exp1   # list\n```\n"}
    assert hooks.check_cli(gone, toy()) == ["README.md: `trainstate lst runs/exp1   # list` names no command "
                                            "`trainstate lst`"]


def test_a_flag_added_to_a_parser_appears_on_the_page():
    parser = toy()
    hooks.subcommands(parser)["ls"][0].add_argument("--timeline", action="store_true", help="draw the lineage")
    shown = hooks.expand_cli(TOY_PAGE, parser)
    assert "| `--timeline` | draw the lineage |" in shown and "[--timeline]" in shown
    assert "| `--full` | every digest |" in shown and "| `directory` |" in shown
