"""``trainstate copy SRC DST [GENERATION ...]``: upload or download generations between a run directory and an
object store (or between any two runs), every file checked against its manifest as it is copied.

Registered by :mod:`trainstate.cli.main` through :func:`add_parser`; the copy is
:func:`trainstate.lifecycle.mirror.copy_generation`, as the local-first mirror uses it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import progress
from ..errors import InvalidArgument
from ..format import signing
from ..format.manifest import POINTER, WEIGHTS_POINTER, generation_order
from ..lifecycle.mirror import copy_generation, same_run
from ..storage.base import Store
from ..storage.locate import open_existing, open_store
from ..storage.verify import point_at, read_manifest, read_pointed, verify_generation


def add_parser(sub: Any) -> None:
    """Register ``trainstate copy`` (``--json`` is added by the caller for every command)."""
    p = sub.add_parser("copy", help="copy generations between run directories and object stores (upload, "
                       "download), verifying as it copies; moves DST's pointer to a newer copy")
    p.add_argument("src", help="the run to copy from: a directory or a URL (s3://bucket/prefix)")
    p.add_argument("dst", help="the run to copy into: a directory (created if absent) or a URL; credentials and "
                   "endpoint from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
    p.add_argument("generations", nargs="*", metavar="GENERATION",
                   help="generation names (default: the one SRC's latest pointer names)")
    progress.add_flag(p)
    p.set_defaults(func=cmd_copy)


def _pointed(store: Store, pointer_file: str, key: Any) -> str | None:
    """The generation a pointer names, or None when absent or unreadable."""
    pointer = read_pointed(store, pointer_file, key)
    return None if pointer is None else pointer.generation


def cmd_copy(args: argparse.Namespace) -> int:
    src = open_existing(args.src)
    dst = open_store(args.dst)
    key = signing.resolve(None, src.location)
    names = list(args.generations) or [n for n in [_pointed(src, POINTER, key)] if n is not None]
    if not names:
        raise InvalidArgument(f"{src.location} has no valid latest pointer; name the generations to copy "
                              f"(`trainstate ls {src.location}` lists them)")
    unknown = sorted(set(names) - set(src.generations()))
    if unknown:
        raise InvalidArgument(f"{', '.join(unknown)}: not a generation of {src.location} "
                              f"(`trainstate ls {src.location}` lists them)")
    total = sum(f.size for n in names for f in read_manifest(src, n, None, key)[0].files)
    copied, skipped, moved = [], [], []
    dst.lock()  # a live run (or another copy) writing DST would race the pointer
    try:
        same_run(src, dst, key)
        dst.clean_leftovers()  # staging left by an interrupted copy
        with progress.bar(total, "copy", args.progress) as shown:
            for name in sorted(names, key=generation_order):
                if name in dst.generations():
                    verified = verify_generation(dst, name, content=False, key=key)
                    skipped.append(name)
                    shown.update(sum(f.size for f in verified.manifest.files))
                else:
                    verified = copy_generation(src, dst, name, key, on_bytes=shown.update)
                    copied.append(name)
                which = POINTER if verified.manifest.kind == "full" else WEIGHTS_POINTER
                current = _pointed(dst, which, key)
                if current is None or generation_order(name) > generation_order(current):
                    point_at(dst, verified, key)
                    moved.append(name)
    finally:
        dst.unlock()
    if args.json:
        print(json.dumps({"source": src.location, "destination": dst.location, "copied": copied,
                          "skipped": skipped, "pointer_moved_to": moved[-1:]}, indent=1))
    else:
        for name in copied:
            print(f"copied  {name}")
        for name in skipped:
            print(f"present {name} (already in {dst.location}, verified)")
        if moved:
            print(f"{dst.location}: pointer now names {moved[-1]}")
    return 0
