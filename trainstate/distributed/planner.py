"""DCP planners whose non-tensor items go through trainstate's codec, never through pickle.

``torch.distributed.checkpoint`` writes every non-tensor leaf of a state dict
(an optimizer's ``lr``, ``betas``, ``params`` names...) with ``torch.save``
and reads it back with ``torch.load(weights_only=False)``: a crafted item runs
code on load. Here such items are the codec's tagged JSON, decoded by the
strict reader: a value the codec cannot carry is refused at save with its key
path, and a malformed one is a :class:`~trainstate.errors.CorruptGeneration`.
"""

from __future__ import annotations

import io
import json
from typing import Any

from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ..errors import CorruptGeneration, UnsupportedValue
from ..format.codec import TensorTable, decode, encode
from ..format.manifest import load_json

MAX_ITEM_BYTES = 16 << 20  # one non-tensor item (a param group, say) is small


def encode_item(value: Any, path: str) -> bytes:
    """One non-tensor state-dict item as tagged JSON; tensors inside it are refused (they belong in tensors)."""
    table = TensorTable()
    data = encode(value, path, table)
    if table.tensors:
        raise UnsupportedValue(path, value, "A tensor inside a non-tensor item of a sharded state cannot be stored; "
                                            "keep tensors as leaves of the state dict.")
    return json.dumps({"item": data}, separators=(",", ":"), allow_nan=False).encode()


def decode_item(data: bytes, where: str) -> Any:
    if len(data) > MAX_ITEM_BYTES:
        raise CorruptGeneration(where, f"a non-tensor item of {len(data)} bytes exceeds {MAX_ITEM_BYTES}")
    raw = load_json(data, where)
    if set(raw) != {"item"}:
        raise CorruptGeneration(where, "not a trainstate item")
    return decode(raw["item"], where, {})


class SavePlanner(DefaultSavePlanner):
    """DCP's default planning (flattening, dedup of replicated items), with codec-encoded objects."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(encode_item(object, write_item.index.fqn))
        return object


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planning; non-tensor items are decoded by the codec, never unpickled.

    ``reuse``: a planner that already planned this rank's reads of the same generation into the same state (a
    fetching restore plans once to learn which bytes to download); its plan is taken when it covers the same keys.
    """

    def __init__(self, *args: Any, reuse: LoadPlanner | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._reuse, self.plan = reuse, None

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if hasattr(self.metadata, "view"):  # written by rule (storage.RuleMetadata): what this rank reads, listed
            self.metadata = self.metadata.view(self.state_dict)

    def create_local_plan(self) -> Any:
        earlier = self._reuse
        if earlier is not None and earlier.plan is not None and earlier.state_dict.keys() == self.state_dict.keys():
            self.plan = earlier.plan
        else:
            self.plan = super().create_local_plan()
        return self.plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        decoded = decode_item(value.read(), read_item.storage_index.fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], decoded)
        else:
            self.state_dict[read_item.dest_index.fqn] = decoded
