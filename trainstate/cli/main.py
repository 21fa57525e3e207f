"""Command line: ``trainstate ls|verify|inspect|demo|prune|pin|unpin|plan|cadence`` (also ``python -m trainstate``).

Every command reads metadata through the same trusted reader as restore:
nothing here unpickles, so it is safe to point at a hostile directory.
Exit status: 0 success, 1 a verification failure or error, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import authenticity
from . import copy as cli_copy
from . import cost as cli_cost
from . import diff as cli_diff
from . import inspecting
from . import doctor as cli_doctor
from . import export as cli_export
from . import hfdiscard as cli_hfdiscard
from . import lifecycle as cli_lifecycle
from . import listing
from . import nodes as cli_nodes
from . import timeline as cli_timeline
from . import supervise as cli_supervise
from .. import progress
from ..format import signing
from ..errors import InvalidArgument, TrainStateError
from ..storage.base import Store, pinned
from ..storage.locate import open_existing, split_generation
from ..storage.objectclient import is_url
from ..format.manifest import POINTER, parse_generation_name
from ..lifecycle.rehearsal import load_factory, rehearse
from ..lifecycle.candidates import check_run, expected_run
from ..storage.verify import read_layouts, read_manifest, read_state_json, verify_generation

DESCRIPTION = """\
Inspect, verify and maintain trainstate run directories.

Every command reads through the same pickle-free, digest-checking reader as
restore, so it is safe to point at a directory you do not trust. Each takes
--json. Exit status: 0 success, 1 a verification failure or error, 2 bad usage.
"""

VERIFY_DESCRIPTION = f"""\
Verify a run directory (every generation's manifest, file set, sizes and
digests, and every pointer), one generation of it, or a release bundle written
by `trainstate export` (every file against release-manifest.json: a changed,
missing or unlisted file is named).

Signatures are checked only with the key ({signing.ENV_KEY} or
{signing.ENV_KEY_FILE}). Without it a signed target still verifies, and the
last line says so: "signature present but NOT checked ... nothing was
authenticated". --require-signature makes that, and an unsigned target, exit 1.
"""


def _open_target(target: str) -> tuple[Store, list[str], bool]:
    """A run (directory or URL; all generations) or a single generation in one."""
    run, generation = split_generation(target)
    if generation is not None and (is_url(target) or Path(target).is_dir()):
        return open_existing(run), [generation], True
    store = open_existing(target)
    return store, store.generations(), False


def cmd_ls(args: argparse.Namespace) -> int:
    """Generations as a table (or ``--timeline``), and the recovery point: chosen as restore chooses, its
    digests checked (``--quick``: by structure only, and said so)."""
    cli_nodes.refuse_single_node(args.directory, "ls")
    store, names, _ = _open_target(args.directory)
    report = listing.gather(store, names, signing.resolve(None, store.location), full=args.full, quick=args.quick)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for line in (cli_timeline.timeline(report) if args.timeline else listing.table(report)):
        print(line)
    return 0


def cmd_discard(args: argparse.Namespace) -> int:
    """Delete set-aside generations after review (never a generation restore could use); in a Hugging Face
    output directory, the checkpoint folders the callback set aside (never a ``checkpoint-N``)."""
    if cli_hfdiscard.choose_mode(args.directory, args.names, args.mode) == "hf":
        names = cli_hfdiscard.discard(args.directory, args.names, args.all)
        print(json.dumps({"discarded": names}) if args.json else "\n".join(f"discarded {n}" for n in names))
        return 0
    store = open_existing(args.directory)
    aside = store.aside()
    names = [n for n in aside if ".superseded-" not in n] if args.all else list(args.names)
    unknown = [n for n in names if n not in aside or ".superseded-" in n]
    if unknown or not names:
        raise InvalidArgument(
            f"nothing to discard: {', '.join(unknown) or '(no names given)'} "
            f"{'is' if len(unknown) == 1 else 'are'} not set-aside entries of {store.location}; "
            f"`trainstate ls {store.location}` lists them (rejected and abandoned ones can be discarded)")
    store.lock()  # a live run may be setting something aside right now
    try:
        notes = [_discard_entry(store, name) for name in names]
    finally:
        store.unlock()
    if args.json:
        print(json.dumps({"discarded": names}))
    else:
        for name, note in zip(names, notes):
            print(f"discarded {name}{note}")
    return 0


def _discard_entry(store: Store, name: str) -> str:
    """Remove one set-aside entry; returns what to add to its line. The library sets aside only directories; a
    symbolic link or a file under such a name is unlinked (a link never followed: its target stays as it is)."""
    path = Path(store.location) / name
    if getattr(store, "remote", False) or (path.is_dir() and not path.is_symlink()):
        store.remove(name)
        return ""
    target = os.readlink(path) if path.is_symlink() else None
    os.unlink(path)
    store.ops.fsync_dir(path.parent)
    return "" if target is None else f" (a symbolic link: the link removed, its target {target} untouched)"


def _total_bytes(store: Store, names: list[str], key: Any) -> int | None:
    """The bytes verify will read (from the manifests), or None when one is unreadable (verify then says why)."""
    try:
        return sum(f.size for n in names for f in read_manifest(store, n, None, key)[0].files)
    except (TrainStateError, OSError):
        return None


def cmd_verify(args: argparse.Namespace) -> int:
    if cli_export.is_bundle(args.target):  # a release bundle written by `trainstate export`
        return cli_export.cmd_verify_bundle(args)
    cli_nodes.refuse_single_node(args.target, "verify")
    store, names, single = _open_target(args.target)
    with pinned(store):  # an object store: each commit record read once, for the generation and its pointer
        return _verify_run(args, store, names, single)


def _verify_run(args: argparse.Namespace, store: Store, names: list[str], single: bool) -> int:
    key = signing.resolve(None, store.location)
    failures: list[dict[str, str]] = []
    if not names:
        failures.append({"generation": args.target, "error": "holds no generations: nothing to verify (is it the "
                         "run directory? a save creates gen-<update> directories in it)"})
    checked = []
    run = expected_run(store, key)
    with progress.bar(_total_bytes(store, names, key), "verify", args.progress) as shown:
        for name in names:
            try:
                check_run(verify_generation(store, name, key=key, on_bytes=shown.update).manifest, run)
                checked.append(name)
            except (TrainStateError, OSError) as exc:
                failures.append({"generation": name, "error": str(exc)})
    if not single:
        pointers = listing.read_pointers(store, key)
        if POINTER not in pointers and any(parse_generation_name(n)[1] == "full" for n in names):
            failures.append({"generation": POINTER, "error": "missing, but full generations exist; restore "
                             "would have to fall back to the newest generation that verifies"})
        for pname, p in pointers.items():
            if not p["ok"]:
                failures.append({"generation": pname, "error": p["error"]})
            elif p["generation"] not in checked:
                failures.append({"generation": pname, "error": f"names {p['generation']}, which did not verify"})
            else:
                try:
                    read_manifest(store, p["generation"], p["pointer"], key)
                except TrainStateError as exc:
                    failures.append({"generation": pname, "error": f"names {p['generation']}, which verifies on "
                                     f"its own, but the pointer's record does not match it: {exc}"})
    signature = authenticity.status(authenticity.run_signed(store, names), key is not None)
    refused = authenticity.required(signature, f"run {args.target}") if args.require_signature else None
    if refused:
        failures.append({"generation": args.target, "error": refused})
    rehearsed = None
    if args.rehearse:
        target = names[0] if single else (pointers.get(POINTER, {}).get("generation")
                                          if pointers.get(POINTER, {}).get("ok") else None)
        if target is None:
            failures.append({"generation": POINTER, "error": "nothing to rehearse: no valid latest pointer"})
        else:
            try:
                result = rehearse(store, target, load_factory(args.rehearse), key=key)
                rehearsed = {"generation": target, "checks": list(result.checks), "warnings": list(result.warnings)}
            except (TrainStateError, OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
                failures.append({"generation": target, "error": f"rehearsal failed: {type(exc).__name__}: {exc}"})
    args.broken_pipe_status = 1 if failures else 0  # a reader that stops early must not turn a failure into 0
    if args.json:
        out: dict[str, Any] = {"verified": checked, "failures": failures}
        out.update(signature=signature, authenticated=signature == authenticity.VERIFIED and not failures)
        if args.rehearse:
            out["rehearsal"] = rehearsed
        print(json.dumps(out, indent=1))
    else:
        for name in checked:
            print(f"ok      {name}")
        if rehearsed:
            print(f"rehearsed {rehearsed['generation']} into fresh objects: {', '.join(rehearsed['checks'])}")
        for f in failures:
            print(f"FAILED  {f['generation']}: {f['error']}")
        if not failures:
            print(f"ok: {len(checked)} generation(s) of {args.target} verified (digests checked"
                  + ("" if single else ", and every pointer") + f"); {authenticity.phrase(signature)}")
    return 1 if failures else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store, names, single = _open_target(args.generation)
    if not single:
        names = names[:1]
        if not names:
            print(f"no generations in {args.generation}", file=sys.stderr)
            return 1
    manifest, _, _ = read_manifest(store, names[0])
    state = read_state_json(store, manifest)
    layouts = {e.name: {"dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape), "bytes": e.nbytes}
               for layout in read_layouts(store, manifest).values() for e in layout.entries}
    raw = state.get("components") if type(state.get("components")) is dict else {}
    states = {n: c.get("state") if type(c) is dict else c for n, c in raw.items()}
    shared = {ref: paths for ref, paths in inspecting.references(states).items() if len(paths) > 1}
    report = {
        "generation": manifest.generation, "kind": manifest.kind, "next_update": manifest.next_update,
        "created": manifest.created, "digest_algorithm": manifest.digest_algorithm,
        "files": [{"name": f.name, "size": f.size, **({"shared_from": manifest.shares[f.name]}
                                                       if f.name in manifest.shares else {})} for f in manifest.files],
        "owned_bytes": sum(f.size for f in manifest.files if f.name not in manifest.shares),
        "shared_bytes": sum(f.size for f in manifest.files if f.name in manifest.shares), "versions": manifest.versions,
        "parent": manifest.parent, "data": manifest.data, "metrics": manifest.metrics, "compute": manifest.compute,
        "clocks": state.get("clocks"), "counters": state.get("counters"), "facts": state.get("facts"),
        "contract": state.get("contract"), "history": state.get("history"),
        "components": {n: ({**c, "state": inspecting.tree(c.get("state"), layouts, shared, n)} if type(c) is dict
                           else c) for n, c in raw.items()},
        "shared_tensors": list(shared.values()),
        "tensor_bytes": sum(v["bytes"] for v in layouts.values()),
        # a multi-rank generation: its world size, the components sharded through DCP (modules, optimizers) and
        # those each rank keeps its own of (a data position); their tensors are in the rank and shard files
        "sharded": _sharded_summary(state.get("sharded")),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for line in _inspect_lines(report, manifest, states, layouts, shared):
        print(line)
    return 0


def _sharded_summary(sharded: Any) -> dict[str, Any] | None:
    if type(sharded) is not dict or type(sharded.get("components")) is not dict:
        return None
    local = sharded.get("rank_local") if type(sharded.get("rank_local")) is dict else {}
    return {"world_size": sharded.get("world_size"),
            "components": {n: {k: d.get(k) for k in ("kind", "type", "owner")}
                           for n, d in sharded["components"].items() if type(d) is dict},
            "per_rank": list(local.get("components") or [])}


def _inspect_lines(report: dict[str, Any], manifest: Any, states: dict[str, Any], layouts: dict[str, Any],
                   shared: dict[str, list[str]]) -> list[str]:
    lines = [f"{report['generation']}  kind={report['kind']}  next_update={report['next_update']}  "
             f"created={report['created']}", f"clocks: {report['clocks']}  counters: {report['counters']}"]
    if report["sharded"]:
        sharded = report["sharded"]
        lines.append(f"saved by {sharded['world_size']} ranks: sharded "
                     + ", ".join(f"{n} ({d['kind']} {d['type']})" for n, d in sharded["components"].items())
                     + (f"; per rank: {', '.join(sharded['per_rank'])}" if sharded["per_rank"] else ""))
    if report["parent"]:
        lines.append(f"parent: {report['parent']}")
    if report["shared_bytes"]:  # an incremental generation: files linked from the generations that wrote them
        lines.append(f"bytes: {report['owned_bytes']:,} its own, {report['shared_bytes']:,} shared ("
                     + ", ".join(f"{f['name']} from {f['shared_from']}" for f in report["files"] if "shared_from" in f)
                     + ")")
    if report["metrics"]:
        lines.append(f"metrics: {report['metrics']}")
    lines.append(inspecting.compute_line(report["compute"]))
    for name, pos in manifest.data.items():
        lines.append(f"data {name}: epoch {pos['epoch']}, next batch {pos['cursor']} of {pos['batches_per_epoch']}, "
                     f"samples seen {pos['samples_seen']:,}, tokens seen {pos['tokens_seen']:,}, "
                     f"next-batch fingerprint {pos['next_batch']}")
    if report["facts"]:
        lines += ["facts:"] + inspecting.render(report["facts"], layouts, {}, "  ")
    names = sum(len(p) for p in shared.values())
    lines.append(f"tensor data: {report['tensor_bytes']:,} bytes in {len(layouts)} tensors"
                 + (f" ({names} names share {len(shared)} of them: tied)" if shared else ""))
    for name, comp in (report["components"] or {}).items():
        lines.append(f"{name}  ({comp.get('type') if type(comp) is dict else '?'})")
        lines += inspecting.render(states.get(name), layouts, shared, "  ", name)
    fields = (report["contract"] or {}).get("fields", {}) if type(report["contract"]) is dict else {}
    return lines + ["contract:"] + inspecting.contract_lines(fields)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.nodes is not None:
        from .demo import NODES_KILLS, run_nodes_demo

        if args.ranks is None:
            raise InvalidArgument("--nodes needs --ranks, the total number of ranks split evenly over the nodes "
                                  "(e.g. --ranks 2 --nodes 2: 2 nodes of 1 rank)")
        return run_nodes_demo(args.ranks, args.nodes, directory=args.dir, seed=args.seed,
                              kills=NODES_KILLS if args.kills is None else args.kills, json_output=args.json)
    if args.ranks is not None:
        from .demo import RANKS_KILLS, run_ranks_demo

        return run_ranks_demo(args.ranks, directory=args.dir, seed=args.seed,
                              kills=RANKS_KILLS if args.kills is None else args.kills, json_output=args.json)
    return run_demo(directory=args.dir, seed=args.seed, kills=6 if args.kills is None else args.kills,
                    json_output=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainstate", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list generations, their state and which is latest")
    p.add_argument("directory", help="the run directory")
    p.add_argument("--full", action="store_true", help="verify every file's digest, not just structure")
    p.add_argument("--quick", action="store_true", help="judge the recovery point by structure only (no digests "
                   "read; it is then labelled unchecked)")
    p.add_argument("--timeline", action="store_true", help="draw the run's lineage: timelines, forks, and what "
                   "each retention rule keeps")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("verify", help="verify every committed generation of a run, or every file of a release "
                       "bundle (exit 1 on any failure)", description=VERIFY_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="a run directory, one generation directory, or a release bundle (a directory "
                   "`trainstate export` wrote, holding release-manifest.json)")
    p.add_argument("--rehearse", metavar="FACTORY", default=None,
                   help="module:function returning a fresh TrainState; restore the latest (or the given) "
                   "generation into it, as a restart would, without touching any live run")
    authenticity.add_flag(p)
    progress.add_flag(p)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("inspect", help="show a generation's components, clocks and contract (no tensor data read)")
    p.add_argument("generation", help="a generation directory, or a run directory for its newest")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("demo", help="train, SIGKILL at random moments, resume, and compare bitwise")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    p.add_argument("--seed", type=int, default=None, help="seed for the kill schedule (default: random)")
    p.add_argument("--kills", type=int, default=None,
                   help="how many SIGKILLs to deliver (default: 6; with --ranks, 2; with --nodes, 3)")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="run the drill under torchrun with N ranks (FSDP2 over gloo); each kill takes down the launch")
    p.add_argument("--nodes", type=int, default=None, metavar="M",
                   help="with --ranks N: split the N ranks evenly over M torchrun agents of this host (c10d "
                   "rendezvous on 127.0.0.1), each a node with its own directory (node-local tiers, replicas=2); "
                   "each kill takes down every agent, and half the kills (rounded up) also delete one node's "
                   "directory, as a lost machine would (default kills: 3)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("discard", help="delete set-aside (rejected or abandoned) generations after review, or the "
                       "checkpoint folders the Hugging Face callback set aside")
    p.add_argument("directory", help="a run directory, or a Hugging Face Trainer output directory")
    p.add_argument("names", nargs="*", help="set-aside entries, as `trainstate ls` lists them; in a Hugging Face "
                   "output directory, incomplete-checkpoint-N-<hex> / abandoned-checkpoint-N-<hex> folders (with "
                   "none given, the error lists them)")
    p.add_argument("--all", action="store_true", help="every rejected and abandoned entry (Hugging Face: every "
                   "set-aside folder; checkpoint-N folders are never touched)")
    p.add_argument("--mode", choices=("run", "hf"), default=None, help="what DIRECTORY is, where it holds both a "
                   "run and the Hugging Face callback's folders (default: from what it holds; a stray checkpoint-N "
                   "folder in a run directory does not make it an output directory)")
    p.set_defaults(func=cmd_discard)
    cli_lifecycle.register(sub)
    cli_copy.add_parser(sub)
    cli_cost.add_parser(sub)
    cli_diff.add_parser(sub)
    cli_doctor.add_parser(sub)
    cli_export.add_parser(sub)
    cli_nodes.add_parser(sub)
    cli_supervise.add_parsers(sub)
    for p in sub.choices.values():
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(broken_pipe_status=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `trainstate inspect DIR | head`: the reader has what it wanted
        _silence_stdout()
        return args.broken_pipe_status
    except (TrainStateError, OSError, ValueError, KeyError) as exc:
        if isinstance(exc, KeyError) and exc.args:
            exc = ValueError(exc.args[0])  # KeyError's str() adds quotes
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        else:
            print(f"trainstate {args.command}: {exc}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
