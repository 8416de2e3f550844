"""A DCP load planner that never unpickles arbitrary objects.

DCP's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(..., weights_only=False)`` on
every non-tensor item it reads, which runs whatever a planted pickle asks for. This
planner loads those items with ``weights_only=True``: primitives, containers and tensors
only; anything else is refused with an error naming the key.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from unbroken.checkpoint.errors import CheckpointCorruptError


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with ``weights_only=True`` for non-tensor items."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(
                f"checkpoint item {fqn!r} is not a plain value (refused to unpickle it): {e}"
            ) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
