"""What the manager reports: published generations, restores, and the directory's status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import FieldChange, Rejection
from .storage.base import Store
from .storage.verify import Verified

if TYPE_CHECKING:
    from .lifecycle.done import DoneRecord


@dataclass(frozen=True)
class GenerationInfo:
    """A published generation."""

    name: str
    location: str
    kind: str
    next_update: int
    created: str
    size: int
    manifest_digest: str
    digest_algorithm: str
    devices: tuple[str, ...] = ()  # the device kinds its tensors lived on when saved; () when not recorded
    wall_s: float | None = None  # seconds of training summed over its lineage's updates; None when not recorded
    shared: int = 0  # of ``size``, the bytes of files linked from earlier generations (stored once, with theirs)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))  # a list after a broadcast between ranks

    @classmethod
    def from_verified(cls, store: Store, v: Verified) -> GenerationInfo:
        """The record of a generation the trusted reader verified in ``store``."""
        m = v.manifest
        return cls(m.generation, f"{store.location}/{m.generation}", m.kind, m.next_update, m.created,
                   v.manifest_size + sum(f.size for f in m.files), v.manifest_digest, m.digest_algorithm,
                   tuple(m.compute.get("devices", ())), m.compute.get("wall_s"),
                   sum(f.size for f in m.files if f.name in m.shares))


@dataclass(frozen=True)
class RestoreInfo:
    """What ``restore`` loaded, what it skipped and what it accepted.

    ``rejected``: every generation passed over, newest first, and why (a
    damaged one, a pointer rolled back, one a mirror pull skipped).
    ``sources`` (node-local tiers only, else ``None``): the bytes the restore
    took from each kind of source, summed over every rank of the job, and the
    same dict on every rank: ``"local"`` (read from a rank's own node's disk),
    ``"peer"`` (received from a rank on another node) and ``"remote"``
    (downloaded from the object store). A restart with every disk intact
    shows ``peer == remote == 0``.
    """

    generation: GenerationInfo
    rejected: tuple[Rejection, ...] = ()
    contract_changes: tuple[FieldChange, ...] = ()
    warnings: tuple[str, ...] = ()
    done: DoneRecord | None = None  # the run finished at this generation with this contract: exit at once
    sources: dict | None = None  # a tiered restore: {"local", "peer", "remote"} bytes, job totals on every rank

    @property
    def identical_continuation(self) -> bool:
        """False when a contract change was accepted or some randomness continues only statistically."""
        return not self.contract_changes and not self.warnings


@dataclass(frozen=True)
class Status:
    """What the run directory protects right now, and what the manager has measured.

    ``recovery_point`` is the full generation a restart would resume from:
    the one ``latest`` names, or, when that one is damaged, the newest that
    verifies (judged by structure; ``trainstate verify`` reads every byte). Weights-only generations never count as
    restart protection; ``latest_weights`` is reported on its own. With a mirror, ``mirror`` says what the
    remote ``latest`` names (the only remote protection), the lag behind local, and what is uploading.
    """

    directory: str
    recovery_point: str | None
    recovery_update: int | None
    latest_weights: str | None
    generations: int
    pins: dict[str, str]
    best: str | None
    last_save_s: float | None  # blocking time of the last save in this process
    mean_save_s: float | None
    mean_update_s: float | None  # between update boundaries, saves excluded (measured by due())
    interval_updates: int | None  # the cadence in force, when a cadence is configured and measured
    last_started: str | None = None  # captured at a boundary by this manager
    last_staged: str | None = None  # background save whose owned copy exists
    last_committed: str | None = None  # published (pointer moved) by this manager
    in_flight: int = 0
    unreported_failures: tuple[str, ...] = ()
    mirror: Any = None  # a lifecycle.mirror.MirrorStatus when the manager mirrors to a remote store
    tiers: dict | None = None  # node-local tiers: what this node's pointers name per tier (local, replicated)
    staging_bytes: int = 0  # host memory the background saves' buffers hold (reused from save to save)
    staging_pinned_bytes: int = 0  # of which page-locked (pinned), when the state is on a GPU
