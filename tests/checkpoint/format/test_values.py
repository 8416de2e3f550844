"""What a save refuses among the non-tensor items of the state's objects, by key."""

from __future__ import annotations

import collections
import enum

import numpy as np
import pytest
import torch

from unbroken.checkpoint.format.values import check_loadable


class Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize(
    "value",
    [
        None, 3, 2.5, "s", b"b", 1j, torch.float16, torch.device("cpu"), torch.Size([2, 3]),
        (1, 2), [1, [2, 3]], {"a": 1}, collections.OrderedDict(a=1), set(range(1000)),
        torch.strided,
    ],
)  # fmt: skip
def test_what_loads_back_with_weights_only_passes(value):
    check_loadable("k", value)


@pytest.mark.parametrize(
    "value, match",
    [
        (np.float32(1), r"'opt.best' is a numpy.float32, .*value.item\(\)"),
        (np.zeros(3), r"'opt.best' is a numpy.ndarray, .*value.tolist\(\)"),
        (Color.RED, r"'opt.best' is a Color, which a checkpoint cannot give back"),
        (torch.channels_last, r"'opt.best' is a memory_format, which a checkpoint cannot hold"),
    ],
)
def test_what_would_need_unpickling_is_refused_naming_the_key(value, match):
    with pytest.raises(TypeError, match=match):
        check_loadable("opt.best", value)
