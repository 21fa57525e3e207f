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
from .data.samplerng import SampleIndex, sample_generator
from .errors import (ContinuationWarning, ContractMismatch, CorruptGeneration, DataMismatch, DirectoryLocked,
                     ExistingRun, FieldChange, GenerationExists, GenerationNotFound, InsufficientSpace,
                     InvalidArgument, InvalidType, NoValidGeneration, PendingGradients, PinNotFound, PointerRollback,
                     ReadOnlyDirectory, Rejection, RunDirectoryGone, StaleIterator, StateMismatch,
                     StorageAccessDenied, StorageNotFound, StorageUnavailable, TopologyMismatch, TrainStateError,
                     UnsupportedValue, WeightsOnlyGeneration)
from .format.signing import SigningKey
from .lifecycle.preemption import EXIT_PREEMPTED, PreemptionHandler
from .lifecycle.rehearsal import Rehearsal
from .lifecycle.retention import Retention
from .manager import Cadence, CheckpointManager, GenerationInfo, RestoreInfo, Status
from .state.contract import fingerprint
from .state.train_state import TrainState
from .tools.diff import DiffReport, diff
from .tools.export import ExportInfo, export
from .warmstart import WarmStartInfo, warm_start

__all__ = [
    "AsyncSaveFailed",
    "Cadence",
    "CheckpointManager",
    "ContinuationWarning",
    "ContractMismatch",
    "CorruptGeneration",
    "DataMismatch",
    "DiffReport",
    "DirectoryLocked",
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
    "SigningKey",
    "StaleIterator",
    "StateMismatch",
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
    "evaluating",
    "export",
    "fingerprint",
    "sample_generator",
    "warm_start",
]
