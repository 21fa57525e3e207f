"""Evaluation between training updates that leaves the training trajectory untouched.

An evaluation pass can shift training in three quiet ways: it draws from the
RNG streams the next update draws from (dropout left on, augmentation, a
shuffled validation loader), it updates BatchNorm running statistics when a
module is left in train mode, and it may iterate the training loader.
:func:`evaluating` closes the first two; a separate, unshuffled
:class:`~trainstate.ResumableLoader` and its ``replay()`` close the third.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager

import torch

from ..state import rng as rng_mod
from ..state.train_state import TrainState


@contextmanager
def evaluating(state: TrainState | torch.nn.Module | Iterable[torch.nn.Module] | None = None, *,
               rngs: Mapping[str, rng_mod.Generator] | None = None, no_grad: bool = True) -> Iterator[None]:
    """Run the block in eval mode, then put every RNG and train/eval flag back as it was.

    ``state`` is the :class:`~trainstate.TrainState` (its modules and named
    generators are covered), a module, or an iterable of modules. The global sources
    (Python, NumPy, torch CPU and CUDA) are always saved and restored; pass
    extra generators in ``rngs``. Restoration also happens when the block
    raises::

        if state.next_update % 500 == 0:
            with ts.evaluating(state):
                metric = sum(loss_fn(model(x), y) for x, y in val_loader.replay())
    """
    if isinstance(state, torch.nn.Module):
        state = [state]
    if isinstance(state, TrainState):
        modules: list[torch.nn.Module] = list(state.modules().values())
        named = {**state.rngs, **(rngs or {})}
    else:
        modules = list(state or [])
        named = dict(rngs or {})
    for name, generator in named.items():
        rng_mod.check_generator(name, generator)
    saved_rng = rng_mod.capture(named, include_globals=True)
    flags = [(m, m.training) for module in modules for m in module.modules()]
    try:
        with ExitStack() as stack:
            if no_grad:
                stack.enter_context(torch.no_grad())
            for module in modules:
                module.eval()
            yield
    finally:
        for module, training in flags:
            module.training = training
        rng_mod.apply_validated(saved_rng, named, restore_cuda=True)
