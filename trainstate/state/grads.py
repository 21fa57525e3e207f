"""Detect gradients that a backward pass accumulated but no optimizer step consumed.

The state is tracked with hooks, not by reading ``.grad``: after the usual
``zero_grad(); backward(); step()`` the ``.grad`` tensors still hold the
consumed gradients, and saving there is correct. A parameter's
post-accumulate-grad hook marks the state pending; an optimizer step hook
clears it. ``zero_grad(set_to_none=True)`` discards gradients, so pending
gradients that are all ``None`` again count as discarded.

A ``GradScaler`` that finds inf/NaN skips ``optimizer.step()``; the step's
gradients are then spent all the same (the loop zeroes them next). So a
scaler registered in the same TrainState clears the flag too: its ``step``
method is wrapped on that instance only, and state dicts are unaffected.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class GradientTracker:
    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], scalers: Iterable[torch.amp.GradScaler] = ()):
        self._pending = False
        self._handles = []
        for scaler in scalers:
            self._wrap_scaler(scaler)
        self._params: list[torch.Tensor] = []
        seen: set[int] = set()
        for optimizer in optimizers:
            self._handles.append(optimizer.register_step_post_hook(self._on_step))
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in seen and param.requires_grad:
                        seen.add(id(param))
                        self._params.append(param)
                        self._handles.append(param.register_post_accumulate_grad_hook(self._on_accumulate))

    def _wrap_scaler(self, scaler: torch.amp.GradScaler) -> None:
        original = scaler.step

        def step(optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
            result = original(optimizer, *args, **kwargs)
            self._pending = False  # stepped, or skipped on inf/NaN: either way these gradients are spent
            return result

        scaler.step = step

    def _on_step(self, *_: object) -> None:
        self._pending = False

    def _on_accumulate(self, _: torch.Tensor) -> None:
        self._pending = True

    @property
    def pending(self) -> bool:
        if self._pending and all(p.grad is None for p in self._params):
            self._pending = False  # zero_grad(set_to_none=True) discarded them
        return self._pending

    def mark_pending(self) -> None:
        """Called after restoring saved gradients: they still await a step."""
        self._pending = True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
