"""What keeping a run's checkpoints costs per storage tier: pure arithmetic, no I/O, no built-in prices.

The command ``trainstate cost DIR --rates FILE`` (:mod:`trainstate.cli.cost`)
measures a run directory (generation sizes and the save cadence from the
manifests, the retention policy the run recorded) and hands the figures to
:func:`estimate`, together with the prices the user read from a price list
(:func:`parse_rates`). Everything here is a function of those two inputs, so
the model is tested with numbers worked out by hand.

The model, per month of training at the measured cadence (a month is
``MONTH_S`` = 30 days; 1 GB is 10**9 bytes):

- **Stored GB-months**: the steady-state retained set, ``keep_last`` full
  generations plus ``keep_last_weights`` weights-only ones, one more full
  generation for the best (when the policy keeps one), the pinned generations,
  and the milestones, which accumulate: averaged over ``months`` of training.
- **Early deletion**: a tier with ``min_retention_days`` bills a generation
  pruned sooner for the minimum. Under the policy a generation lives
  ``keep × save interval`` (it is pruned when the keep-th newer one is
  published); each save that the policy prunes younger than the minimum adds
  ``size × (minimum - lifetime)`` of storage.
- **Write requests**: each save writes the files its manifest lists, the
  manifest, a commit record and a pointer update (``files + 3`` objects; one
  request per object: multipart uploads, which add a request per part, are
  not counted).
- **Read requests**: after each save, the verification (a listing of the
  generation and a read of its manifest) and the prune that follows it (a
  listing of the run, the two pointers and the pins, and a listing plus a
  manifest read per retained generation); each restore makes the requests
  :func:`restore_reads` counts for the newest full generation.
- **Transfer**: every save uploads its bytes (GB in); each restore reads what
  :func:`restore_reads` counts (GB out, and GB retrieved on tiers that charge
  for it): every byte once, also with several ranks (a byte several ranks
  load is downloaded by one and handed to the others).
- **Restore time**: the full generation's size over the tier's
  ``read_mb_per_s`` (10**6 bytes per second), when the rates give one.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from ..errors import InvalidArgument
from .retention import Retention

MONTH_S = 30 * 86400
GB = 10**9
OBJECTS_PER_COMMIT = 3  # besides the listed files: the manifest, a commit record, a pointer update
VERIFY_READS = 2  # after a save: list the generation, read its manifest
PRUNE_SCAN_READS = 4  # the prune after a save: list the run, read latest, latest-weights and pins
READS_PER_RETAINED = 2  # ... and list and read the manifest of each retained generation
# What a restore from an object store asks for besides its files, per process, counted through a proxy
# (tests/test_object_restore_traffic.py): pointers (latest twice, latest-weights), the lease, the run identity,
# the DONE record, the commit record (the manager's constructor and the restore), the manifest (a HEAD and a
# GET), and the listings.
RESTORE_FIXED_REQUESTS = 17
RANK_RESTORE_FIXED_REQUESTS = 10  # a rank of a multi-rank restore (no HEAD; a shard it loads whole is one GET)
READ_SPAN = 16 << 20  # a multi-rank restore fetches in ranged GETs of at most this many bytes
CHUNK_SPAN, FETCH_SPAN = 4 << 20, 8 << 20  # a single-process restore: the 4 MiB header chunk, then 8 MiB GETs

TOP_KEYS = ("date", "currency", "source", "tiers")
PRICE_KEYS = ("gb_month", "per_1000_writes", "per_1000_reads", "per_gb_in", "per_gb_out", "per_gb_retrieved")
TIER_KEYS = PRICE_KEYS + ("min_retention_days", "read_mb_per_s")

ASSUMPTIONS = (
    "a month is 30 days of training at the measured save cadence; 1 GB = 10^9 bytes (a provider billing "
    "per GiB charges about 7% less than shown)",
    "stored: keep_last full + keep_last_weights weights-only generations (steady state), + 1 full generation "
    "for the best when the policy keeps one, + the pinned generations, + milestones accumulating from the start "
    "of training (averaged over --months; counted apart from the last keep_last, so slightly high)",
    f"writes per save: one request per object: the files in the manifest + {OBJECTS_PER_COMMIT} (manifest, "
    "commit record, pointer update); multipart uploads (a request per part, plus 2) are not counted",
    f"reads per save: {VERIFY_READS} to verify (list the generation, read its manifest) + {PRUNE_SCAN_READS} to "
    f"plan the prune (list the run; read latest, latest-weights, pins) + {READS_PER_RETAINED} per retained "
    "generation (list it, read its manifest; milestones not counted); deletes are not counted (free on most tiers)",
    "each restore: the newest full generation read once (with several ranks, each byte by one rank, handed to "
    f"the others), {RESTORE_FIXED_REQUESTS} requests besides the files' ranged GETs ({RANK_RESTORE_FIXED_REQUESTS} "
    "per rank), as counted through a proxy",
    "early deletion: a generation lives keep x save interval before the prune removes it; a tier with "
    "min_retention_days bills the rest of the minimum as storage",
    "a price the rates file leaves out is not charged (0); restore time is size / read_mb_per_s (10^6 B/s), "
    "without request latency or parallelism",
)


@dataclass(frozen=True)
class TierRates:
    """The prices of one storage tier, as the user read them (missing prices are 0: not charged)."""

    name: str
    gb_month: float
    per_1000_writes: float = 0.0
    per_1000_reads: float = 0.0
    per_gb_in: float = 0.0
    per_gb_out: float = 0.0
    per_gb_retrieved: float = 0.0
    min_retention_days: float = 0.0
    read_mb_per_s: float | None = None


@dataclass(frozen=True)
class Rates:
    """A price list: when it was read, its currency, and one entry per tier, in file order."""

    date: datetime.date
    tiers: tuple[TierRates, ...]
    currency: str = ""
    source: str = ""

    def age_days(self, today: datetime.date) -> int:
        """Days between the date the prices were read and ``today`` (negative: dated in the future)."""
        return (today - self.date).days


def parse_rates(data: bytes, where: str) -> Rates:
    """A rates file's bytes, as TOML or JSON by the extension of ``where``; strict.

    Unknown keys, negative or non-numeric prices, a missing ``date`` or a
    tier that is not a table raise :class:`InvalidArgument` naming the key.

    >>> parse_rates(b'{"date": "2026-11-01", "tiers": {"disk": {"gb_month": 0.08}}}', "r.json").tiers[0].gb_month
    0.08
    """
    suffix = PurePath(where).suffix.lower()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if suffix == ".toml":
        raw = _load_toml(text, where)
    elif suffix == ".json":
        raw = _load_json(text, where)
    else:
        raise InvalidArgument(f"{where}: a rates file must end in .toml or .json (the extension picks the parser)")
    return rates_from_mapping(raw, where)


def _load_toml(text: str, where: str) -> Any:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise InvalidArgument(f"{where}: reading TOML needs Python 3.11 (tomllib) or the tomli package; "
                                  "or write the rates as JSON") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{where}: not valid TOML: {exc}") from None


def _load_json(text: str, where: str) -> Any:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise InvalidArgument(f"{where}: key {key!r} appears twice")
            out[key] = value
        return out

    def refuse(name: str) -> float:
        raise InvalidArgument(f"{where}: {name} is not a price")

    try:
        return json.loads(text, object_pairs_hook=unique, parse_constant=refuse)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{where}: not valid JSON: {exc}") from None


def rates_from_mapping(raw: Any, where: str) -> Rates:
    """Check a parsed rates document key by key and build :class:`Rates`."""
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where}: expected a table (an object) at the top, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise InvalidArgument(f"{where}: unknown key {unknown[0]!r} at the top (allowed: {', '.join(TOP_KEYS)})")
    if "date" not in raw:
        raise InvalidArgument(f"{where}: 'date' is required: the day these prices were read (e.g. date = 2026-11-01); "
                              "prices change, and the estimate says how old they are")
    date = _date(raw["date"], where)
    for key in ("currency", "source"):
        if key in raw and type(raw[key]) is not str:
            raise InvalidArgument(f"{where}: {key!r} must be a string, got {raw[key]!r}")
    tiers = raw.get("tiers")
    if not isinstance(tiers, dict) or not tiers:
        raise InvalidArgument(f"{where}: 'tiers' must be a table of at least one tier, e.g. [tiers.s3-standard] "
                              "with gb_month = 0.023")
    return Rates(date=date, tiers=tuple(_tier(name, entry, where) for name, entry in tiers.items()),
                 currency=raw.get("currency", ""), source=raw.get("source", ""))


def _date(value: Any, where: str) -> datetime.date:
    if isinstance(value, datetime.datetime):
        return value.date()
    if isinstance(value, datetime.date):
        return value
    if type(value) is str:
        try:
            return datetime.date.fromisoformat(value)
        except ValueError:
            pass
    raise InvalidArgument(f"{where}: 'date' must be a date such as 2026-11-01, got {value!r}")


def _tier(name: str, entry: Any, where: str) -> TierRates:
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{where}: tiers.{name} must be a table of prices ([tiers.{name}] with gb_month = ...), "
                              f"got {type(entry).__name__} {entry!r}")
    unknown = sorted(set(entry) - set(TIER_KEYS))
    if unknown:
        raise InvalidArgument(f"{where}: unknown key tiers.{name}.{unknown[0]} (allowed: {', '.join(TIER_KEYS)})")
    if "gb_month" not in entry:
        raise InvalidArgument(f"{where}: tiers.{name}.gb_month is required (the price of storing 1 GB for a month)")
    fields: dict[str, float] = {}
    for key, value in entry.items():
        if type(value) not in (int, float) or not math.isfinite(value):
            raise InvalidArgument(f"{where}: tiers.{name}.{key} must be a number, got {value!r}")
        if value < 0 or (key == "read_mb_per_s" and value == 0):
            what = "positive" if key == "read_mb_per_s" else "zero or more"
            raise InvalidArgument(f"{where}: tiers.{name}.{key} must be {what}, got {value!r}")
        fields[key] = float(value)
    return TierRates(name=name, **fields)


@dataclass(frozen=True)
class SaveCadence:
    """How often a run saved: seconds and updates between consecutive saves of one kind."""

    interval_s: float
    updates_per_save: int
    pairs: int  # how many consecutive pairs of generations the interval is the median of


def measure_cadence(points: Sequence[tuple[int, datetime.datetime]]) -> SaveCadence | None:
    """The save cadence from ``(next_update, created)`` of a run's generations of one kind.

    The updates between saves is the smallest gap between consecutive
    generations (pruning removes some saves, never adds one); the interval is
    the median time between consecutive generations that are that gap apart,
    so a restart's downtime or a pruned save in between does not stretch it.
    ``None`` when fewer than two generations (or no forward gap in time) exist.

    >>> t = datetime.datetime(2026, 1, 1)
    >>> measure_cadence([(100, t), (200, t + datetime.timedelta(seconds=60))])
    SaveCadence(interval_s=60.0, updates_per_save=100, pairs=1)
    """
    ordered = sorted(points)
    pairs = [(b[0] - a[0], (b[1] - a[1]).total_seconds()) for a, b in zip(ordered, ordered[1:])]
    pairs = [(du, dt) for du, dt in pairs if du > 0 and dt > 0]
    if not pairs:
        return None
    every = min(du for du, _ in pairs)
    times = [dt for du, dt in pairs if du == every]
    return SaveCadence(interval_s=statistics.median(times), updates_per_save=every, pairs=len(times))


@dataclass(frozen=True)
class KindFigures:
    """What one kind of generation (``full`` or ``weights``) puts into storage, with where each figure came from."""

    kind: str
    size_bytes: int  # one generation: its files and its manifest
    files: int  # objects its manifest lists (the manifest itself not counted)
    interval_s: float  # seconds between saves of this kind
    updates_per_save: int | None  # None: not known (an --interval-s given for a run of one generation)
    keep: int  # generations of this kind the policy keeps
    size_source: str = ""
    interval_source: str = ""

    def __post_init__(self) -> None:
        if self.size_bytes < 0 or self.files < 0 or self.keep < 1:
            raise InvalidArgument(f"{self.kind}: size and files must be non-negative and keep positive")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise InvalidArgument(f"{self.kind}: the save interval must be a positive number of seconds, "
                                  f"got {self.interval_s!r}")


@dataclass(frozen=True)
class RestoreReads:
    """What one restore downloads (bytes, over every process) and asks for (requests, likewise)."""

    bytes: int
    requests: int
    processes: int = 1


def _file_gets(size: int) -> int:
    """Ranged GETs of a file a single process restores: its header chunk, the chunk of RNG states a preview
    reads (a file of more than one chunk), then the file in runs of ``FETCH_SPAN`` (the chunks already read
    served from memory)."""
    return 1 + (size > CHUNK_SPAN) + (-(-size // FETCH_SPAN) if size > CHUNK_SPAN else 0)


def restore_reads(files: Sequence[tuple[int, int]], processes: int = 1) -> RestoreReads:
    """A restore's reads from ``files``, each ``(bytes, readers)``: how many of the ``processes`` download it.

    A single process reads each file with a HEAD and ranged GETs (:func:`_file_gets`); the ranks of a multi-rank restore fetch in ranged GETs of at most
    ``READ_SPAN``, no HEAD.
    """
    total = sum(size * readers for size, readers in files)
    if processes == 1:
        requests = RESTORE_FIXED_REQUESTS + sum(1 + _file_gets(size) for size, _ in files)
    else:
        requests = RANK_RESTORE_FIXED_REQUESTS * processes + sum(
            readers * max(1, -(-size // READ_SPAN)) for size, readers in files)
    return RestoreReads(total, requests, processes)


@dataclass(frozen=True)
class Measured:
    """Everything the estimate takes from the run: both kinds, the policy, pins."""

    full: KindFigures
    policy: Retention
    weights: KindFigures | None = None
    policy_source: str = ""
    pinned_bytes: int = 0
    pinned: int = 0  # distinct pinned generations
    restore: RestoreReads | None = None  # one restore of the newest full generation (None: one read of it)

    @property
    def best_bytes(self) -> int:
        """The best generation's slot: a full generation, which may be older than the last ``keep_last``."""
        return self.full.size_bytes if self.policy.best else 0


@dataclass(frozen=True)
class Volumes:
    """What a month of training stores, requests and moves, whatever the tier's prices."""

    saves_full: float
    saves_weights: float
    retained_bytes: int  # the steady-state set: last K of each kind, best, pins
    milestone_gb_months: float  # average per month over the horizon
    milestones_at_end: int
    gb_months: float  # retained + milestones
    writes: float
    reads: float
    gb_in: float
    gb_out: float


@dataclass(frozen=True)
class TierCost:
    """One tier's month: the volumes that depend on it (early deletion) and the cost split three ways."""

    tier: str
    early_deletion_gb_months: float
    storage: float
    requests: float
    transfer: float
    total: float
    restore_s: float | None


@dataclass(frozen=True)
class Estimate:
    """The whole estimate: the volumes, one :class:`TierCost` per tier, and the horizon they cover."""

    volumes: Volumes
    tiers: tuple[TierCost, ...]
    months: float
    restores_per_month: float


def milestone_gb_months(full: KindFigures, milestone_every: int | None, months: float) -> tuple[float, int]:
    """Average GB-months per month of milestones over ``months`` of training, and how many exist at the end.

    A milestone is a full save whose update is a multiple of
    ``milestone_every``, so one lands every ``lcm(updates_per_save,
    milestone_every)`` updates. Milestone k (at time ``k m``) is stored until
    the horizon ``T``: the sum is ``size (n T - m n (n+1) / 2)``.
    """
    if not milestone_every or full.updates_per_save is None:
        return 0.0, 0
    every_s = math.lcm(full.updates_per_save, milestone_every) / full.updates_per_save * full.interval_s
    horizon = months * MONTH_S
    n = math.floor(horizon / every_s)
    byte_seconds = full.size_bytes * (n * horizon - every_s * n * (n + 1) / 2)
    return byte_seconds / GB / MONTH_S / months, n


def volumes(measured: Measured, *, restores_per_month: float, months: float = 1.0) -> Volumes:
    """Stored GB-months, requests and transfer for one month of training (see the module docstring)."""
    if not (math.isfinite(months) and months > 0):
        raise InvalidArgument(f"months must be a positive number, got {months!r}")
    if not (math.isfinite(restores_per_month) and restores_per_month >= 0):
        raise InvalidArgument(f"restores per month must be zero or more, got {restores_per_month!r}")
    full, weights = measured.full, measured.weights
    saves_full = MONTH_S / full.interval_s
    saves_weights = MONTH_S / weights.interval_s if weights else 0.0
    retained = full.keep * full.size_bytes + measured.best_bytes + measured.pinned_bytes
    retained_count = full.keep + (1 if measured.policy.best else 0) + measured.pinned
    if weights:
        retained += weights.keep * weights.size_bytes
        retained_count += weights.keep
    milestones, at_end = milestone_gb_months(full, measured.policy.milestone_every, months)
    writes = saves_full * (full.files + OBJECTS_PER_COMMIT)
    bytes_in = saves_full * full.size_bytes
    if weights:
        writes += saves_weights * (weights.files + OBJECTS_PER_COMMIT)
        bytes_in += saves_weights * weights.size_bytes
    reads_per_save = VERIFY_READS + PRUNE_SCAN_READS + READS_PER_RETAINED * retained_count
    restore = measured.restore or restore_reads([(full.size_bytes, 1)])
    reads = (saves_full + saves_weights) * reads_per_save + restores_per_month * restore.requests
    return Volumes(saves_full=saves_full, saves_weights=saves_weights, retained_bytes=retained,
                   milestone_gb_months=milestones, milestones_at_end=at_end, gb_months=retained / GB + milestones,
                   writes=writes, reads=reads, gb_in=bytes_in / GB, gb_out=restores_per_month * restore.bytes / GB)


def early_deletion_gb_months(measured: Measured, min_retention_days: float) -> float:
    """Storage billed per month for generations pruned before the tier's minimum retention.

    Each save of a kind is pruned ``keep × interval`` seconds later; when that
    is shorter than the minimum, the rest is billed: ``saves per month × size
    × (minimum - lifetime)``, in GB-months.
    """
    minimum_s = min_retention_days * 86400
    total = 0.0
    for kind in (measured.full, measured.weights):
        if kind is None:
            continue
        short_s = minimum_s - kind.keep * kind.interval_s
        if short_s > 0:
            total += (MONTH_S / kind.interval_s) * kind.size_bytes / GB * short_s / MONTH_S
    return total


def tier_cost(rates: TierRates, measured: Measured, volume: Volumes) -> TierCost:
    """Price one month of ``volume`` on one tier."""
    early = early_deletion_gb_months(measured, rates.min_retention_days)
    storage = (volume.gb_months + early) * rates.gb_month
    requests = volume.writes / 1000 * rates.per_1000_writes + volume.reads / 1000 * rates.per_1000_reads
    transfer = volume.gb_in * rates.per_gb_in + volume.gb_out * (rates.per_gb_out + rates.per_gb_retrieved)
    restore_s = (measured.full.size_bytes / (rates.read_mb_per_s * 1e6)) if rates.read_mb_per_s else None
    return TierCost(tier=rates.name, early_deletion_gb_months=early, storage=storage, requests=requests,
                    transfer=transfer, total=storage + requests + transfer, restore_s=restore_s)


def estimate(measured: Measured, rates: Rates, *, restores_per_month: float = 4.0, months: float = 1.0) -> Estimate:
    """The monthly cost of keeping this run's checkpoints on each tier of ``rates``.

    >>> full = KindFigures("full", size_bytes=2 * GB, files=2, interval_s=3600, updates_per_save=100, keep=3)
    >>> rates = Rates(datetime.date(2026, 11, 1), (TierRates("disk", gb_month=0.1),))
    >>> round(estimate(Measured(full, Retention(keep_last=3)), rates).tiers[0].storage, 9)  # 3 x 2 GB x 0.1
    0.6
    """
    volume = volumes(measured, restores_per_month=restores_per_month, months=months)
    return Estimate(volumes=volume, tiers=tuple(tier_cost(t, measured, volume) for t in rates.tiers),
                    months=months, restores_per_month=restores_per_month)


def staleness(rates: Rates, today: datetime.date, max_age_days: int) -> str | None:
    """A warning when the prices were read more than ``max_age_days`` ago (or are dated in the future)."""
    age = rates.age_days(today)
    if age > max_age_days:
        return (f"these prices were read on {rates.date.isoformat()}, {age} days ago (more than {max_age_days}): "
                "prices change; check them against the provider's current list")
    if age < 0:
        return f"these prices are dated {rates.date.isoformat()}, {-age} days in the future: is the date right?"
    return None


def to_json(value: Any) -> Any:
    """A dataclass record (or a tree of them) as plain JSON values."""
    if hasattr(value, "__dataclass_fields__"):
        return {name: to_json(getattr(value, name)) for name in value.__dataclass_fields__}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, datetime.date):
        return value.isoformat()
    return value
