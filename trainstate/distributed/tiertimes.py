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
measurement, never an error: the numbers are advice, not state. Beside them, ``config`` records how the
run is tiered (:func:`configure`, at each start), which ``trainstate cost`` prices.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

TIMINGS = "tier-timings.json"
KINDS = ("save_local", "replicate", "upload", "restore_local", "restore_peer", "restore_remote")
KEEP = 32
CONFIG_KEYS = ("nodes", "ranks", "domains", "replicas", "keep_last", "mirror_every", "remote_keep")
log = logging.getLogger("trainstate")


def _raw(store: Any) -> dict[str, Any]:
    try:
        data = store.read_pointer(TIMINGS)
        raw = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) and raw.get("format") == "trainstate-tier-timings" else {}


def read_config(store: Any) -> dict[str, int]:
    """How the run was tiered, as its last start recorded it (:func:`configure`); ``{}`` when unknown."""
    config = _raw(store).get("config")
    if not isinstance(config, dict):
        return {}
    return {k: v for k, v in config.items() if k in CONFIG_KEYS and type(v) is int and v >= 0}


def configure(store: Any, config: dict[str, int]) -> None:
    """Record the run's tiering (nodes, ranks, failure domains, replicas, keep_last, mirror_every, remote_keep;
    0 where there is no remote) beside the samples, for ``trainstate cost`` (best effort, as :func:`record`)."""
    try:
        store.write_pointer(TIMINGS, json.dumps({"format": "trainstate-tier-timings", **read(store),
                                                 "config": config}).encode())
    except OSError as exc:
        log.warning("could not record the tiering in %s (%r)", store.location, exc)


def read(store: Any) -> dict[str, list[list[float]]]:
    """The samples by kind (empty lists where none), from a node's store; ``{}`` kinds on any damage."""
    out: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    raw = _raw(store)
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
        config = read_config(store)
        store.write_pointer(TIMINGS, json.dumps({"format": "trainstate-tier-timings", **samples,
                                                 **({"config": config} if config else {})}).encode())
    except OSError as exc:
        log.warning("could not record a %s timing in %s (%r)", kind, store.location, exc)


def restore_kind(sources: dict[str, int]) -> str:
    """The farthest source a restore read from."""
    return "restore_remote" if sources.get("remote") else "restore_peer" if sources.get("peer") else "restore_local"
