"""``trainstate diff A B``: two generations compared in causal order (see :mod:`trainstate.tools.diff`).

Registered by :mod:`trainstate.cli.main` through :func:`add_parser`. Exit
status, like ``diff(1)``: 0 identical, 1 different, 2 an error (a bad
argument, or a generation that is missing or does not verify).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from .. import progress
from ..errors import TrainStateError
from ..tools.diff import diff, render


def cmd_diff(args: argparse.Namespace) -> int:
    with progress.bar(None, "diff", args.progress) as shown:
        return report_command("diff", args, lambda: diff(args.a, args.b, on_bytes=shown.update), render)


def report_command(name: str, args: argparse.Namespace, compute: Callable[[], Any],
                   render_report: Callable[[Any], str]) -> int:
    """Print a comparison report (text or ``--json``); exit 0 identical, 1 different, 2 error."""
    try:
        report = compute()
    except (TrainStateError, OSError, ValueError, KeyError) as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        else:
            print(f"trainstate {name}: {exc}", file=sys.stderr)
        return 2
    args.broken_pipe_status = 0 if report.identical else 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, allow_nan=False))
    else:
        print(render_report(report))
    return 0 if report.identical else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="compare two generations in causal order (exit 0 identical, 1 different, "
                       "2 error)")
    p.add_argument("a", help="a generation directory, RUN@UPDATE, or a run directory (its recovery point)")
    p.add_argument("b", help="the same forms as A")
    progress.add_flag(p)
    p.set_defaults(func=cmd_diff)
