"""TrainState: every input of the next update, gathered in one object."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import contract as contract_mod
from ..errors import ContinuationWarning, InvalidType
from .grads import GradientTracker, unaccounted
from .rng import Generator, check_generator

RESERVED = frozenset({"rngs", "contract", "capture_global_rngs"})
_ATTRIBUTES = frozenset({"components", "next_update", "tokens_seen", "counters", "facts", "history", "pending_gradients",
                         "parent", "lineage", "own_keys"})
# What torch's LR schedulers write into the param groups they drive: every LRScheduler sets initial_lr;
# OneCycleLR max_lr and min_lr; CyclicLR and OneCycleLR the momentum bounds; SWALR swa_lr.
# (ReduceLROnPlateau writes nothing there, so an unregistered one cannot be seen.)
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"})


class TrainState:
    """The restart state of a training run.

    Keyword arguments name the stateful components: anything with
    ``state_dict()`` and ``load_state_dict()`` (modules, optimizers, LR
    schedulers, ``torch.amp.GradScaler``, EMA models, your own objects).
    ``rngs`` names the generators your step draws from beyond the global ones
    (captured by default), and ``contract`` holds what gives the numbers
    their meaning (config, class names, data manifest id, tokenizer
    fingerprint); it is checked on restore.

    >>> state = TrainState(model=model, optimizer=opt, rngs={"data": gen},
    ...                    contract={"config": cfg, "class_names": classes})
    >>> state.next_update += 1

    Attributes you update as training runs: ``next_update`` (the update
    clock), ``tokens_seen``, ``counters`` (named integers such as ``epoch``)
    and ``facts`` (small JSON-like values: best metric, patience, tracker
    run id). ``history`` records accepted contract changes and is carried
    into every later generation.
    """

    def __init__(self, *, rngs: Mapping[str, Generator] | None = None, contract: Mapping[str, Any] | None = None,
                 capture_global_rngs: bool = True, **components: Any):
        for name, component in components.items():
            if name in _ATTRIBUTES or name.startswith("_"):
                # a keyword Python would refuse if it were a parameter: a TypeError, as Python's own
                raise InvalidType(f"{name!r} cannot name a component: it is a TrainState attribute; rename it")
            if not (callable(getattr(component, "state_dict", None))
                    and callable(getattr(component, "load_state_dict", None))):
                raise InvalidType(f"component {name!r} ({type(component).__qualname__}) has no "
                                  "state_dict()/load_state_dict(); wrap it in an object that does")
        for arg, value in (("rngs", rngs), ("contract", contract)):
            if value is not None and not isinstance(value, Mapping):
                raise InvalidType(f"{arg} must be a mapping of names to values (a dict), not a "
                                  f"{type(value).__qualname__}")
        self.components: dict[str, Any] = dict(components)
        self.rngs: dict[str, Generator] = dict(rngs or {})
        for name, rng in self.rngs.items():
            check_generator(name, rng)  # refuses a generator no save could capture (random.SystemRandom)
        self.contract: dict[str, Any] = dict(contract or {})
        contract_mod.build(self.contract, {})  # reject non-JSON contract values now, not at the first save
        self.capture_global_rngs = capture_global_rngs
        self.next_update = 0
        self.tokens_seen = 0
        self.counters: dict[str, int] = {}
        self.facts: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.parent: str | None = None  # the generation this state was last restored from or saved as
        self.lineage: list[list] | None = None  # timelines this run descends from (see lifecycle.ancestors)
        # modules a multi-rank save takes with their own state_dict() and loads with load_state_dict(): the keys
        # they give (torchtitan's canonical ones, made by state-dict hooks) rather than DCP's parameter paths
        self.own_keys: set[str] = set()
        self._grads = GradientTracker(
            [c for c in components.values() if isinstance(c, torch.optim.Optimizer)],
            [c for c in components.values() if isinstance(c, torch.amp.GradScaler)])
        self._scheduler_warned: set[str] = set()

    @property
    def capture_global_rngs(self) -> bool:
        """Whether saves capture, and restores set, the process's global RNG streams."""
        return self._capture_global_rngs

    @capture_global_rngs.setter
    def capture_global_rngs(self, value: bool) -> None:
        if type(value) is not bool:
            raise InvalidType(f"capture_global_rngs must be True or False, not {value!r}")
        self._capture_global_rngs = value

    def __getitem__(self, name: str) -> Any:
        return self.components[name]

    def modules(self) -> dict[str, torch.nn.Module]:
        """The components that are modules (``torch.nn.Module``), by name."""
        return {n: c for n, c in self.components.items() if isinstance(c, torch.nn.Module)}

    @property
    def pending_gradients(self) -> bool:
        """True when a backward pass accumulated gradients that no optimizer step has consumed."""
        return self._grads.pending

    def unaccounted_gradients(self) -> dict[str, dict[str, torch.Tensor]]:
        """Gradients (``.grad``, by module and parameter name) that no registered optimizer steps, so nothing
        can tell whether they were consumed: a hand-written update, or no optimizer at all. A save records them."""
        return unaccounted(self.modules(), self._grads.tracked())

    def _warn_unregistered_schedulers(self) -> None:
        """Once per optimizer, at a save: an LR scheduler drives it, but none is registered here.

        Such a scheduler is not saved, so a restore resets it silently. Its
        keys in the optimizer's param groups (``initial_lr``, ...) give it
        away; a registered component whose ``.optimizer`` is this optimizer
        (a scheduler, or a SequentialLR around several) is the fix.
        """
        driven = {id(getattr(c, "optimizer", None)) for c in self.components.values()
                  if not isinstance(c, torch.optim.Optimizer)}
        for name, optimizer in self.components.items():
            if not isinstance(optimizer, torch.optim.Optimizer) or name in self._scheduler_warned \
                    or id(optimizer) in driven:
                continue
            keys = sorted({k for group in optimizer.param_groups for k in group if k in SCHEDULER_KEYS})
            if keys:
                self._scheduler_warned.add(name)
                warnings.warn(ContinuationWarning(
                    f"optimizer {name!r} is driven by an LR scheduler that this TrainState does not hold (its param "
                    f"groups carry {', '.join(keys)}): the scheduler is not saved, and a restore would restart its "
                    "schedule. Register the scheduler in TrainState(scheduler=...)"), stacklevel=2)

    def data_positions(self) -> dict[str, Any]:
        """Components that keep a data position (``data_position()``), by name."""
        return {n: c for n, c in self.components.items() if callable(getattr(c, "data_position", None))}

    def settle_contract(self, saved: Mapping[str, Any], allow: Iterable[str] = ()) -> None:
        """Before a restore compares contracts: components whose plan the checkpoint settles (a loader's
        order algorithm left to its default) read their saved field ``loader.<name>``."""
        allow = [allow] if isinstance(allow, str) else list(allow)
        for name, component in self.components.items():
            settle = getattr(component, "settle_contract", None)
            if callable(settle):
                field = f"loader.{name}"
                settle(saved.get(field), lambda key, f=field: any(
                    f"{f}.{key}" == a or f"{f}.{key}".startswith(a + ".") for a in allow))

    def contract_fields(self) -> dict[str, Any]:
        """The contract as checked on restore: the given fields, each module's architecture, each loader's plan."""
        fields = contract_mod.build(self.contract, self.modules())
        for name, component in self.components.items():
            if callable(getattr(component, "data_contract", None)):
                fields[f"loader.{name}"] = contract_mod.canonical(component.data_contract(), f"loader.{name}")
        return fields

    def __repr__(self) -> str:
        return (f"TrainState(next_update={self.next_update}, tokens_seen={self.tokens_seen}, "
                f"components={list(self.components)}, rngs={list(self.rngs)})")
