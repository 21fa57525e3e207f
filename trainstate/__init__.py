"""trainstate: restartable PyTorch training.

A run killed at any moment resumes from a checkpoint that is never
half-written, never silently corrupt and never loaded blindly, and continues
exactly as if it had never stopped::

    import trainstate as ts

    state = ts.TrainState(model=model, optimizer=opt, scheduler=sched, rngs={"data": gen},
                          contract={"config": cfg, "class_names": classes})
    with ts.CheckpointManager("runs/exp1", keep_last=3) as ckpt:
        ckpt.restore(state)
        while state.next_update < total_updates:
            train_one_update()
            state.next_update += 1
            if state.next_update % 100 == 0:
                ckpt.save(state)
"""

from .version import __version__

from .asyncsave import AsyncSaveFailed, SaveHandle
from .data.evaluation import evaluating
from .data.files import data_manifest
from .data.loader import ResumableLoader
from .data.mixture import Mixture
from .data.samplerng import SampleIndex, sample_generator
from .errors import (EXIT_PERMANENT, AbandonedIteratorWarning, CheckpointFailed, ContinuationWarning, ContractMismatch,
                     CorruptGeneration, DataMismatch, DirectoryLocked, ExistingRun, FieldChange, GenerationExists,
                     GenerationNotFound, InsufficientSpace, InvalidArgument, InvalidType, NoValidGeneration,
                     PendingGradients, PinNotFound, PointerRollback, ReadOnlyDirectory, Rejection, RunDirectoryGone,
                     SaveNotJoined, SigningKeyRequired, StaleIterator, StateMismatch, StateUnusable, StorageAccessDenied, StorageNotFound,
                     StorageUnavailable, TopologyMismatch, TrainStateError, UnsupportedValue, WeightsOnlyGeneration,
                     exit_code_for)
from .format.signing import SigningKey
from .lifecycle.done import DoneRecord, DoneStatus, done
from .lifecycle.preemption import EXIT_PREEMPTED, PreemptionHandler
from .lifecycle.rehearsal import Rehearsal
from .lifecycle.retention import Retention
from .manager import Cadence, CheckpointManager, GenerationInfo, RestoreInfo, Status
from .restore import unusable as unusable_reason
from .state.contract import fingerprint
from .state.train_state import TrainState
from .tools.diff import DiffReport, diff
from .tools.doctor import DoctorReport, doctor
from .tools.export import ExportInfo, export
from .warmstart import WarmStartInfo, warm_start

__all__ = [
    "AbandonedIteratorWarning",
    "AsyncSaveFailed",
    "Cadence",
    "CheckpointFailed",
    "CheckpointManager",
    "ContinuationWarning",
    "ContractMismatch",
    "CorruptGeneration",
    "DataMismatch",
    "DiffReport",
    "DirectoryLocked",
    "DoctorReport",
    "DoneRecord",
    "DoneStatus",
    "EXIT_PERMANENT",
    "EXIT_PREEMPTED",
    "ExistingRun",
    "ExportInfo",
    "FieldChange",
    "GenerationExists",
    "GenerationInfo",
    "GenerationNotFound",
    "InsufficientSpace",
    "InvalidArgument",
    "InvalidType",
    "Mixture",
    "NoValidGeneration",
    "PendingGradients",
    "PinNotFound",
    "PointerRollback",
    "PreemptionHandler",
    "ReadOnlyDirectory",
    "Rehearsal",
    "Rejection",
    "RestoreInfo",
    "ResumableLoader",
    "Retention",
    "RunDirectoryGone",
    "SampleIndex",
    "SaveHandle",
    "SaveNotJoined",
    "SigningKey",
    "SigningKeyRequired",
    "StaleIterator",
    "StateMismatch",
    "StateUnusable",
    "Status",
    "StorageAccessDenied",
    "StorageNotFound",
    "StorageUnavailable",
    "TopologyMismatch",
    "TrainState",
    "TrainStateError",
    "UnsupportedValue",
    "WarmStartInfo",
    "WeightsOnlyGeneration",
    "__version__",
    "data_manifest",
    "diff",
    "doctor",
    "done",
    "evaluating",
    "exit_code_for",
    "export",
    "fingerprint",
    "sample_generator",
    "unusable_reason",
    "warm_start",
]
