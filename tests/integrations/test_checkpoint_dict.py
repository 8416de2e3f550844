"""A framework's checkpoint dict taken apart into tensors and JSON, and put back."""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch

from unbroken.checkpoint import json_values
from unbroken.integrations.checkpoint_dict import CheckpointDictError, join, split, templates
from unbroken.integrations.live_state import LiveState


def _through_json(skeleton):
    """As the manifest carries it: checked, encoded, strict JSON, decoded."""
    json_values.check("skeleton", skeleton)
    text = json.dumps(json_values.encode(skeleton), allow_nan=False)
    return json_values.decode(json.loads(text))


def test_a_lightning_shaped_dict_comes_back_with_its_types_and_bytes():
    weights = OrderedDict([("layer.weight", torch.randn(3, 2)), ("layer.bias", torch.arange(3.0))])
    checkpoint = {
        "epoch": 2,
        "global_step": 40,
        "state_dict": weights,
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(40.0), "exp_avg": torch.ones(3, 2)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "loops": {"fit_loop": {"best": float("inf"), "nan": float("nan"), "done": False}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "k": None}},
        "half": torch.zeros(2, dtype=torch.bfloat16),
        "size": torch.Size([3, 2]),
    }
    made = split(checkpoint)
    assert set(made.tensors) == {
        "state_dict.layer.weight",
        "state_dict.layer.bias",
        "optimizer_states.0.state.0.step",
        "optimizer_states.0.state.0.exp_avg",
        "half",
    }
    skeleton = _through_json(made.skeleton)
    loaded = templates(skeleton)
    for key, tensor in loaded.items():  # what DCP does: fill the templates in place
        assert tensor.shape == made.tensors[key].shape
        assert tensor.dtype == made.tensors[key].dtype
        tensor.copy_(made.tensors[key])
    back = join(skeleton, loaded)
    assert type(back["state_dict"]) is OrderedDict
    assert list(back["state_dict"]) == ["layer.weight", "layer.bias"]
    assert torch.equal(back["state_dict"]["layer.weight"], weights["layer.weight"])
    group = back["optimizer_states"][0]["param_groups"][0]
    assert group["betas"] == (0.9, 0.999) and type(group["betas"]) is tuple
    assert list(back["optimizer_states"][0]["state"]) == [0]  # an int key stays an int
    assert back["loops"]["fit_loop"]["best"] == float("inf")
    assert np.isnan(back["loops"]["fit_loop"]["nan"])
    assert back["callbacks"] == checkpoint["callbacks"]
    assert back["size"] == (3, 2) and back["half"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "value, where",
    [
        (argparse.Namespace(lr=1), r"checkpoint\['hyper_parameters'\]\['args'\] is a "),
        (np.int64(5), r"\['hyper_parameters'\]\['args'\] is a numpy.int64"),
        ({(1, 2): 3}, r"\['hyper_parameters'\]\['args'\] has the key \(1, 2\)"),
        (torch.float32, r"is a torch.dtype"),
        (torch.utils.data.DataLoader([1, 2]), r"is a torch DataLoader.*unbroken.DataLoader"),
    ],
)
def test_what_only_pickle_could_store_is_refused_by_path(value, where):
    with pytest.raises(CheckpointDictError, match=where):
        split({"hyper_parameters": {"args": value}, "global_step": 1})


def test_a_dict_that_contains_itself_is_refused():
    loop: dict = {}
    loop["again"] = loop
    with pytest.raises(CheckpointDictError, match=r"\['again'\] contains itself"):
        split({"loop": loop})


def test_buffers_are_copied_at_once_the_rest_shares_memory():
    module = torch.nn.BatchNorm1d(2)
    made = split({"state_dict": module.state_dict()}, copy_now=list(module.buffers()))
    running = made.tensors["state_dict.running_mean"]
    weight = made.tensors["state_dict.weight"]
    module.running_mean.add_(1)  # the next forward, changing a buffer in place
    assert torch.equal(running, torch.zeros(2))
    assert weight.data_ptr() == module.weight.data_ptr()


def test_a_live_state_builds_its_entries_only_when_read():
    built = []
    state = LiveState({"a": 1}, {"b": lambda: built.append(1) or 2})
    assert list(state) == ["a", "b"] and len(state) == 2 and not built
    assert dict(state.items()) == {"a": 1, "b": 2} and built == [1]
    with pytest.raises(ValueError, match="both fixed and computed"):
        LiveState({"a": 1}, {"a": lambda: 2})
