"""The worker's command line, shared by ``python -m trainstate.drill`` and the zygote's forked children."""

from __future__ import annotations

import argparse

from .worker import FORGET_CHOICES, DrillConfig, DrillError, worker_main


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The worker's options (``python -m trainstate.drill worker ...``)."""
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
    p.add_argument("--full-every", type=int, default=None, metavar="N",
                   help="incremental generations (CheckpointManager(full_every=N)), with a frozen component")
    p.add_argument("--mirror", default=None, metavar="URL",
                   help="mirror every generation to this object-store URL (storage options, JSON, in "
                        "$TRAINSTATE_DRILL_MIRROR_OPTIONS); print 'uploaded <n>' as the remote latest moves")
    p.add_argument("--forget", choices=FORGET_CHOICES, default=None,
                   help="negative control: after restoring, reset this part to its fresh state")


def run_worker(argv: list[str]) -> int:
    """The worker's entry point from an argument list that starts with ``worker``."""
    if not argv or argv[0] != "worker":
        raise DrillError(f"a forked drill child runs only the worker, not {argv[:1]!r}")
    parser = argparse.ArgumentParser(prog="python -m trainstate.drill worker")
    add_worker_arguments(parser)
    return worker_main(parser.parse_args(argv[1:]))
