"""The exceptions trainstate raises.

Every error derives from :class:`TrainStateError`. Where a builtin exception
describes the same situation, the subclass inherits it too, so existing
``except FileNotFoundError`` or ``except TypeError`` handlers keep working::

    TrainStateError(Exception)
    ├── InvalidArgument(ValueError)      an argument out of range (keep_last=0, a bad metric name, ...)
    ├── InvalidType(TypeError)           an argument of the wrong kind (a component without state_dict, ...)
    ├── ContractMismatch                 experiment contract differs on restore
    ├── UnsupportedValue(TypeError)      a state value has no pickle-free encoding
    ├── PendingGradients                 save requested mid-accumulation
    ├── TopologyMismatch                 CUDA device count changed (RNG streams)
    ├── StateMismatch                    checkpoint and live objects disagree in structure
    ├── DataMismatch(ValueError)         the data pipeline no longer yields the saved position
    ├── WeightsOnlyGeneration            a weights-only generation used as a resume
    ├── CorruptGeneration(ValueError)    a file failed parsing, size or digest checks
    ├── NoValidGeneration(FileNotFoundError)
    │                                    nothing restorable; lists every rejection
    ├── GenerationExists(FileExistsError) refusing to overwrite a published generation
    ├── ExistingRun(FileExistsError)     a state that was never restored would save over another run
    ├── GenerationNotFound(FileNotFoundError) a generation named by the caller does not exist
    ├── PinNotFound(KeyError)            no pin of that name
    ├── StaleIterator(RuntimeError)      an iterator used after a newer one replaced it
    ├── CheckpointFailed(RuntimeError)   a multi-rank save or restore failed on some rank (named)
    │   └── SaveNotJoined                not every rank entered a (collective) save
    ├── PointerRollback                  ``latest`` names an older generation than a newer valid one
    ├── SigningKeyRequired               a signed run opened without its key (would save unsigned)
    ├── InsufficientSpace(OSError)       the disk cannot hold the next generation (errno ENOSPC)
    ├── ReadOnlyDirectory(PermissionError) saving into a directory this process cannot write
    ├── RunDirectoryGone(FileNotFoundError) the run directory was removed or replaced while open
    └── DirectoryLocked(BlockingIOError) another writer holds the run directory

Every error survives a ``pickle`` round trip with its message and attributes
(multi-rank code sends exceptions between processes).

Exit codes for a training script run under a supervisor (``trainstate supervise``):
:data:`EXIT_PERMANENT` (78) means restarting cannot help, any other non-zero
status is a failure worth a bounded retry, and ``EXIT_PREEMPTED`` (75, in
:mod:`trainstate.lifecycle.preemption`) a preemption save. :func:`exit_code_for`
maps an exception to its code.
"""

from __future__ import annotations

from dataclasses import dataclass


def _rebuild(cls: type, args: tuple, state: dict) -> BaseException:
    """Unpickle an error without calling ``__init__`` (whose signature differs from ``args``)."""
    error = cls.__new__(cls, *args)
    if isinstance(error, OSError):
        OSError.__init__(error, *args)  # errno and strerror come from args, as OSError's own init sets them
    error.args = args
    error.__dict__.update(state)
    return error


class TrainStateError(Exception):
    """Root of every error raised by trainstate."""

    def __reduce__(self):  # subclasses take other constructor arguments than the message they pass on
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class InvalidArgument(TrainStateError, ValueError):
    """An argument is out of its allowed range; the message names it, the value and what is allowed."""


class InvalidType(TrainStateError, TypeError):
    """An argument is of the wrong kind; the message names it and what is expected."""


@dataclass(frozen=True)
class FieldChange:
    """One differing contract field: its dotted name and both values."""

    field: str
    old: object
    new: object

    def describe(self) -> str:
        """One line: the field with the checkpoint's value and this run's (or, for lists, what changed)."""
        if isinstance(self.old, (list, tuple)) and isinstance(self.new, (list, tuple)):
            return f"{self.field}: {_sequence_difference(self.old, self.new)}"
        return f"{self.field}: checkpoint has {_short(self.old)}, this run has {_short(self.new)}"


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sequence_difference(old: list | tuple, new: list | tuple, shown: int = 3) -> str:
    """Where two long lists (class names, say) differ: the first differing positions with both values."""
    differing = [i for i in range(min(len(old), len(new))) if old[i] != new[i]]
    parts = [f"position {i}: checkpoint has {_short(old[i], 80)}, this run has {_short(new[i], 80)}"
             for i in differing[:shown]]
    if len(differing) > shown:
        parts.append(f"{len(differing) - shown} more positions differ")
    if len(old) != len(new):
        parts.append(f"length {len(old)} in the checkpoint, {len(new)} in this run")
    return "; ".join(parts) or f"checkpoint has {_short(old)}, this run has {_short(new)}"


class ContractMismatch(TrainStateError):
    """The experiment contract of the checkpoint differs from the live run.

    ``changes`` lists each differing field. Nothing was loaded into the live
    objects. Pass ``allow_changes=[field, ...]`` to ``restore`` to accept a
    deliberate change; it is then recorded in the generation history. Fields
    in ``fixed`` (a data loader's plan) cannot be accepted: the saved position
    would name other samples. ``notes`` say more about some changes (how a
    loader's global batch changes, and how to keep it).
    """

    def __init__(self, generation: str, changes: list[FieldChange], fixed: list[str] = (), notes: list[str] = ()):
        self.generation = generation
        self.changes = list(changes)
        self.fixed = list(fixed)
        self.notes = list(notes)
        lines = "\n  ".join(c.describe() for c in self.changes)
        acceptable = [c.field for c in self.changes if c.field not in self.fixed]
        advice = []
        if acceptable:
            advice.append(f"If the change is deliberate, pass allow_changes=[{', '.join(map(repr, acceptable))}] to "
                          "restore(); it will be recorded in the run history and not reported as an identical "
                          "continuation.")
        if self.fixed:
            advice.append(f"{', '.join(self.fixed)} cannot change within a run (the saved data position would "
                          "name other samples): construct the loader with the checkpoint's values to resume, or "
                          "start a new run from these weights with warm_start().")
        advice += self.notes
        super().__init__(f"experiment contract of {generation} differs from this run; nothing was loaded:\n  "
                         f"{lines}\n" + " ".join(advice))


class UnsupportedValue(TrainStateError, TypeError):
    """A state value cannot be stored without pickle; ``path`` names where it sits."""

    def __init__(self, path: str, value: object, hint: str = ""):
        self.path = path
        super().__init__(
            f"cannot store {path} (a {type(value).__module__}.{type(value).__qualname__}) without pickle: "
            "supported values are tensors, numpy arrays and scalars, str, int, float, bool, None, "
            "and lists, tuples and dicts of those. "
            + (hint or "Convert it in the component's state_dict(), or keep it out of the saved state.")
        )


class PendingGradients(TrainStateError):
    """A backward pass has accumulated gradients that no optimizer step consumed."""


class TopologyMismatch(TrainStateError):
    """The checkpoint's CUDA RNG streams do not match this machine's devices."""


class StateMismatch(TrainStateError):
    """The checkpoint's structure does not fit the live objects (names, shapes, kinds)."""


class StateUnusable(StateMismatch, RuntimeError):
    """A restore failed after live tensors began to change: saving this state would publish a mix of two."""


class DataMismatch(TrainStateError, ValueError):
    """The data pipeline after restore does not produce the batches the checkpoint expects."""


class ContinuationWarning(UserWarning):
    """Some randomness continues only statistically, not bitwise, after a restore."""


class AbandonedIteratorWarning(ContinuationWarning):
    """A loader iterator was abandoned mid-epoch and a new one continued: the batches it handed out are consumed."""


class WeightsOnlyGeneration(TrainStateError):
    """A weights-only generation was asked to act as a full resume."""


class CorruptGeneration(TrainStateError, ValueError):
    """A generation (or pointer) failed parsing, size or digest verification."""

    def __init__(self, where: str, reason: str):
        self.where = where
        self.reason = reason
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Rejection:
    """A generation that restore passed over, and why."""

    generation: str
    reason: str


class NoValidGeneration(TrainStateError, FileNotFoundError):
    """No committed generation verified; ``rejections`` says why each failed."""

    def __init__(self, directory: str, rejections: list[Rejection], *, unusable: str | None = None,
                 nodes: list[str] | None = None):
        self.directory = directory
        self.rejections = list(rejections)
        self.unusable = unusable
        self.nodes = nodes  # node-local tiers: every node's directory ("host:path"), read together to inspect
        detail = "\n  ".join(f"{r.generation}: {r.reason}" for r in self.rejections) or "(none found)"
        loaded = ("nothing was loaded" if unusable is None else
                  f"the TrainState is UNUSABLE ({unusable}): rebuild the live objects before anything else, every "
                  "save refuses it")
        where = f"in {directory}" if nodes is None else f"on the {len(nodes)} nodes' directories ({', '.join(nodes)})"
        inspect = ("Inspect with `trainstate verify DIR`." if nodes is None else
                   "Inspect them together with `trainstate nodes DIR1 DIR2 ...` (every node's directory, copied to "
                   "one machine or on a shared mount): one node's directory holds only its part of each generation, "
                   "so `trainstate verify` refuses it.")
        super().__init__(
            f"no generation {where} verified; {loaded}, and nothing was deleted. Tried:\n  {detail}\n"
            f"{inspect} To start over, point the manager at a new directory rather than deleting this evidence."
        )


class GenerationExists(TrainStateError, FileExistsError):
    """A published generation with that name already exists and is never overwritten."""


class CheckpointFailed(TrainStateError, RuntimeError):
    """A multi-rank save or restore failed on some rank; every rank raises it (or its own error).

    ``phase`` names the step of the protocol; ``failures`` maps each failing
    rank to what it reported (``-1``: a peer was lost, the rank is not known).
    Nothing of a failed save was published: no pointer moved. A failed restore changed nothing in the run; where
    live tensors had taken part of it, the state is unusable until a restore loads completely.
    """

    RESTORING = frozenset({"choose", "check", "load", "apply"})  # the phases of a multi-rank restore

    def __init__(self, phase: str, failures: dict[int, str], peer_lost: bool = False):
        self.phase, self.failures, self.peer_lost = phase, dict(failures), peer_lost
        ranks = ", ".join(str(r) for r in sorted(self.failures) if r >= 0) or "a peer"
        detail = "; ".join(f"rank {r}: {m}" if r >= 0 else m for r, m in sorted(self.failures.items()))
        hint = (" A rank died or stopped answering within the checkpoint timeout; the job should exit and be "
                "restarted (torchrun --max-restarts, or your scheduler), resuming from the last generation.")
        outcome = ("The restore did not complete and changed nothing in the run; if live tensors took part of it, "
                   "the state is unusable (trainstate.unusable_reason) until a restore loads completely."
                   if phase in self.RESTORING else
                   "The state was restored completely and is usable, but a node that came back empty does not hold "
                   "its part of it yet: another loss could take the only copy. Restore again (or restart the job) "
                   "once the cause is fixed." if phase == "refill" else
                   "Nothing of it was published; the previous generation stands.")
        super().__init__(f"checkpoint {phase} failed on {ranks}: {detail[:2000]}. {outcome}"
                         + (hint if peer_lost else ""))


class SaveNotJoined(CheckpointFailed):
    """A multi-rank save that not every rank entered in time: ``save`` is collective.

    Raised on the ranks that did enter, after the join timeout rather than the
    collective timeout. ``missing`` lists the ranks that did not join when
    known (rank 0 coordinates the join and knows them), ``waited_s`` how long
    this rank waited. Nothing was written.
    """

    def __init__(self, message: str, missing: list[int] | None = None, waited_s: float | None = None):
        self.missing, self.waited_s = (None if missing is None else list(missing)), waited_s
        self.phase, self.peer_lost = "join", False
        self.failures = {r: "did not enter save" for r in self.missing or ()}
        RuntimeError.__init__(self, message)  # the message is the caller's, not CheckpointFailed's


class StaleIterator(TrainStateError, RuntimeError):
    """An iterator used after a newer one replaced it (a loader iterated again, or restored)."""


class GenerationNotFound(TrainStateError, FileNotFoundError):
    """A generation named by the caller does not exist in the run directory."""


class PinNotFound(TrainStateError, KeyError):
    """No pin of that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ExistingRun(TrainStateError, FileExistsError):
    """A state that was not restored from this directory would save into a run that already has generations."""


class PointerRollback(TrainStateError):
    """``latest`` names an older generation than a newer, valid full generation of the same timeline."""


class SigningKeyRequired(TrainStateError):
    """A run whose generations are signed was opened without its signing key; the message names where the key
    comes from and ``signing_key=False``, the deliberate way to go on unsigned."""


class ReadOnlyDirectory(TrainStateError, PermissionError):
    """Saving needs a run directory this process can write; reading does not."""


class RunDirectoryGone(TrainStateError, FileNotFoundError):
    """The run directory was deleted or replaced while a manager had it open."""


class DirectoryLocked(TrainStateError, BlockingIOError):
    """Another live process (or another manager in this process) is writing to the run directory."""


class InsufficientSpace(TrainStateError, OSError):
    """The preflight found too little free space for the next generation; nothing was written."""

    def __init__(self, directory: str, generation: str, needed: int, available: int, *, linked: int = 0):
        import errno

        self.directory, self.generation, self.needed, self.available = directory, generation, needed, available
        self.linked = linked  # bytes of unchanged files an incremental save links (no data blocks): not counted
        what = "the state plus headroom" if not linked else (
            f"what the save writes plus headroom; the {linked:,} bytes of unchanged files it links take none")
        super().__init__(
            errno.ENOSPC,
            f"not enough space in {directory} for {generation}: about {needed:,} bytes needed ({what}), "
            f"{available:,} available after pruning what the retention policy allows. Nothing was "
            "written and the existing generations are intact; free space (or lower keep_last, or unpin) and "
            "save again")

    def __str__(self) -> str:
        return self.strerror


class StorageAccessDenied(TrainStateError, PermissionError):
    """The object store refused the credentials or their permissions; the message names the bucket and setting."""


class StorageNotFound(TrainStateError, FileNotFoundError):
    """The bucket (or container) of a run URL does not exist at the endpoint used."""


class StorageUnavailable(TrainStateError, ConnectionError):
    """An object-store request kept failing after the client's bounded retries (5xx, timeouts, resets)."""


EXIT_FAILED = 1
"""Exit status of a failure a restart may cure (a crash, a lost peer, an unavailable store)."""

EXIT_PERMANENT = 78
"""Exit status of an error no restart can cure (EX_CONFIG): the supervisor stops at once, without retrying."""

# Errors that recur on every restart of the same command: the run's configuration, data, code or credentials
# disagree with what is on disk, or the disk itself refuses. Restarting only burns the retry budget.
PERMANENT = (ContractMismatch, DataMismatch, InvalidArgument, InvalidType, UnsupportedValue, PendingGradients,
             TopologyMismatch, StateMismatch, WeightsOnlyGeneration, NoValidGeneration, ExistingRun,
             GenerationExists, PointerRollback, InsufficientSpace, ReadOnlyDirectory, RunDirectoryGone,
             StorageAccessDenied, StorageNotFound, StaleIterator, SaveNotJoined, SigningKeyRequired)


def exit_code_for(exc: BaseException) -> int:
    """The exit status a training script should end with after ``exc``, for a supervisor to act on.

    :data:`EXIT_PERMANENT` for an error that every restart would meet again
    (``ContractMismatch``, ``DataMismatch``, configuration errors, refused
    credentials, a full or read-only disk, no valid generation: see
    ``PERMANENT``), also when it is the ``__cause__`` of the error raised (a
    background save that failed for lack of space); a ``SystemExit``'s own
    code; 130 for ``KeyboardInterrupt``; otherwise :data:`EXIT_FAILED`::

        try:
            train()
        except Exception as exc:
            logging.exception("training failed")
            sys.exit(ts.exit_code_for(exc))
    """
    if isinstance(exc, SystemExit):
        return exc.code if type(exc.code) is int else (0 if exc.code is None else EXIT_FAILED)
    if isinstance(exc, KeyboardInterrupt):
        return 130
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, PERMANENT):
            return EXIT_PERMANENT
        seen.add(id(cause))
        cause = cause.__cause__
    return EXIT_FAILED
