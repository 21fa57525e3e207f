"""Accelerate: a :class:`~trainstate.TrainState` from what ``accelerator.prepare(...)`` returned.

Accelerate keeps placing the model on its device and wrapping it for
distributed training; saving and resuming go through trainstate's
:class:`~trainstate.CheckpointManager` instead of ``save_state``/``load_state``::

    from trainstate.integrations.accelerate import train_state

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loader = ts.ResumableLoader(dataset, batch_size=32, seed=0, shuffle=True)  # True is the default; not prepared
    state = train_state(accelerator, data=loader)
    with ts.CheckpointManager("runs/exp1") as ckpt:
        ckpt.restore(state)
        ...

The mapping from Accelerate's own checkpointing:

==============================================  ===============================================================
Accelerate                                       trainstate
==============================================  ===============================================================
``accelerator.save_state(dir)``                 ``ckpt.save(state)``: one durable, verified generation
``accelerator.load_state(dir)``                 ``ckpt.restore(state)``: the newest generation that verifies
prepared models (``pytorch_model*.bin``,        ``model``, ``model_1``, ...: the unwrapped modules
``model*.safetensors``)
prepared optimizers (``optimizer*.bin``)        ``optimizer``, ``optimizer_1``, ...: the inner optimizers
prepared schedulers (``scheduler*.bin``)        ``scheduler``, ``scheduler_1``, ...: the inner schedulers
``accelerator.scaler`` (``scaler.pt``)          ``scaler``
``register_for_checkpointing(obj)``             ``custom_checkpoint_0``, ...: each registered object, in order
(``custom_checkpoint_<i>.pkl``, pickled)        (through the pickle-free codec: what it cannot encode is refused
                                                at save time, naming the key path)
RNG states (``random_states_<rank>.pkl``)       the global RNG streams (captured by default), plus ``rngs=``
``accelerator.step`` (accumulation counter)     ``accelerator``
prepared DataLoaders (``sampler.bin``; with     a prepared loader with ``use_stateful_dataloader=True``:
``use_stateful_dataloader``, its state)         ``dataloader``, ...; otherwise pass ``data=ts.ResumableLoader``
``ProjectConfiguration(total_limit=...)``       ``CheckpointManager(keep_last=...)`` (prunes only after the
                                                new generation is published)
==============================================  ===============================================================

A plain prepared DataLoader keeps no position: ``load_state`` restarts its
epoch from the first batch. Give the training data to :func:`train_state` as
an un-prepared :class:`~trainstate.ResumableLoader` (``prepare`` passes it
through unchanged; it shards by rank itself) and move each batch to
``accelerator.device``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from accelerate.data_loader import DataLoaderAdapter
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from ..errors import InvalidArgument, InvalidType
from ..state.train_state import TrainState

__all__ = ["train_state"]

log = logging.getLogger("trainstate")


class AcceleratorStep:
    """``accelerator.step``, Accelerate's gradient-accumulation counter, as a component."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.accelerator.step = state["step"]


def _stateful(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))


def unwrap(accelerator: Any, name: str, obj: Any) -> Any:
    """What Accelerate wrapped, unwrapped: the module, the inner optimizer or scheduler; loaders are checked."""
    if isinstance(obj, torch.nn.Module):
        return accelerator.unwrap_model(obj)
    if isinstance(obj, AcceleratedOptimizer):
        return obj.optimizer
    if isinstance(obj, AcceleratedScheduler):
        return obj.scheduler
    if isinstance(obj, DataLoaderAdapter) and not _stateful(obj):
        raise InvalidType(
            f"component {name!r} is a DataLoader prepared by Accelerate without use_stateful_dataloader: it keeps no "
            "position, so a resume would restart its epoch. Pass an un-prepared ts.ResumableLoader instead (prepare "
            "passes it through; it shards by rank itself), or prepare the loader with "
            "Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))")
    return obj


def _prepared(accelerator: Any) -> dict[str, Any]:
    """Every object Accelerate would save in ``save_state``, under names that follow its file names."""
    named: dict[str, Any] = {}
    for prefix, objects in (("model", accelerator._models), ("optimizer", accelerator._optimizers),
                            ("scheduler", accelerator._schedulers)):
        for i, obj in enumerate(objects):
            name = prefix if i == 0 else f"{prefix}_{i}"
            named[name] = unwrap(accelerator, name, obj)
    if accelerator.scaler is not None:
        named["scaler"] = accelerator.scaler
    loaders = [dl for dl in accelerator._dataloaders if _stateful(dl)]
    for i, loader in enumerate(loaders):
        named["dataloader" if i == 0 else f"dataloader_{i}"] = loader
    plain = len(accelerator._dataloaders) - len(loaders)
    if plain:
        log.warning("%d DataLoader(s) prepared by Accelerate keep no position and are not saved: a resume restarts "
                    "their epoch. Give the training data as data=ts.ResumableLoader(...) (un-prepared).", plain)
    for i, obj in enumerate(accelerator._custom_objects):
        named[f"custom_checkpoint_{i}"] = obj
    named["accelerator"] = AcceleratorStep(accelerator)
    return named


def train_state(accelerator: Any, *, rngs: dict | None = None, contract: dict | None = None,
                capture_global_rngs: bool = True, **components: Any) -> TrainState:
    """A :class:`~trainstate.TrainState` holding everything ``accelerator.save_state`` would save, unwrapped.

    The prepared models, optimizers and schedulers, the grad scaler, the
    objects given to ``register_for_checkpointing`` and the gradient
    accumulation counter are found on ``accelerator`` (names in the module
    docstring). ``components`` adds more (``data=ts.ResumableLoader(...)``,
    an EMA model, ...), unwrapped the same way; one that is already among the
    prepared objects takes the name given here instead. ``rngs``,
    ``contract`` and ``capture_global_rngs`` are passed to ``TrainState``.
    """
    named = _prepared(accelerator)
    for name, obj in components.items():
        obj = unwrap(accelerator, name, obj)
        for other in [n for n, known in named.items() if known is obj]:
            del named[other]  # the caller's name wins; an object is saved once
        if name in named:
            raise InvalidArgument(
                f"component name {name!r} is already used for {type(named[name]).__qualname__}, found on the "
                f"accelerator; choose another name (taken: {', '.join(sorted(named))})")
        named[name] = obj
    return TrainState(rngs=rngs, contract=contract, capture_global_rngs=capture_global_rngs, **named)
