"""``trainstate export GENERATION OUT``: one component's weights as safetensors, a model card and the included
files, with a release manifest, for release.

Registered by :mod:`trainstate.cli.main` through :func:`add_parser`; the work is
:func:`trainstate.tools.export.export`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import progress
from . import authenticity
from ..errors import TrainStateError
from ..format import signing
from ..tools.bundle import is_bundle as _is_bundle, verify_bundle
from ..lifecycle.rehearsal import load_factory
from ..tools.export import DTYPES, export


def add_parser(sub: Any) -> None:
    """Register ``trainstate export`` on the subcommand set (``--json`` is added by the caller for every command)."""
    p = sub.add_parser("export", help="write a verified generation's weights as safetensors (Hugging Face layout) "
                       "with a model card")
    p.add_argument("generation", help="a generation directory, or a run directory for its recovery point")
    p.add_argument("out", help="the new directory to publish (absent or empty; never overwritten)")
    p.add_argument("--component", default="model", help="the module to export (default: model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast floating-point tensors (integer and bool buffers keep theirs); default: as trained")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="split into model-0000i-of-0000N.safetensors shards above SIZE (e.g. 5GB, 500MiB)")
    p.add_argument("--include", action="append", default=[], metavar="PATH",
                   help="copy a file, or a directory's files, into OUT (tokenizer files, generation_config.json, "
                   "a license); repeatable")
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help="a Hugging Face config.json (or a directory holding one) to write beside the weights; by "
                   "default the contract's 'config' field when it has a 'model_type'")
    p.add_argument("--mapping", default=None, metavar="MODULE:FUNCTION",
                   help="rename the tensors for another layout: a function given the generation's state.json that "
                   "returns the mapping (e.g. trainstate.integrations.torchtitan:hf_mapping, Hugging Face names "
                   "for a torchtitan model)")
    progress.add_flag(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Export, then print what was written."""
    with progress.bar(None, "export", args.progress) as shown:
        info = export(args.generation, args.out, component=args.component, dtype=args.dtype,
                      max_shard_size=args.max_shard_size, include=args.include, hf_config=args.hf_config,
                      on_bytes=shown.update, mapping=load_factory(args.mapping) if args.mapping else None)
    if args.json:
        print(json.dumps({"directory": info.directory, "generation": info.generation, "files": list(info.files),
                          "total_bytes": info.total_bytes, "shards": info.shards,
                          "tied": {k: list(v) for k, v in info.tied.items()}, "dtype": info.dtype,
                          "world_size": info.world_size, "config": info.config, "included": list(info.included),
                          "signed": info.signed}, indent=1))
    else:
        print(f"exported {args.component} of {info.generation} ({info.world_size} rank(s)) to {info.directory}: "
              f"{info.shards} file(s), {info.total_bytes} bytes of tensors, dtype {info.dtype or 'as trained'}"
              + (", config.json" if info.config else "") + (f", {len(info.included)} included file(s)"
                                                             if info.included else ""))
        print(f"  release manifest {'signed' if info.signed else 'unsigned'}: check with `trainstate verify "
              f"{info.directory}`")
        for kept, names in sorted(info.tied.items()):
            print(f"  {kept} stored once, re-tied on load to {', '.join(names)}")
    return 0


def is_bundle(target: str) -> bool:
    """Whether ``trainstate verify TARGET`` names a release bundle (a local directory with a release manifest)."""
    return "://" not in target and _is_bundle(target)


def cmd_verify_bundle(args: argparse.Namespace) -> int:
    """Check every file of a release bundle against its manifest (and its signature, when a key is configured:
    ``TRAINSTATE_SIGNING_KEY`` or ``TRAINSTATE_SIGNING_KEY_FILE``); exit 1 naming each bad file, and with
    ``--require-signature`` unless the signature was checked."""
    failures: list[dict[str, str]] = []
    files: tuple[str, ...] = ()
    signed = checked = False
    signature: str | None = None  # unknown while the manifest itself does not verify
    try:
        report = verify_bundle(args.target, signing.resolve(None, args.target))
        files, signed, checked = report.files, report.signed, report.signature_checked
        signature = authenticity.status(signed, checked)
        failures = [{"file": name, "error": problem} for name, problem in report.problems.items()]
    except (TrainStateError, OSError) as exc:
        failures.append({"file": "release-manifest.json", "error": str(exc)})
    refused = authenticity.required(signature, f"release bundle {args.target}") \
        if args.require_signature and signature else None
    if refused:
        failures.append({"file": "release-manifest.json", "error": refused})
    bad = {f["file"] for f in failures}
    verified = [name for name in files if name not in bad]
    args.broken_pipe_status = 1 if failures else 0
    if args.json:
        print(json.dumps({"bundle": args.target, "verified": verified, "failures": failures, "signed": signed,
                          "signature_checked": checked, "signature": signature,
                          "authenticated": signature == authenticity.VERIFIED and not failures}, indent=1))
    else:
        for name in verified:
            print(f"ok      {name}")
        for failure in failures:
            print(f"FAILED  {failure['file']}: {failure['error']}")
        if not failures:
            print(f"ok: release bundle {args.target}: {len(verified)} file(s) match the manifest; "
                  + authenticity.phrase(signature))
    return 1 if failures else 0
