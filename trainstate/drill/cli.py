"""Kill drill: train in a child process, SIGKILL it at random moments, resume, compare bitwise.

The command line, ``python -m trainstate.drill worker|zygote``.
"""
from __future__ import annotations

import argparse
from .options import add_worker_arguments
from .worker import worker_main
from .launch import zygote_main


# command line ------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainstate.drill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_worker_arguments(sub.add_parser("worker", help="train to --total, resuming from --dir (the child the drill kills)"))
    p = sub.add_parser("zygote", help="fork workers on request from the parent (see Zygote)")
    p.add_argument("fd", type=int, help="the parent's socket")
    args = parser.parse_args(argv)
    return zygote_main(args.fd) if args.command == "zygote" else worker_main(args)


