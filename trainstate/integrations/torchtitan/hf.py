"""Hugging Face names for a torchtitan generation: ``trainstate export --mapping
trainstate.integrations.torchtitan:hf_mapping`` renames (and permutes) one tensor at a time through the model's
own ``StateDictAdapter``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import InvalidArgument


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
