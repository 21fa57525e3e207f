"""``trainstate nodes DIR [DIR ...]``: a tiered run's node directories read together (:mod:`trainstate.tools.nodes`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import InvalidArgument
from ..format import signing
from ..tools.nodes import check_nodes, is_node_directory


def refuse_single_node(target: str, command: str) -> None:
    """``ls`` and ``verify`` on one node's directory of a tiered run: it holds only part of each generation."""
    if is_node_directory(target):
        raise InvalidArgument(f"{target} is one node's directory of a run with node-local tiers: it holds only this "
                              f"node's part of each generation, so `trainstate {command}` would call every generation "
                              "incomplete. Read the nodes together: `trainstate nodes DIR1 DIR2 ...` (every node's "
                              "directory, copied to one machine if need be)")


def cmd_nodes(args: argparse.Namespace) -> int:
    report = check_nodes(args.directories, signing.resolve(None, args.directories[0]), content=not args.quick)
    if args.json:
        print(json.dumps(report, indent=1))
        return 1 if report["failures"] else 0
    for node in report["nodes"]:
        pointers = ", ".join(f"{k} -> {v}" for k, v in node["pointers"].items() if v) or "no pointers"
        print(f"{node['location']}: {len(node['holds'])} generation(s) held; {pointers}")
    for name, verdict in report["generations"].items():
        state = ("servable, survives the loss of any one node" if verdict["survives_one_node"] else
                 "servable by these nodes together" if verdict["servable"] else
                 verdict.get("problem") or f"NOT servable: no node holds {verdict['lacking'][0]}")
        print(f"  {name}: {state}")
    for failure in report["failures"]:
        print(f"FAILED  {failure}")
    print(f"recovery point: {report['recovery_point'] or 'none'}"
          f"{' (structure only: --quick)' if args.quick else ' (every held byte digested)'}")
    return 1 if report["failures"] else 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("nodes", help="verify a run with node-local tiers from all its nodes' directories together")
    p.add_argument("directories", nargs="+", help="every node's directory (local tier; replicas/ inside)")
    p.add_argument("--quick", action="store_true", help="sizes only: do not digest every held copy")
    p.set_defaults(func=cmd_nodes)
