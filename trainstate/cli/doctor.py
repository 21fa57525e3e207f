"""``trainstate doctor RUN --factory M:F --step M:F`` (or ``--launch CMD``): why a resume drifts.

See :mod:`trainstate.tools.doctor`; ``--launch`` runs a multi-rank job's own command once per role
(:mod:`trainstate.tools.doctorjob`).

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
    if args.launch is None and (args.factory is None or args.step is None):
        args.parser.error("give --factory and --step (a job that runs in one process), or --launch CMD (a "
                          "multi-rank job's own command, e.g. torchtitan's under torchrun)")
    return report_command("doctor", args, lambda: doctor(
        args.run, args.factory, args.step, launch=args.launch, against=args.against, replay_from=args.replay_from, repeat=args.repeat,
        timeout_s=args.timeout), render)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="run the next update resumed and uninterrupted in fresh processes and name the "
                       "first stage that differs (exit 0 none, 1 a difference, 2 error; RNG streams the update never "
                       "drew from are reported apart and do not count)")
    p.add_argument("run", help="a run directory (its newest full generation), RUN@UPDATE, or a generation directory")
    p.add_argument("--factory", default=None, metavar="MODULE:FUNCTION",
                   help="returns a fresh TrainState, built as the training script builds it")
    p.add_argument("--step", default=None, metavar="MODULE:FUNCTION",
                   help="step(state) runs one update (takes the next batch itself) and returns the loss")
    p.add_argument("--launch", default=None, metavar="CMD",
                   help="instead of --factory and --step: the multi-rank job's own command (quoted; e.g. torchtitan's "
                   "torchrun line), run once per role; its trainstate checkpointer records every rank")
    p.add_argument("--against", default=None, metavar="DIR2",
                   help="an uninterrupted run: compare with its generation of the same update instead of a replay")
    p.add_argument("--from", dest="replay_from", default="start", metavar="start|UPDATE",
                   help="where the uninterrupted replay starts: the factory's fresh state (default) or an earlier "
                   "full generation of RUN")
    p.add_argument("--no-repeat", dest="repeat", action="store_false",
                   help="skip the second fresh restore that checks the update is reproducible (one process fewer)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="limit for each process")
    p.set_defaults(func=cmd_doctor, parser=p)
