"""What ``trainstate verify`` authenticated, said on its exit line, and ``--require-signature``.

Digests detect accidents; only a signature checked with the key detects a
forgery (whoever can rewrite a file can rewrite its digest). Without a key a
signed target still verifies, so the exit line says that nothing was
authenticated, and ``--require-signature`` turns that into a failure for CI
jobs that must not pass an unauthenticated release or run.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..format.manifest import MANIFEST, MAX_JSON_BYTES
from ..format.signing import ENV_KEY, ENV_KEY_FILE
from ..storage.base import Store
from ..storage.verify import read_bounded

VERIFIED, NOT_CHECKED, ABSENT = "verified", "present, not checked", "absent"
KEY_FIX = (f"set {ENV_KEY} (the key itself) or {ENV_KEY_FILE} (a file holding it, outside the checked "
           "directory) to the key it was signed with")


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--require-signature", action="store_true",
                        help="fail (exit 1) unless a signature was checked with the key: an unsigned target, or a "
                        f"signed one verified without a key ({ENV_KEY} / {ENV_KEY_FILE}), is refused")


def status(signed: bool, key_given: bool) -> str:
    """With a key, whatever verified was authenticated (an unsigned or forged target fails the check itself)."""
    if key_given:
        return VERIFIED
    return NOT_CHECKED if signed else ABSENT


def phrase(state: str) -> str:
    """The exit line's account of the signature."""
    if state == VERIFIED:
        return "signature verified"
    if state == NOT_CHECKED:
        return "signature present but NOT checked (no key given): nothing was authenticated"
    return "unsigned: nothing was authenticated"


def required(state: str, what: str) -> str | None:
    """Why ``--require-signature`` refuses ``what`` (None: its signature was checked), naming the fix."""
    if state == NOT_CHECKED:
        return f"{what} is signed, but no key was given to check it, and --require-signature asks for that: {KEY_FIX}"
    if state == ABSENT:
        return (f"{what} is not signed, and --require-signature asks for a checked signature: write it with a "
                f"signing key configured (signing_key=, {ENV_KEY}) and verify it with the same key")
    return None


def run_signed(store: Store, names: list[str]) -> bool:
    """Whether any of the generations carries a signature (read from the raw manifests, which the parsed
    manifest drops); an unreadable manifest counts as unsigned, verify reports it on its own."""
    for name in names:
        try:
            with store.open(name, MANIFEST) as stream:
                body: Any = json.loads(read_bounded(stream, MAX_JSON_BYTES))
        except (OSError, ValueError):
            continue
        if type(body) is dict and "signature" in body:
            return True
    return False
