"""The DONE record: a run is finished when a record binds its final generation, not when a file exists.

``CheckpointManager.finish`` publishes the final full generation and then
writes ``DONE`` in the run directory through the store's pointer write (local:
temp file, fsync, ``os.replace``, fsync of the directory; object stores: one
atomic put). The record names the run identity, the final generation and its
manifest digest and size, ``next_update``, ``tokens_seen``, the contract
fingerprint (the manifest's own, computed as every save computes it), the
time, the final metrics and, when a signing key is configured, an HMAC.

:func:`check` verifies a record against the directory: the generation it names
exists, verifies (every byte, unless ``content=False``) and is the one a
restart would resume from; its manifest digest, update, token count, run and
contract fingerprint agree with the record; and, when given, the current
contract (``state=``) or config (``config=``) is the one it finished with. A
record that fails any of these is *stale*, never done: a finished run whose
config changed, or whose final generation was damaged, replaced or trained
past, has not finished what is being asked of it now.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptGeneration, InvalidArgument, UnsupportedValue
from ..format.manifest import POINTER, RUN, load_json, parse_generation_name, parse_pointer, parse_run
from ..format.signing import SigningKey
from ..state import contract as contract_mod
from ..storage.base import Store
from ..storage.verify import read_manifest, read_state_json, verify_generation

DONE = "DONE"
FORMAT = "trainstate-done"
FORMAT_VERSION = 1
_FIELDS = {"format": str, "format_version": int, "run": str, "generation": str, "manifest_digest": str,
           "manifest_size": int, "digest_algorithm": str, "next_update": int, "tokens_seen": int,
           "contract_fingerprint": str, "created": str, "metrics": dict}


@dataclass(frozen=True)
class DoneRecord:
    """What ``finish`` bound together: the run, its final generation, its clocks and its contract."""

    run: str
    generation: str
    manifest_digest: str
    manifest_size: int
    digest_algorithm: str
    next_update: int
    tokens_seen: int
    contract_fingerprint: str
    created: str  # ISO 8601, UTC
    metrics: dict = field(default_factory=dict)

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """The record as written to ``DONE``: sorted JSON, signed with ``key`` when one is given."""
        data = {"format": FORMAT, "format_version": FORMAT_VERSION, **dataclasses.asdict(self)}
        if key is not None:
            data["signature"] = key.sign(data)
        return json.dumps(data, indent=1, sort_keys=True).encode() + b"\n"

    def to_json(self) -> dict:
        """The fields as plain JSON-able data."""
        return dataclasses.asdict(self)


def on_rank0(session: Any, work: Callable[[], DoneRecord | None], phase: str) -> DoneRecord | None:
    """``work()`` on rank 0 only (every process when ``session`` is None: one process); its record, or None, on
    every rank (a multi-rank :class:`~trainstate.distributed.session.Session`'s broadcast)."""
    record = work() if session is None or session.rank == 0 else None
    if session is not None:
        record = session.fg.broadcast(record and record.to_json(), phase)
        record = record and DoneRecord(**record)
    return record


def parse(data: bytes, key: SigningKey | None = None) -> DoneRecord:
    """A DONE record's bytes, strictly: every field present with its type, nothing unknown, signed when keyed."""
    raw = load_json(data, DONE)
    unknown = set(raw) - set(_FIELDS) - {"signature"}
    missing = [k for k, t in _FIELDS.items() if type(raw.get(k)) is not t]
    if unknown or missing:
        raise CorruptGeneration(DONE, f"malformed: missing or mistyped {missing!r:.120}, "
                                      f"unknown {sorted(unknown)!r:.120}")
    if raw["format"] != FORMAT or raw["format_version"] != FORMAT_VERSION:
        raise CorruptGeneration(DONE, f"not a {FORMAT} record of version {FORMAT_VERSION}")
    if key is not None:
        key.check(raw, raw.get("signature"), DONE)
    if parse_generation_name(raw["generation"]) != (raw["next_update"], "full"):
        raise CorruptGeneration(DONE, f"names {raw['generation']!r:.60}, which disagrees with its next_update")
    return DoneRecord(**{k: raw[k] for k in _FIELDS if k not in ("format", "format_version")})


def record_for(manifest: Any, manifest_digest: str, manifest_size: int, tokens_seen: int,
               metrics: Mapping[str, float] | None) -> DoneRecord:
    """The record binding a verified final generation (pure)."""
    clean = {}
    for name, value in (metrics or {}).items():
        if type(name) is not str or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise InvalidArgument(f"finish(metrics=...): {name!r} must name a finite number, got {value!r}")
        clean[name] = float(value)
    return DoneRecord(manifest.run, manifest.generation, manifest_digest, manifest_size, manifest.digest_algorithm,
                      manifest.next_update, tokens_seen, manifest.contract_fingerprint,
                      datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"), clean)


def write(store: Store, key: SigningKey | None, generation: str, tokens_seen: int,
          metrics: Mapping[str, float] | None = None, holding: Callable[[str], Any] | None = None) -> DoneRecord:
    """Write the DONE record for the published full ``generation``, durably, then read it back and check it.

    The generation is verified (structure; its bytes were read back when it
    was published) before the record names it; ``holding``: how a node of a
    tiered run checks the part of it that it holds, instead.
    """
    if holding is None:
        verified = verify_generation(store, generation, content=False, key=key)
        manifest, digest, size = verified.manifest, verified.manifest_digest, verified.manifest_size
    else:
        manifest, digest, size = read_manifest(store, generation, None, key)
        holding(generation)
    if manifest.kind != "full":
        raise InvalidArgument(f"{generation} is weights-only; a run finishes on a full generation")
    record = record_for(manifest, digest, size, tokens_seen, metrics)
    data = record.to_bytes(key)
    store.write_pointer(DONE, data)  # temp file, fsync, replace, fsync of the directory (or an atomic put)
    if store.read_pointer(DONE) != data or parse(data, key) != record:
        raise CorruptGeneration(DONE, "reads back differently from what was written; the run is not marked done")
    return record


@dataclass(frozen=True)
class DoneStatus:
    """The verdict on a run directory's DONE record: ``"done"``, ``"stale"`` or ``"missing"``.

    True only when done. ``reason`` says why a record is stale.
    """

    status: str
    record: DoneRecord | None = None
    reason: str = ""

    def __bool__(self) -> bool:
        return self.status == "done"

    def to_json(self) -> dict:
        """``status``, ``reason`` and the record (or ``None``) as plain JSON-able data."""
        return {"status": self.status, "reason": self.reason,
                "record": self.record.to_json() if self.record is not None else None}


def read(store: Store, key: SigningKey | None) -> tuple[DoneRecord | None, str]:
    """The record, or ``None`` and why not (an empty reason: there is none)."""
    try:
        data = store.read_pointer(DONE)
        if data is None:
            return None, ""
        return parse(data, key), ""
    except CorruptGeneration as exc:
        return None, f"the record itself is unusable: {exc.reason}"


def check(store: Store, key: SigningKey | None, *, state: Any = None, config: Any = None,
          content: bool = True) -> DoneStatus:
    """Whether the run in ``store`` is done (see the module docstring); never raises for a bad record."""
    record, problem = read(store, key)
    if record is None:
        return DoneStatus("stale", None, problem) if problem else DoneStatus("missing")
    problem = _problem(store, key, record, content)
    if not problem and state is not None:
        live = contract_mod.digest(state.contract_fields())
        if live != record.contract_fingerprint:
            problem = "the contract (config, architecture, data) of this run differs from the one it finished with"
    if not problem and config is not None:
        problem = _config_problem(store, key, record, config)
    return DoneStatus("stale" if problem else "done", record, problem)


def _problem(store: Store, key: SigningKey | None, record: DoneRecord, content: bool) -> str:
    """Why ``record`` does not hold for the directory, or ``""``."""
    try:
        run = store.read_pointer(RUN)
        if run is not None and parse_run(run, RUN, key) != record.run:
            return "it belongs to another run (copied in from another run directory)"
    except CorruptGeneration as exc:
        return f"the run identity record is unusable ({exc.reason})"
    if record.generation not in store.generations():
        return f"it names {record.generation}, which no longer exists"
    try:
        verified = verify_generation(store, record.generation, content=content, key=key)
        tokens_seen = read_state_json(store, verified.manifest)["clocks"]["tokens_seen"]
    except CorruptGeneration as exc:
        return f"it names {record.generation}, which no longer verifies: {exc}"
    m = verified.manifest
    if (verified.manifest_digest, verified.manifest_size) != (record.manifest_digest, record.manifest_size):
        return f"{record.generation}'s manifest digest differs from the record's (replaced, or the record altered)"
    if (m.next_update, m.run, m.contract_fingerprint) != (record.next_update, record.run, record.contract_fingerprint):
        return f"the record's update, run or contract fingerprint disagrees with {record.generation}'s manifest"
    if tokens_seen != record.tokens_seen:
        return f"the record's tokens_seen disagrees with {record.generation}'s state"
    return _latest_problem(store, key, record)


def _latest_problem(store: Store, key: SigningKey | None, record: DoneRecord) -> str:
    """The record must name what a restart resumes from: a newer full generation means training went on."""
    newer = [n for n in store.generations() if parse_generation_name(n)[1] == "full"
             and parse_generation_name(n)[0] > record.next_update]
    try:
        data = store.read_pointer(POINTER)
        latest = parse_pointer(data, POINTER, key).generation if data is not None else None
    except CorruptGeneration:
        latest = None
    if latest is not None and latest != record.generation:
        return f"latest names {latest}, not {record.generation}: the run went on (or back) after it finished"
    if latest is None and newer:
        return f"{newer[0]} is newer than {record.generation}: the run went on after it finished"
    return ""


def _config_problem(store: Store, key: SigningKey | None, record: DoneRecord, config: Any) -> str:
    try:
        wanted = contract_mod.canonical(config, "config")
    except UnsupportedValue as exc:  # the caller's config, not the record, is at fault
        raise InvalidArgument(f"config is not JSON-like: {exc}") from None
    try:
        manifest = verify_generation(store, record.generation, content=False, key=key).manifest
        saved = read_state_json(store, manifest)["contract"]["fields"].get("config", "<absent>")
    except CorruptGeneration as exc:
        return f"it names {record.generation}, which no longer verifies: {exc}"
    if saved != wanted:
        changes = contract_mod.compare({"config": saved}, {"config": wanted})
        named = ", ".join(c.field for c in changes[:5]) + (" ..." if len(changes) > 5 else "")
        return f"it finished with another config (differs in {named})"
    return ""


def for_restore(store: Store, key: SigningKey | None, info: Any, state: Any) -> DoneRecord | None:
    """The DONE record when it names exactly the generation ``info`` says was just restored into ``state``.

    Restore has verified every byte of that generation and compared its
    contract with the live one: with no change accepted, the live contract is
    the one the record binds (multi-rank fields included). After a deliberate
    change (``allow_changes``) the run continues under the new contract.
    """
    record, _ = read(store, key)
    generation = info.generation
    if record is None or record.generation != generation.name or record.manifest_digest != generation.manifest_digest:
        return None
    if (record.next_update, record.tokens_seen) != (state.next_update, state.tokens_seen) or info.contract_changes:
        return None
    try:
        manifest = verify_generation(store, record.generation, content=False, key=key).manifest
    except CorruptGeneration:
        return None  # pruned or replaced since the restore read it
    return record if manifest.contract_fingerprint == record.contract_fingerprint else None


def done(directory: str, *, state: Any = None, config: Any = None, signing_key: SigningKey | bytes | str | None = None,
         content: bool = True, storage_options: dict[str, Any] | None = None) -> DoneStatus:
    """Whether the run in ``directory`` (a path or object-store URL) finished, by its DONE record.

    >>> status = ts.done("runs/exp1", config=cfg)
    >>> if status: print("finished at", status.record.generation)
    ... else: print(status.status, status.reason)       # "missing", or "stale" and why

    ``state`` (a :class:`TrainState`) checks the whole contract; ``config``
    only its ``config`` field. ``content=False`` checks the final
    generation's structure and sizes instead of reading every byte. The
    signing key comes from ``signing_key`` or the environment, as for the manager.
    """
    from ..format import signing
    from ..storage.locate import open_store

    store = open_store(directory, storage_options=storage_options, create=False)
    return check(store, signing.resolve(signing_key, directory), state=state, config=config, content=content)
