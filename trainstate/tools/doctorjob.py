"""One rank of a launched ``trainstate doctor`` role: the recorder a checkpointer drives inside a ``torchrun`` job.

A multi-rank job cannot be rebuilt from a factory in one process: ``trainstate doctor RUN --launch CMD``
(:func:`trainstate.tools.doctor.doctor` with ``launch=``) runs the job's own command once per role instead,
with ``TRAINSTATE_DOCTOR`` naming that role's job file, and the job's checkpointer does here, on every rank,
what :mod:`trainstate.tools.doctorrun` does in one process:

1. it opens its manager on the role's own directory (``OUT/gens``), never on the run's: nothing the doctor
   does writes to the run being diagnosed;
2. it reaches update k: restores the job's generation (from the run, or from ``--against``'s), or trains from
   its fresh state (``replay_from="start"``) or from an earlier generation, saving nothing on the way;
3. at update k (:meth:`Launched.begin`): saves the state as ``OUT/gens@k``; at the update's first forward
   call, peeks the first draws of every RNG stream, notes each stream's state, and turns the recorder on: each
   model part's first input, each optimizer's LR and local gradients when it steps, the loss;
4. after the update (:meth:`Launched.end`): saves ``OUT/gens@k+1``, writes ``OUT/record-rank{R}.safetensors``
   (tensors, and the rest as JSON metadata: no pickle), waits for every rank and ends the process (the job has
   done what the role needs; training on would cost time and decide nothing).

A failure on a rank is written to ``OUT/error-rank{R}.json``. The parent merges the ranks' records, each name
marked with its rank (``grads/model.w[rank1]``), and compares them as it compares one process's.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import InvalidArgument
from ..state.train_state import TrainState

ENV = "TRAINSTATE_DOCTOR"


@dataclass(frozen=True)
class Job:
    """One role, as the parent wrote it: what to restore (``run``/``generation``, or ``replay_from``), the
    update ``k`` to record, and ``out``, the role's own directory."""

    role: str
    run: str
    generation: str | None
    replay_from: str | None
    update: int
    out: Path

    @classmethod
    def from_env(cls) -> Job | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        data = json.loads(Path(spec).read_text())
        return cls(data["role"], data["run"], data["generation"], data["replay_from"], int(data["update"]),
                   Path(data["out"]))

    @property
    def gens(self) -> Path:
        """The role's run directory: the state before the update at ``k``, after it at ``k + 1``."""
        return self.out / "gens"

    @property
    def source(self) -> str | None:
        """The generation to restore at the start (None: train from the fresh state)."""
        if self.generation is not None:
            return self.generation
        return None if self.replay_from in (None, "start") else self.replay_from


class Launched:
    """The recorder of one rank; ``begin`` at update k, ``end`` after it (see the module docstring)."""

    def __init__(self, job: Job, state: TrainState, save: Callable[[], None], *, loss_owner: Any = None):
        from .doctorrun import Recorder  # the recording itself: only a doctor's role pays for its imports

        self.job, self.state, self._save = job, state, save
        self._recorder = Recorder(state)
        self._loss_owner = loss_owner
        self._losses: list[torch.Tensor] = []
        self._draws: dict[str, torch.Tensor] = {}
        self._streams: dict[str, str] = {}
        self.notes: list[str] = []  # what the role's restore warned about (a ContinuationWarning), for the report
        self.rank = _rank()

    def begin(self) -> None:
        """At update k: save the state as it is; the recording starts with the update's first forward call,
        so that whatever the job does in between (building its data iterator, a reseed) is seen as the update
        sees it."""
        if self.state.next_update != self.job.update:
            raise InvalidArgument(f"the doctor's {self.job.role} process reached update {self.state.next_update}, "
                                  f"not {self.job.update}")
        self._save()
        self._watch_loss()
        handles = []

        def start(module: torch.nn.Module, args: tuple) -> None:
            from .doctorrun import peek_draws, stream_digests

            for handle in handles:
                handle.remove()
            self._draws = peek_draws(self.state)
            self._streams = stream_digests(self.state)
            self._recorder.on = True

        for module in self.state.modules().values():  # prepended: before the recorder's own hook sees the input
            handles.append(module.register_forward_pre_hook(start, prepend=True))

    def end(self) -> None:
        from .doctorrun import drawn_from, lrs, stream_digests

        recorder = self._recorder
        recorder.on = False
        drawn = drawn_from(self._streams, stream_digests(self.state))
        self._save()
        for name, component in self.state.components.items():
            if isinstance(component, torch.optim.Optimizer):
                recorder.tensors[f"lr/{name}/after"] = lrs(component)
        for i, loss in enumerate(self._losses):
            recorder.add(f"loss/value.{i}" if len(self._losses) > 1 else "loss/value", loss)
        tensors = {**self._draws, **recorder.tensors}
        meta = {"role": self.job.role, "update": self.job.update, "rank": self.rank, "values": recorder.values,
                "notes": self.notes, "streams": drawn, "order": list(tensors)}
        path = self.job.out / f"record-rank{self.rank}.safetensors"
        save_file(tensors, str(path), metadata={"doctor": json.dumps(meta)})

    def _watch_loss(self) -> None:
        owner = self._loss_owner
        loss_fn = getattr(owner, "loss_fn", None)
        if loss_fn is None:
            return

        def watched(*args: Any, **kwargs: Any) -> Any:
            out = loss_fn(*args, **kwargs)
            if self._recorder.on:
                loss = out[0] if isinstance(out, tuple) else out
                if isinstance(loss, torch.Tensor):
                    self._losses.append(loss)
            return out

        owner.loss_fn = watched


def fail(job: Job, exc: BaseException) -> None:
    """Write this rank's failure where the parent looks for it."""
    (job.out / f"error-rank{_rank()}.json").write_text(json.dumps(
        {"type": type(exc).__name__, "message": str(exc)[:2000]}))


def finish() -> None:
    """Every rank has written its record: end the process (the job's remaining steps would decide nothing)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing more to say
            pass
    os._exit(0)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
