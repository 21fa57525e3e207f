"""torchtitan: a checkpoint manager that saves and resumes a torchtitan run through trainstate.

One flag selects it: ``--module trainstate.integrations.torchtitan`` with the
``--config`` you would give torchtitan (``llama3_debugmodel``, ``llama3_8b``,
...). This module serves as a ``config_registry``: it finds the named
function among torchtitan's own registries and returns its config with the
checkpoint section replaced by :class:`TrainStateCheckpointer.Config`, every
field the stock section had kept::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module trainstate.integrations.torchtitan --config llama3_8b \\
        --checkpoint.enable --checkpoint.interval 500 --checkpoint.async-mode async

In a config function of your own, :func:`with_trainstate` does the same to
any ``Trainer.Config``.

What a generation holds, beyond torchtitan's own checkpointer
(``components/checkpointer/dcp.py``):

==========================================  =================================================================
torchtitan's checkpointer                   trainstate
==========================================  =================================================================
model parts (``ModelWrapper``), optimizers  ``model`` and ``optimizer`` (``model_1``, ``optimizer_1``, ... with
(DCP)                                       several parts or optimizers), sharded through DCP, digested
``lr_scheduler`` (the container)            ``lr_scheduler`` (``lr_scheduler_1``, ...): each ``LambdaLR``
``dataloader`` (``pickle.dumps`` per rank)  ``dataloader``: each rank's position through the pickle-free codec
``train_state`` (``step``, ``ntokens_seen``)  ``train_state``, and the clocks (``next_update`` = step,
                                            ``tokens_seen``)
nothing: the seed is set again at start     every RNG stream of every rank: Python, NumPy, torch's CPU
                                            generator, each CUDA device's (which is what DTensor's RNG tracker
                                            draws from), and the tracker's own settings
nothing                                     the contract: model, tokenizer files, dataset, sequence length,
                                            batch sizes, world size (a resume that changes one is refused)
the highest ``step-N`` with a ``.metadata``  the newest generation that verifies; a damaged one is passed over
``pickle.load`` of ``.metadata``, non-       no pickle and no ``torch.load`` anywhere on the load path
tensor entries, the dataloader state
``keep_latest_k``                           the same, pruned only after the new generation is published
``async_mode`` (``async``, ``..._pinned_mem``)  a background save (``save(blocking=False)``)
==========================================  =================================================================

Beyond those, the fields of :class:`TrainStateCheckpointer.Config` reach
trainstate's incremental generations (``full_every``), node-local tiers
(``replicas``, ``failure_domain``) and the mirror (``mirror``,
``mirror_every``); ``TRAINSTATE_SIGNING_KEY`` signs as it does anywhere.

Not supported (each refused with the reason, or said in the guide):
``initial_load_path`` (a DCP folder or Hugging Face weights: load them once
with torchtitan's own checkpointer), ``last_save_in_hf`` (``trainstate export`` writes Hugging Face safetensors
from any generation) and ``create_seed_checkpoint``.
``last_save_model_only`` is not followed: the last save is a full generation
and the run's DONE record, so that a restarted finished run stops at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.tensor import _random as dtensor_random
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.checkpointer.base import TRAIN_STATE

from ..errors import InvalidArgument, StateMismatch
from ..format.manifest import parse_generation_name
from ..lifecycle import incremental
from ..lifecycle.retention import Retention
from ..manager import CheckpointManager
from ..state.train_state import TrainState
from ..tools import doctorjob

__all__ = ["HFMapping", "TrainStateCheckpointer", "hf_mapping", "with_trainstate"]

log = logging.getLogger("trainstate")

# torchtitan's registries, searched in order for a --config name (torchtitan.models.<name>.config_registry, ...)
_REGISTRY_PREFIXES = ("torchtitan.models", "torchtitan.experiments")


class TitanDataLoader:
    """A torchtitan data loader's position, without the ``pickle.dumps`` torchtitan wraps it in.

    ``ParallelAwareDataloader.state_dict`` pickles ``StatefulDataLoader``'s
    state under a ``dp_rank_<r>`` key; this reads and writes the same state
    unpickled (plain ints, strings and lists the codec stores), one per rank.
    At another world size a position cannot be mapped onto other ranks: the
    restore is refused unless ``dataloader`` is in ``exclude_from_loading``,
    and then each rank starts its shard of the data afresh, as torchtitan does.
    """

    def __init__(self, loader: StatefulDataLoader, excluded: bool):
        self.loader = loader
        self.excluded = excluded

    def state_dict(self) -> dict[str, Any]:
        return StatefulDataLoader.state_dict(self.loader)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.excluded:
            StatefulDataLoader.load_state_dict(self.loader, state)

    def resharded_state(self, saved: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
        if not self.excluded:
            raise StateMismatch(
                f"the data loader's position was saved by {len(saved)} data-parallel ranks and cannot be mapped onto "
                "another number: torchtitan's datasets split the data by rank. To reshard the model and optimizer "
                "and start each rank's data afresh, add --checkpoint.exclude-from-loading dataloader")
        return self.state_dict(), ["the data loader's position was not loaded (exclude_from_loading): each rank "
                                   "starts its shard of the data afresh"]


class DTensorRNG:
    """DTensor's RNG tracker, beyond the device generator it draws from (captured with every CUDA device's).

    torch 2.13's ``OffsetBasedRNGTracker`` keeps its Philox state in the
    device's default generator; what it adds is whether random ops on
    DTensors run in a distributed region, and (older versions) named states.
    """

    def state_dict(self) -> dict[str, Any]:
        tracker = dtensor_random._rng_tracker
        if tracker is None:
            return {}
        out: dict[str, Any] = {"distribute_region_enabled": bool(tracker.distribute_region_enabled)}
        states = getattr(tracker, "rng_states", None)
        if isinstance(states, dict):
            out["rng_states"] = {str(k): v.detach().cpu().clone() for k, v in states.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tracker = dtensor_random._rng_tracker
        if tracker is None or not state:
            return
        tracker.distribute_region_enabled = state["distribute_region_enabled"]
        states = getattr(tracker, "rng_states", None)
        for name, value in (state.get("rng_states") or {}).items():
            if isinstance(states, dict) and name in states:
                states[name] = value.to(states[name].device)


def _own_generator(loader: StatefulDataLoader) -> None:
    """Give the loader a generator of its own, seeded alike in every process of the run.

    Each ``iter(loader)`` draws the workers' base seed from ``loader.generator``,
    by default torch's global one. torchtitan makes the iterator after the
    checkpoint loads, so a resumed process would draw once more from the
    global stream than the uninterrupted one did (which drew before step 1),
    and every later dropout mask would shift. The loader's own generator,
    seeded from the run's seed (``torch.initial_seed()``, which
    ``--debug.seed`` sets), leaves the global stream to the model. It is not
    saved: every process draws from it once, at its one ``iter()``, so it
    ends in the same state in a resumed process as in the uninterrupted one,
    and the base seed the workers use is restored with the loader's position.
    """
    if loader.generator is None:
        loader.generator = torch.Generator().manual_seed(torch.initial_seed())


def _fingerprint(folder: str | None) -> str | None:
    """A digest of the tokenizer files in ``folder`` (names and bytes), or ``None`` without any."""
    if not folder or not os.path.isdir(folder):
        return None
    digest = hashlib.sha256()
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and (path.name.startswith("tokenizer") or path.suffix in (".model", ".tiktoken")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def experiment_contract(trainer: Any) -> dict[str, Any]:
    """What gives a torchtitan run's numbers their meaning: checked on restore, a change refused by name."""
    config = getattr(trainer, "config", None)
    if config is None:
        return {}
    training, dataloader = config.training, config.dataloader
    spec = config.model_spec
    return {
        "model": {"name": str(getattr(spec, "name", type(spec).__name__)),
                  "flavor": str(getattr(spec, "flavor", "")),
                  "parameters": sum(p.numel() for m in trainer.model_parts for p in m.parameters())},
        "tokenizer": _fingerprint(getattr(config, "hf_assets_path", None)),
        "dataset": {"name": str(getattr(dataloader, "dataset", "")), "path": getattr(dataloader, "dataset_path", None)},
        "training": {"seq_len": training.seq_len, "local_batch_size": training.local_batch_size,
                     "global_batch_size": training.global_batch_size},
    }


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
        """Incremental generations: every ``full_every``-th links nothing; in between, unchanged parts are linked.
        ``None``: every generation is whole."""

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

    def _manager(self, folder: str) -> CheckpointManager:
        config = self.config
        return CheckpointManager(
            folder, **_retention(config.keep_latest_k), verify=config.verify, full_every=config.full_every,
            replicas=config.replicas, failure_domain=config.failure_domain, mirror=config.mirror,
            mirror_every=config.mirror_every, collective_timeout_s=config.collective_timeout_s)

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
            _own_generator(dataloader)
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
                source = self._manager(job.run)
                try:
                    self.restored = source.restore(self.state, generation=job.source,
                                                   allow_changes=self.config.allow_changes)
                finally:
                    source.close()
                restored = self.restored is not None
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


def with_trainstate(config: Any, **options: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) with its checkpoint section made a
    :class:`TrainStateCheckpointer.Config`: every field the old section shares with it is kept, ``options`` set
    the rest."""
    old = config.checkpoint
    shared = {f.name: getattr(old, f.name) for f in dataclasses.fields(TrainStateCheckpointer.Config)
              if f.init and hasattr(old, f.name)}
    shared.update(options)
    if shared.get("last_save_in_hf"):
        shared["last_save_in_hf"] = False  # refused at once otherwise; trainstate export writes HF weights
    config.checkpoint = TrainStateCheckpointer.Config(**shared)
    return config


def _registry_function(name: str) -> Callable[[], Any] | None:
    """torchtitan's config function ``name``, from whichever model's ``config_registry`` defines it."""
    import importlib
    import pkgutil

    for prefix in _REGISTRY_PREFIXES:
        try:
            package = importlib.import_module(prefix)
        except ImportError:
            continue
        for module in pkgutil.iter_modules(package.__path__):
            try:
                registry = importlib.import_module(f"{prefix}.{module.name}.config_registry")
            except ImportError:
                continue
            function = getattr(registry, name, None)
            if callable(function):
                return function
    return None


def __getattr__(name: str) -> Callable[[], Any]:
    """``--module trainstate.integrations.torchtitan --config NAME``: torchtitan's ``NAME``, with trainstate."""
    if name.startswith("_"):
        raise AttributeError(name)
    function = _registry_function(name)
    if function is None:
        raise AttributeError(f"no torchtitan config_registry defines {name!r}")

    def config() -> Any:
        return with_trainstate(function())

    config.__name__ = name
    return config


class HFMapping:
    """A torchtitan model's tensors under Hugging Face names, through the model's own ``StateDictAdapter``.

    The adapter's ``to_hf`` is applied one tensor at a time (first on a meta
    tensor, to learn the name and whether the values change: Llama's Q and K
    projections are permuted for Hugging Face's rotary layout); a tensor the
    adapter leaves out (a tied ``lm_head``, RoPE caches) is left out.
    """

    def __init__(self, adapter: Any):
        self.adapter = adapter

    def target(self, name: str, shape: tuple[int, ...]) -> tuple[str, Callable | None] | None:
        probe = torch.empty(shape, device="meta")
        try:
            out = self.adapter.to_hf({name: probe})
        except KeyError:
            return None  # not a tensor the Hugging Face layout has
        if not out:
            return None
        (new, value), = out.items()
        if value is probe:
            return new, None

        def convert(tensor: torch.Tensor) -> torch.Tensor:
            return self.adapter.to_hf({name: tensor})[new]
        return new, convert


def hf_mapping(state: dict[str, Any]) -> HFMapping:
    """The :class:`HFMapping` for the model a torchtitan generation recorded (its contract's ``model`` name and
    flavor): ``trainstate export RUN OUT --mapping trainstate.integrations.torchtitan:hf_mapping``."""
    import importlib

    model = state.get("contract", {}).get("fields", {}).get("model")
    if not isinstance(model, dict) or not model.get("name") or not model.get("flavor"):
        raise InvalidArgument("this generation records no torchtitan model (its contract has no model name and "
                              "flavor): it was not saved by trainstate.integrations.torchtitan")
    try:
        registry = importlib.import_module(f"torchtitan.models.{model['name']}").model_registry
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"torchtitan has no model {model['name']!r} here ({exc})") from None
    spec = registry(model["flavor"])
    if spec.state_dict_adapter is None:
        raise InvalidArgument(f"torchtitan's {model['name']} has no Hugging Face state-dict adapter")
    return HFMapping(spec.state_dict_adapter(spec.model, None))
