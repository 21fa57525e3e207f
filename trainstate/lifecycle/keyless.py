"""A run whose generations are signed, opened without the signing key.

Without a key a manager neither writes nor checks signatures. On a signed
run it would save unsigned generations and move ``latest`` to them; the next
restart with the key refuses them (they are not signed) and resumes the older
signed generation, so the work saved in between is lost, and nothing said so.
A manager opened without the key on a signed run therefore refuses, by
name (:class:`SigningKeyRequired`), unless it was given ``signing_key=False``:
the deliberate choice to go on unsigned, logged as a warning.

Checked when the manager opens (:func:`check`, before anything is restored
or trained), and again before the first save of each timeline
(:func:`refuse`, from :func:`trainstate.lifecycle.runs.check_same_run`),
which also covers generations a restore brought in (a mirror's) and, under
``torch.distributed``, makes rank 0's verdict every rank's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from ..errors import CorruptGeneration, SigningKeyRequired
from ..format.manifest import MANIFEST, POINTER, WEIGHTS_POINTER, parse_generation_name
from ..format.signing import ENV_KEY, ENV_KEY_FILE
from ..storage.base import Store
from .generations import Lifecycle

log = logging.getLogger("trainstate")


def check(lifecycle: Lifecycle, signing_key: object) -> None:
    """At open: record whether the caller chose to go on unsigned (``signing_key=False``), then :func:`refuse`.

    One line in the manager's constructor, right after its :class:`Lifecycle` exists.
    """
    lifecycle.allow_unsigned = signing_key is False
    if lifecycle.key is None and lifecycle.allow_unsigned:
        signed = signed_record(lifecycle)
        if signed is not None:
            log.warning("%s: a signed run (its %s is signed) opened with signing_key=False: signatures are not "
                        "checked, and what this manager saves is unsigned (a restore with the key refuses it)",
                        lifecycle.store.location, signed)
        return
    refuse(lifecycle, "opened", manifest=False)  # the pointers only: one small read more per open, no manifest


def refuse(lifecycle: Lifecycle, doing: str = "saving", command: bool = False, manifest: bool = True) -> None:
    """Raise :class:`SigningKeyRequired` when ``lifecycle`` has no key, the run is signed, and going on unsigned
    was not chosen; ``doing``: what the message says was being done; ``command``: by the command line (whose
    key comes only from the environment); ``manifest``: see :func:`signed_record`."""
    if lifecycle.key is not None or lifecycle.allow_unsigned:
        return
    signed = signed_record(lifecycle, manifest)
    if signed is None:
        return
    location = lifecycle.store.location
    what = ("pins written without it would be unsigned, and a manager with the key refuses an unsigned pins file "
            "(its prune stops)" if command else
            "saved without it, generations would be unsigned and latest would move to them; the next restore with "
            "the key refuses them and resumes the older signed generation, losing the work saved in between")
    how = f"set {ENV_KEY} (the key) or {ENV_KEY_FILE} (a file outside the run directory holding it)"
    raise SigningKeyRequired(
        f"{location} is a signed run (its {signed} carries a signature), {doing} without the signing key: {what}. "
        + (f"Give the key the run was saved with: {how}." if command else
           f"Give the key the run was saved with: CheckpointManager({location!r}, signing_key=...), or {how}. To "
           "save this run unsigned from now on, deliberately, pass signing_key=False."))


def signed_record(lifecycle: Lifecycle, manifest: bool = False) -> str | None:
    """What shows the run is signed now: ``latest`` (else ``latest-weights``) when the pointer carries a signature;
    with ``manifest``, also the manifest an unsigned pointer names (a keyless mirror pull writes its own pointer
    beside the signed generations it brought). A record that does not parse says nothing either way (restore
    reports it)."""
    for name in (POINTER, WEIGHTS_POINTER):
        record = _record(lambda: lifecycle.store.read_pointer(name))
        if record is None:
            continue
        if "signature" in record:
            return name
        generation = record.get("generation")
        if manifest and isinstance(generation, str) and parse_generation_name(generation) is not None:
            named = _record(lambda: _read(lifecycle.store, generation))
            if named is not None and "signature" in named:
                return f"{generation}/{MANIFEST}, which {name} names,"
        return None
    return None


def _record(read: Callable[[], bytes | None]) -> dict | None:
    """A JSON object as ``read`` returns it, or None (absent, unreadable or not an object)."""
    try:
        data = read()
        record = json.loads(data) if data is not None else None
    except (CorruptGeneration, OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _read(store: Store, generation: str) -> bytes:
    with store.open(generation, MANIFEST) as stream:
        return stream.read()
