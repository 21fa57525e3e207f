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
from collections.abc import Callable
from typing import Any

from .checkpointer import TrainStateCheckpointer
from .components import DTensorRNG, TitanDataLoader, experiment_contract
from .hf import HFMapping, hf_mapping

__all__ = ["DTensorRNG", "HFMapping", "TitanDataLoader", "TrainStateCheckpointer", "experiment_contract",
           "hf_mapping", "with_trainstate"]

# torchtitan's registries, searched in order for a --config name (torchtitan.models.<name>.config_registry, ...)
_REGISTRY_PREFIXES = ("torchtitan.models", "torchtitan.experiments")


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
