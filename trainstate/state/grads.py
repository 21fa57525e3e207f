"""Detect gradients that a backward pass accumulated but no optimizer step consumed.

Tracked against what the optimizers hold *now*, not what they held when the
TrainState was built: parameter groups added later (``add_param_group``) and
parameters unfrozen later count like the rest. Every optimizer step records,
for each parameter in its optimizers' current param groups, which ``.grad``
tensor it consumed and that tensor's version counter. A gradient is pending
when its ``.grad`` is another tensor than the one recorded (backward created
it) or the same tensor at a newer version (backward accumulated into it).

So the usual ``zero_grad(); backward(); step()`` loop saves fine: the
``.grad`` tensors still hold the consumed gradients, unchanged since the
step. ``zero_grad(set_to_none=True)`` discards gradients (``None`` is never
pending); ``zero_grad(set_to_none=False)`` zeroes them in place, and an
all-zero gradient is not pending either (nothing is lost by not saving it).
What ``.grad`` holds when the tracker is built was produced before the
TrainState existed, and counts as consumed.

Any step consumes the gradients of every tracked parameter, as a single
flag did before: a GAN's generator step leaves the discriminator gradients
its backward produced behind, and its next ``zero_grad`` discards them.

A ``GradScaler`` that finds inf/NaN skips ``optimizer.step()``; the step's
gradients are then spent all the same (the loop zeroes them next). So a
scaler registered in the same TrainState records them too: its ``step``
method is wrapped on that instance only, and state dicts are unaffected.

Parameters that no registered optimizer holds (a hand-written update,
``p.data.add_(p.grad, alpha=-lr)``, or no optimizer at all) have nothing
that can tell whether their ``.grad`` was consumed: :func:`unaccounted`
names them, and a save records their gradients rather than guess (see
:mod:`trainstate.state.snapshot`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch

# per parameter: (the parameter, the .grad tensor consumed or None, its version)
_Consumed = tuple[weakref.ref, "weakref.ref | None", int]


def _consumed(param: torch.Tensor) -> _Consumed:
    grad = param.grad
    if grad is None:
        return weakref.ref(param), None, 0
    return weakref.ref(param), weakref.ref(grad), grad._version


def _nonzero(grads: list[torch.Tensor]) -> list[bool]:
    """Whether each gradient holds a non-zero value, read with one synchronization per device (not one per
    gradient: on a GPU each ``.any()`` read back is a sync), a DTensor by its local shard (``.any()`` on the
    DTensor would all-reduce, once per parameter)."""
    flags: list[torch.Tensor | bool] = []
    for grad in grads:
        local = getattr(grad, "_local_tensor", grad)
        try:
            values = local.coalesce().values() if local.is_sparse else local
            flags.append(values.any())
        except (RuntimeError, TypeError, NotImplementedError):
            flags.append(True)  # cannot tell (an exotic tensor type): count it as pending, the safe side
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        if isinstance(flag, torch.Tensor):
            by_device.setdefault(flag.device, []).append(i)
    out = [flag if isinstance(flag, bool) else False for flag in flags]
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([flags[i] for i in indices]).tolist()):
            out[i] = bool(value)
    return out


class GradientTracker:
    """Whether ``.grad`` holds gradients no step of ``optimizers`` has consumed.

    Call order: built by :class:`TrainState`; every ``optimizer.step()`` (a
    post-step hook) and every ``scaler.step()`` records; :attr:`pending` is
    read before a save; :meth:`mark_pending` after gradients were restored.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], scalers: Iterable[torch.amp.GradScaler] = ()):
        self._optimizers = list(optimizers)
        self._restored = False
        self._steps = 0
        self.unaccounted_logged = False  # a save said once that it records gradients no optimizer accounts for
        self._handles = [optimizer.register_step_post_hook(self._on_step) for optimizer in self._optimizers]
        for scaler in scalers:
            self._wrap_scaler(scaler)
        self._record: dict[int, _Consumed] = {}
        self._consume()

    def _params(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in seen:
                        seen.add(id(param))
                        yield param

    def _consume(self) -> None:
        self._record = {id(p): _consumed(p) for p in self._params()}
        self._restored = False

    def _wrap_scaler(self, scaler: torch.amp.GradScaler) -> None:
        original = scaler.step

        def step(optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> object:
            before = self._steps
            result = original(optimizer, *args, **kwargs)
            if self._steps == before:  # skipped on inf/NaN: these gradients are spent all the same
                self._consume()
            return result

        scaler.step = step

    def _on_step(self, *_: object) -> None:
        self._steps += 1
        self._consume()

    def _unconsumed(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        record = self._record.get(id(param))
        return not (record is not None and record[0]() is param and record[1] is not None
                    and record[1]() is grad and record[2] == grad._version)

    @property
    def pending(self) -> bool:
        grads = [(p, p.grad) for p in self._params() if p.grad is not None]
        if self._restored:
            self._restored = bool(grads)  # zero_grad(set_to_none=True) discarded the restored gradients
            return self._restored
        unconsumed = [(param, grad) for param, grad in grads if self._unconsumed(param, grad)]
        if not unconsumed:
            return False
        if any(_nonzero([grad for _, grad in unconsumed])):
            return True
        for param, _ in unconsumed:
            self._record[id(param)] = _consumed(param)  # zeroed in place: nothing to lose, no rescan
        return False

    def tracked(self) -> set[int]:
        """``id`` of every parameter the registered optimizers hold now."""
        return {id(p) for p in self._params()}

    def mark_pending(self) -> None:
        """Called after restoring saved gradients: they still await a step."""
        self._restored = True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def unaccounted(modules: dict[str, torch.nn.Module], tracked: set[int]) -> dict[str, dict[str, torch.Tensor]]:
    """Per module, ``{parameter name: .grad}`` for every gradient no registered optimizer accounts for.

    A parameter shared by two names (tied weights) is listed once, under its first name.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[int] = set()
    for module_name, module in modules.items():
        for name, param in module.named_parameters():
            if param.grad is None or id(param) in tracked or id(param) in seen:
                continue
            seen.add(id(param))
            out.setdefault(module_name, {})[name] = param.grad
    return out
