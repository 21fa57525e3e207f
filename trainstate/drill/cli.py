"""Kill drill: train in a child process, SIGKILL it at random moments, resume, compare bitwise.

The command line, ``python -m trainstate.drill worker|zygote``.
"""
from __future__ import annotations

import argparse
from .worker import DrillConfig, FORGET_CHOICES, worker_main
from .launch import zygote_main


# command line ------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainstate.drill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("worker", help="train to --total, resuming from --dir (the child the drill kills)")
    p.add_argument("--dir", required=True)
    p.add_argument("--total", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=DrillConfig.width)
    p.add_argument("--batch", type=int, default=DrillConfig.batch)
    p.add_argument("--loader-workers", type=int, default=None, metavar="W",
                   help="take batches from a ResumableLoader with W DataLoader worker processes (0: in-process) "
                        "and log the consumed sample ids; without it, no loader (batches from a generator)")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--wait-for-go", action="store_true", help="after building, wait for 'go' on stdin")
    p.add_argument("--async-save", action="store_true",
                   help="save with save(blocking=False): print 'staged <n>' when it returns, 'saved <n>' once published")
    p.add_argument("--slow-fsync", type=int, default=0, metavar="MS", dest="slow_fsync_ms",
                   help="a slower disk: every file fsync takes MS milliseconds longer (saves overlap training)")
    p.add_argument("--forget", choices=FORGET_CHOICES, default=None,
                   help="negative control: after restoring, reset this part to its fresh state")
    p = sub.add_parser("zygote", help="fork workers on request from the parent (see Zygote)")
    p.add_argument("fd", type=int, help="the parent's socket")
    args = parser.parse_args(argv)
    return zygote_main(args.fd) if args.command == "zygote" else worker_main(args)


