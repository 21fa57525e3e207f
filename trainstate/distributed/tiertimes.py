"""What a tiered run measured: how long each tier's save and each kind of restore took, kept in the node's directory.

``<node dir>/tier-timings.json`` (written by each node's leader, replaced
atomically like a pointer) holds, per kind, the last :data:`KEEP` samples
``[seconds, bytes, unix time]``:

- ``save_local``: the blocking part of a save, as the manager's clock measures it (the capture, any wait for
  the previous save's replicas, the local tier's commit; for a background save, the copy);
- ``replicate``: copying every node's files to their replicas (background);
- ``upload``: putting a generation on the remote tier (background);
- ``restore_local`` / ``restore_peer`` / ``restore_remote``: a whole restore,
  filed under the farthest source it read from (own disk only; some bytes
  from peers; some from the object store), with the bytes it loaded.

``trainstate cadence --run NODE_DIR`` reads it to compute each tier's interval, the expected
lost work and the recovery time per failure class from these measurements
(:mod:`trainstate.lifecycle.sla`; the uploads are timed on rank 0's node only). A missing or damaged record is no
measurement, never an error: the numbers are advice, not state.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

TIMINGS = "tier-timings.json"
KINDS = ("save_local", "replicate", "upload", "restore_local", "restore_peer", "restore_remote")
KEEP = 32
log = logging.getLogger("trainstate")


def read(store: Any) -> dict[str, list[list[float]]]:
    """The samples by kind (empty lists where none), from a node's store; ``{}`` kinds on any damage."""
    out: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    try:
        data = store.read_pointer(TIMINGS)
        raw = json.loads(data) if data else {}
    except (OSError, ValueError):
        return out
    if not isinstance(raw, dict) or raw.get("format") != "trainstate-tier-timings":
        return out
    for kind in KINDS:
        samples = raw.get(kind)
        if isinstance(samples, list):
            out[kind] = [s for s in samples if isinstance(s, list) and len(s) == 3
                         and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in s)]
    return out


def record(store: Any, kind: str, seconds: float, nbytes: int) -> None:
    """Add one sample (best effort: a failure to record is logged, never raised)."""
    try:
        samples = read(store)
        samples[kind] = (samples[kind] + [[round(seconds, 6), int(nbytes), round(time.time(), 3)]])[-KEEP:]
        store.write_pointer(TIMINGS, json.dumps({"format": "trainstate-tier-timings", **samples}).encode())
    except OSError as exc:
        log.warning("could not record a %s timing in %s (%r)", kind, store.location, exc)


def restore_kind(sources: dict[str, int]) -> str:
    """The farthest source a restore read from."""
    return "restore_remote" if sources.get("remote") else "restore_peer" if sources.get("peer") else "restore_local"
