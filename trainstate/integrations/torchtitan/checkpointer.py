"""The checkpoint manager torchtitan's Trainer drives: ``load`` once, ``save`` after every step, the waits, ``close``.

:class:`TrainStateCheckpointer` builds one :class:`~trainstate.TrainState` from what torchtitan hands its
checkpointer (model parts, optimizers, schedulers, the data loader, the Trainer's own state), and saves and
restores it through :class:`~trainstate.CheckpointManager`. Under ``trainstate doctor --launch`` (the
``TRAINSTATE_DOCTOR`` job), it plays the role it is given instead (:mod:`trainstate.tools.doctorjob`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.tensor import _random as dtensor_random
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.checkpointer.base import TRAIN_STATE

from ...errors import InvalidArgument
from ...format.manifest import parse_generation_name
from ...lifecycle import incremental
from ...lifecycle.retention import Retention
from ...manager import CheckpointManager
from ...state.train_state import TrainState
from ...tools import doctorjob
from .components import DTensorRNG, TitanDataLoader, experiment_contract, own_generator

log = logging.getLogger("trainstate")


class TrainStateCheckpointer(BaseCheckpointManager):
    """torchtitan's checkpoint manager, through trainstate: verified, durable, pickle-free, RNG included.

    Built by torchtitan from :class:`TrainStateCheckpointer.Config` (see the
    module docstring); the Trainer calls ``load`` once at start, ``save``
    after every step (this decides, by ``interval``), the two waits before
    the next step's work, and ``close`` at the end.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``async`` (or ``async_with_pinned_mem``): each save copies the state and publishes it in the
        background; the next save, or the end of training, waits for it."""

        verify: Literal["fast", "full"] = "fast"
        """After each commit, re-read the generation: ``fast`` checks sizes and the manifest, ``full`` every byte."""

        full_every: int | None = incremental.DEFAULT_FULL_EVERY
        """Incremental generations: unchanged parts are linked. 0: each rank's parts in two copies linked
        crosswise, no generation forced whole; N: every N-th whole; ``None``: every generation is whole."""

        replicas: int | None = None
        """Node-local tiers: each node's files live on this many nodes (``folder`` is then node-local)."""

        failure_domain: str | None = None
        """Node-local tiers: this node's failure domain (a rack, a zone); replicas go to other domains first."""

        mirror: str | None = None
        """An object-store URL (``s3://bucket/prefix``) every ``mirror_every``-th generation is copied to."""

        mirror_every: int = 1
        """Which published generations the mirror receives."""

        collective_timeout_s: float = 600.0
        """How long a checkpoint collective waits for a rank before the save or restore fails on every rank."""

        allow_changes: list[str] = field(default_factory=list)
        """Contract fields a resume may change (``world_size``, ``training``, ...); anything else differing is
        refused before anything loads."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise InvalidArgument(f"checkpoint.async_mode must be disabled, async or async_with_pinned_mem, "
                                      f"got {self.async_mode!r}")
            if self.last_save_in_hf:
                raise InvalidArgument("checkpoint.last_save_in_hf is not supported by trainstate's checkpointer: "
                                      "`trainstate export RUN --format safetensors` writes Hugging Face weights "
                                      "from any generation; leave last_save_in_hf off")
            if self.create_seed_checkpoint:
                raise InvalidArgument("checkpoint.create_seed_checkpoint is not supported by trainstate's "
                                      "checkpointer: the first save of a run is its generation 0 seed")
            if self.initial_load_path or self.initial_load_in_hf:
                raise InvalidArgument("checkpoint.initial_load_path is not supported by trainstate's checkpointer: "
                                      "a run starting from other weights loads them once with torchtitan's own "
                                      "checkpointer (a DCP folder or Hugging Face safetensors) and saves its first "
                                      "step; switch to trainstate's from the next launch, or load them in your own "
                                      "config function")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.save_future = None
        self.folder = os.path.join(base_folder, config.folder) if "://" not in config.folder else config.folder
        self.sd_adapter = sd_adapter
        self.trainer = states.get(TRAIN_STATE)
        self.state = self._train_state(dataloader, model_parts, optimizers, lr_schedulers, states)
        self.doctor = doctorjob.Job.from_env()  # a `trainstate doctor --launch` role: see _doctor_load
        if self.doctor is None:
            self.ckpt = self._manager(self.folder)
        else:  # the role writes its own directory only, never the run's
            self.ckpt = CheckpointManager(self.doctor.gens, full_every=None,
                                          collective_timeout_s=config.collective_timeout_s)
            self._launched = doctorjob.Launched(self.doctor, self.state, lambda: self.ckpt.save(self.state),
                                                loss_owner=self.trainer)
        self.restored = None  # the RestoreInfo of the load, for the caller and the tests
        log.info("trainstate checkpointing to %s (every %d steps, %s)", self.folder, config.interval,
                 "background" if self._background else "blocking")

    def _manager(self, folder: str, **overrides: Any) -> CheckpointManager:
        config = self.config
        options = dict(_retention(config.keep_latest_k), verify=config.verify, full_every=config.full_every,
                       replicas=config.replicas, failure_domain=config.failure_domain, mirror=config.mirror,
                       mirror_every=config.mirror_every, collective_timeout_s=config.collective_timeout_s)
        return CheckpointManager(folder, **{**options, **overrides})

    # the state ----------------------------------------------------------------
    def _train_state(self, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                     lr_schedulers: Any, states: dict[str, Any]) -> TrainState:
        parts = list(model_parts)
        inner = list(getattr(optimizers, "optimizers", [optimizers]))
        schedulers = list(getattr(lr_schedulers, "schedulers", [lr_schedulers])) if lr_schedulers is not None else []
        named: dict[str, Any] = {}

        def add(prefix: str, objects: list) -> None:
            for i, obj in enumerate(objects):
                named[prefix if i == 0 else f"{prefix}_{i}"] = obj

        add("model", parts)
        add("optimizer", inner)
        add("lr_scheduler", schedulers)
        if dataloader is not None:
            if not isinstance(dataloader, StatefulDataLoader):
                raise InvalidArgument(f"the data loader is a {type(dataloader).__qualname__}, not a torchdata "
                                      "StatefulDataLoader: its position cannot be saved")
            named["dataloader"] = TitanDataLoader(dataloader, "dataloader" in self.config.exclude_from_loading)
            own_generator(dataloader)
        for name, obj in states.items():
            if name in named:
                raise InvalidArgument(f"states[{name!r}] collides with a component trainstate names itself")
            named[name] = obj
        if dtensor_random._rng_tracker is not None:
            named["dtensor_rng"] = DTensorRNG()
        contract = experiment_contract(self.trainer) if self.trainer is not None else {}
        state = TrainState(contract=contract, **named)
        state.own_keys = {name for name, obj in named.items() if any(obj is part for part in parts)}
        return state

    @property
    def _background(self) -> bool:
        return self.config.async_mode != "disabled"

    def _clocks_from_trainer(self) -> None:
        if self.trainer is not None:
            self.state.next_update = int(self.trainer.step)
            self.state.tokens_seen = int(self.trainer.ntokens_seen)

    # BaseCheckpointManager ----------------------------------------------------
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        return (last_step or curr_step % self.config.interval == 0
                or (curr_step == 1 and self.config.enable_first_step_checkpoint))

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.doctor is not None:
            return self._doctor_save(curr_step)
        if not self._should_save(curr_step, last_step):
            return False
        self._clocks_from_trainer()
        if self.trainer is None:
            self.state.next_update = curr_step
        if last_step:
            self._wait_for_saving()
            self.ckpt.finish(self.state)  # a full generation and the DONE record: a restart stops at once
            return True
        if self._background:
            self.save_future = self.ckpt.save(self.state, blocking=False)
        else:
            self.ckpt.save(self.state)
        return True

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if self.doctor is not None:
            return self._doctor_load()
        generation = None
        if step != -1:
            named = [g for g in self.ckpt.generations() if _step_of(g) == step]
            if not named:
                raise InvalidArgument(f"--checkpoint.load_step={step}: {self.folder} holds no generation at step "
                                      f"{step} (it holds steps {sorted({_step_of(g) for g in self.ckpt.generations()} - {None})})")
            generation = named[0]
        info = self.ckpt.restore(self.state, generation=generation, allow_changes=self.config.allow_changes)
        if info is None:
            return self._initial_load()
        self.restored = info
        for rejection in info.rejected:
            log.warning("passed over %s: %s", rejection.generation, rejection.reason)
        if self.trainer is not None:  # the component restored step and ntokens_seen; the clocks agree with them
            self.trainer.step = self.state.next_update
        log.info("resumed from %s (step %d)", info.generation.name, self.state.next_update)
        return True

    # a `trainstate doctor --launch` role (trainstate.tools.doctorjob) -------------
    def _doctor_load(self) -> bool:
        """Reach the role's update: restore its generation (read from the run, or the reference run, through a
        manager that only reads), or start fresh to train up to it."""
        job, restored = self.doctor, False
        try:
            if job.source is not None:
                source = self._manager(job.run, mirror=None)  # no uploader: nothing is written to the run's remote
                try:
                    self.restored = source.restore(self.state, generation=job.source,
                                                   allow_changes=self.config.allow_changes)
                finally:
                    source.close()
                restored = self.restored is not None
                self._launched.notes += list(self.restored.warnings) if restored else []
                if self.trainer is not None:
                    self.trainer.step = self.state.next_update
            self._clocks_from_trainer()
            if self.state.next_update > job.update:
                raise InvalidArgument(f"the doctor's {job.role} process starts at step {self.state.next_update}, "
                                      f"after step {job.update}")
            if self.state.next_update == job.update:
                self._launched.begin()
        except BaseException as exc:
            doctorjob.fail(job, exc)
            raise
        return restored

    def _doctor_save(self, curr_step: int) -> bool:
        """Nothing is saved on the way to the update; at it, the recorder starts; after it, the role ends."""
        try:
            self._clocks_from_trainer()
            if self.trainer is None:
                self.state.next_update = curr_step
            if curr_step == self.doctor.update:
                self._launched.begin()
            elif curr_step == self.doctor.update + 1:
                self._launched.end()
                self.ckpt.close()
                doctorjob.finish()
        except BaseException as exc:
            doctorjob.fail(self.doctor, exc)
            raise
        return False

    def _initial_load(self) -> bool:
        """A fresh run: nothing to load (``initial_load_path`` is refused by the config)."""
        return False

    def _wait_for_saving(self) -> None:
        self.ckpt.wait()
        self.save_future = None

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: a background save returns once it owns a copy of the state."""

    def _close(self) -> None:
        self.save_future = None
        self.ckpt.close()


def _retention(keep_latest_k: int) -> dict[str, Any]:
    """torchtitan's ``keep_latest_k`` (0: keep every checkpoint) as the manager's retention."""
    if keep_latest_k == 0:  # every full generation a milestone: none is pruned
        return {"retention": Retention(keep_last=3, milestone_every=1)}
    return {"keep_last": keep_latest_k}


def _step_of(generation: str) -> int | None:
    """The step a full generation was saved at (``next_update`` is the Trainer's step), else ``None``."""
    parsed = parse_generation_name(generation)
    return parsed[0] if parsed is not None and parsed[1] == "full" else None
