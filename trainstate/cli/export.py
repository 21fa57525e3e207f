"""``trainstate export GENERATION OUT``: one component's weights as safetensors, with a model card, for release.

Registered by :mod:`trainstate.cli.main` through :func:`add_parser`; the work is
:func:`trainstate.tools.export.export`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

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
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """Export, then print what was written."""
    info = export(args.generation, args.out, component=args.component, dtype=args.dtype,
                  max_shard_size=args.max_shard_size)
    if args.json:
        print(json.dumps({"directory": info.directory, "generation": info.generation, "files": list(info.files),
                          "total_bytes": info.total_bytes, "shards": info.shards,
                          "tied": {k: list(v) for k, v in info.tied.items()}, "dtype": info.dtype}, indent=1))
    else:
        print(f"exported {args.component} of {info.generation} to {info.directory}: {info.shards} file(s), "
              f"{info.total_bytes} bytes of tensors, dtype {info.dtype or 'as trained'}")
        for kept, names in sorted(info.tied.items()):
            print(f"  {kept} stored once, re-tied on load to {', '.join(names)}")
    return 0
