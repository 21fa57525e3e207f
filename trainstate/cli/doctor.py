"""``trainstate doctor RUN --factory M:F --step M:F``: why a resume drifts (see :mod:`trainstate.tools.doctor`).

Registered by :mod:`trainstate.cli.main` through :func:`add_parser`. Exit
status, like ``trainstate diff``: 0 no difference, 1 a difference (or an
update that is not reproducible), 2 an error (a bad argument, a run without a
full generation, a factory or step that fails). A difference in an RNG stream
that no compared update drew from is reported apart and counts as none.
"""

from __future__ import annotations

import argparse

from ..tools.doctor import doctor, render
from .diff import report_command


def cmd_doctor(args: argparse.Namespace) -> int:
    return report_command("doctor", args, lambda: doctor(
        args.run, args.factory, args.step, against=args.against, replay_from=args.replay_from, repeat=args.repeat,
        timeout_s=args.timeout), render)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="run the next update resumed and uninterrupted in fresh processes and name the "
                       "first stage that differs (exit 0 none, 1 a difference, 2 error; RNG streams the update never "
                       "drew from are reported apart and do not count)")
    p.add_argument("run", help="a run directory (its newest full generation), RUN@UPDATE, or a generation directory")
    p.add_argument("--factory", required=True, metavar="MODULE:FUNCTION",
                   help="returns a fresh TrainState, built as the training script builds it")
    p.add_argument("--step", required=True, metavar="MODULE:FUNCTION",
                   help="step(state) runs one update (takes the next batch itself) and returns the loss")
    p.add_argument("--against", default=None, metavar="DIR2",
                   help="an uninterrupted run: compare with its generation of the same update instead of a replay")
    p.add_argument("--from", dest="replay_from", default="start", metavar="start|UPDATE",
                   help="where the uninterrupted replay starts: the factory's fresh state (default) or an earlier "
                   "full generation of RUN")
    p.add_argument("--no-repeat", dest="repeat", action="store_false",
                   help="skip the second fresh restore that checks the update is reproducible (one process fewer)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="limit for each process")
    p.set_defaults(func=cmd_doctor)
