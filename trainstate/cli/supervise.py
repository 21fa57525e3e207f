"""``trainstate supervise`` (a bounded restart loop on a live host) and ``trainstate done`` (is the run finished?).

Registered by :mod:`trainstate.cli.main` through :func:`add_parsers`.

``trainstate supervise --run-dir DIR [--max-starts 3] [--backoff 10,20,40] [--stop-file PATH] -- CMD ...``
exits 0 when the run is done (its DONE record verifies), 1 when the failures
used up ``--max-starts``, 75 when preemptions exceeded ``--max-preemptions``,
78 on a permanent error (the child's, or the disk preflight's), and 128 + N when
stopped by signal N (the stop file: SIGTERM, 143). ``--status DIR`` summarises
the attempt log. ``trainstate done DIR`` exits 0 done, 1 stale, 3 missing (2: usage or error).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..lifecycle import done as done_mod
from ..lifecycle import supervise as policy_mod
from ..lifecycle.supervisor import LOG_NAME, Supervisor, default_log
from ..storage.objectclient import is_url

EXIT_STALE, EXIT_MISSING, EXIT_ERROR = 1, 3, 2


def load_config(path: str | None) -> Any:
    """A config file for the contract comparison: JSON, or TOML by its extension."""
    if path is None:
        return None
    data = Path(path).read_bytes()
    try:
        if path.endswith(".toml"):
            import tomllib  # Python 3.11+

            return tomllib.loads(data.decode())
        return json.loads(data)
    except ImportError:
        raise InvalidArgument(f"{path}: TOML needs Python 3.11 or later; give the config as JSON") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read the config {path}: {exc}") from None


def cmd_done(args: argparse.Namespace) -> int:
    try:
        status = done_mod.done(args.directory, config=load_config(args.config), content=not args.fast)
    except (InvalidArgument, OSError) as exc:
        print(json.dumps({"error": str(exc)}) if args.json else f"trainstate done: {exc}",
              file=sys.stdout if args.json else sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(status.to_json(), indent=1))
    elif status:
        r = status.record
        print(f"done: {r.generation} (update {r.next_update}, {r.tokens_seen:,} tokens), finished {r.created}"
              + (f"; metrics {json.dumps(r.metrics)}" if r.metrics else ""))
    elif status.status == "missing":
        print(f"not done: {args.directory} has no DONE record")
    else:
        print(f"stale: the DONE record does not hold: {status.reason}")
    return 0 if status else EXIT_MISSING if status.status == "missing" else EXIT_STALE


def _read_log(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as stream:
        for line in stream:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a crash: the rest of the log still counts
    return records


def cmd_status(args: argparse.Namespace) -> int:
    directory = args.status
    path = args.log or default_log(directory)
    try:
        records = _read_log(path)
    except FileNotFoundError:
        print(f"trainstate supervise: no attempt log at {path}", file=sys.stderr)
        return 1
    summaries = [policy_mod.summary(s) for s in policy_mod.sessions(records)]
    verdict = done_mod.done(directory, content=False)
    if args.json:
        print(json.dumps({"log": path, "sessions": summaries, "done": verdict.to_json()}, indent=1))
        return 0
    print(policy_mod.render(summaries, path))
    print(f"  DONE: {verdict.status}" + (f" ({verdict.record.generation})" if verdict else "")
          + (f": {verdict.reason}" if verdict.reason else ""))
    return 0


def cmd_supervise(args: argparse.Namespace) -> int:
    if args.status is not None:
        return cmd_status(args)
    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.run_dir is None or not command:
        print("trainstate supervise: needs --run-dir DIR and a command after --, or --status DIR", file=sys.stderr)
        return 2
    if is_url(args.run_dir) and args.log is None:
        print("trainstate supervise: a run on an object store needs --log PATH for the attempt log (local)",
              file=sys.stderr)
        return 2
    policy = policy_mod.Policy(args.max_starts, policy_mod.parse_backoff(args.backoff), args.max_preemptions)
    supervisor = Supervisor(command, args.run_dir, policy=policy, stop_file=args.stop_file, log_path=args.log,
                            config=load_config(args.config), min_free=policy_mod.parse_size(args.min_free),
                            stop_grace_s=args.stop_grace if args.stop_grace > 0 else None)
    return supervisor.run()


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("supervise", help="run a training command with bounded restarts on this host",
                       description="Start CMD, and restart it a bounded number of times from the newest validated "
                       "generation. Exit: 0 done, 1 failures used up --max-starts, 75 too many preemptions, "
                       "78 a permanent error, 128+N stopped by signal N.")
    p.add_argument("--run-dir", default=None, help="the run directory the command checkpoints into")
    p.add_argument("--max-starts", type=int, default=3, help="starts in all, not counting restarts after a "
                   "preemption (default 3)")
    p.add_argument("--backoff", default="10,20,40", help="seconds to wait after the 1st, 2nd, ... failure; the last "
                   "repeats (default 10,20,40)")
    p.add_argument("--max-preemptions", type=int, default=10, help="restarts after a preemption exit (75), which "
                   "wait for nothing (default 10)")
    p.add_argument("--stop-file", default=None, help="when this file appears, stop the child (SIGTERM) and do not "
                   "restart; an existing one prevents any start")
    p.add_argument("--stop-grace", type=float, default=300.0, help="seconds the child has to exit after a stop "
                   "before SIGKILL (default 300; 0: wait forever)")
    p.add_argument("--config", default=None, help="JSON or TOML config the DONE record must have finished with")
    p.add_argument("--min-free", default="0", help="free space a start needs at least (e.g. 20G); the newest "
                   "generation's size plus 5%% is always required")
    p.add_argument("--log", default=None, help=f"the JSON-lines attempt log (default: RUN_DIR/{LOG_NAME})")
    p.add_argument("--status", metavar="DIR", default=None, help="summarise the attempt log of DIR and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command")
    p.set_defaults(func=cmd_supervise)
    p = sub.add_parser("done", help="whether the run finished: its DONE record verifies (exit 0 done, 1 stale, "
                       "3 missing)")
    p.add_argument("directory", help="the run directory")
    p.add_argument("--config", default=None, help="JSON or TOML config the run must have finished with")
    p.add_argument("--fast", action="store_true", help="check the final generation's structure and sizes, not "
                   "every byte")
    p.set_defaults(func=cmd_done)
