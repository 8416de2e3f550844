"""RNG capture and restore: streams repeat after a round trip; bad records are named."""

from __future__ import annotations

import base64
import copy
import json
import random

import numpy as np
import pytest
import torch

from unbroken.state.rng import (
    RngStateError,
    capture_rng_state,
    generator_state,
    restore_rng_state,
    set_generator_state,
)


def _draws() -> tuple:
    return (
        torch.rand(5).tolist(),
        torch.randn(3).tolist(),  # normal draws use torch's cached state too
        np.random.rand(4).tolist(),
        np.random.standard_normal(3).tolist(),  # leaves a cached gaussian behind
        random.random(),
        random.gauss(0, 1),  # leaves python's gauss_next behind
        torch.nn.functional.dropout(torch.ones(16), 0.5).tolist(),
    )


def test_round_trip_through_json_makes_every_stream_repeat():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    _draws()  # move every stream off its seed, cached gaussians included
    saved = json.loads(json.dumps(capture_rng_state()))
    first = _draws()
    _draws()  # training goes on; then the job restarts
    restore_rng_state(saved)
    assert _draws() == first


def test_restore_into_a_fresh_process_state_repeats():
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    random.gauss(0, 1)
    saved = capture_rng_state()
    expected = _draws()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng_state(saved)
    assert _draws() == expected


def test_generator_helpers_round_trip():
    gen = torch.Generator().manual_seed(5)
    torch.rand(7, generator=gen)
    text = generator_state(gen)
    json.dumps(text)
    expected = torch.rand(4, generator=gen)
    other = torch.Generator().manual_seed(99)
    set_generator_state(other, text)
    assert torch.equal(torch.rand(4, generator=other), expected)
    with pytest.raises(RngStateError, match=r"'loader\.generator'.*not valid base64"):
        set_generator_state(other, "###", key="loader.generator")
    with pytest.raises(RngStateError, match=r"'generator': 3 bytes"):
        set_generator_state(other, "AAAA")


def _broken(edit) -> dict:
    state = copy.deepcopy(capture_rng_state())
    edit(state)
    return state


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop("numpy"), r"missing key 'numpy'"),
        (lambda s: s["python"].pop("internal"), r"missing key 'python\.internal'"),
        (lambda s: s.update(format=99), r"'format' is 99"),
        (lambda s: s.update(format="1"), r"'format' must be int, got str"),
        (lambda s: s["python"]["internal"].pop(), r"'python\.internal' must be 625 integers"),
        (lambda s: s["python"].update(gauss_next="x"), r"'python\.gauss_next' must be"),
        (lambda s: s["numpy"].update(key="!!notbase64"), r"'numpy\.key' is not valid base64"),
        (lambda s: s["numpy"].update(key="AAAA"), r"'numpy\.key' must decode to 2496 bytes"),
        (lambda s: s["numpy"].update(pos=700), r"'numpy\.pos' is 700"),
        (lambda s: s["numpy"].update(kind="PCG64"), r"'numpy\.kind' is 'PCG64'"),
        (lambda s: s.update(torch="AAAA"), r"'torch': 3 bytes, expected 5056"),
        (lambda s: s.update(torch=5), r"'torch' must be str, got int"),
        (lambda s: s.update(cuda=["@@"]), r"'cuda\.0' is not valid base64"),
        (lambda s: s.update(cuda={}), r"'cuda' must be list"),
        (lambda s: s.update(python=[1]), r"'python' must be Mapping"),
        (lambda s: s["python"].update(version=4), r"'python\.version' is 4"),
        (lambda s: s["python"]["internal"].__setitem__(-1, 700), r"ends in position 700"),
        (lambda s: s["numpy"].update(has_gauss=2), r"'numpy\.has_gauss' is 2"),
        (lambda s: s.update(cuda=["AAAA"]), r"'cuda\.0': 3 bytes, a CUDA generator's"),
    ],
)
def test_malformed_records_name_the_key_and_change_nothing(edit, match):
    bad = _broken(edit)
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    before = capture_rng_state()
    with pytest.raises(RngStateError, match=match):
        restore_rng_state(bad)
    assert capture_rng_state() == before  # no generator was touched


def test_not_a_dict():
    with pytest.raises(RngStateError, match="must be a dict, got list"):
        restore_rng_state([1, 2])


def test_cuda_states_on_a_machine_without_cuda_warn_and_restore_the_rest():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    torch.manual_seed(3)
    saved = capture_rng_state()
    assert saved["cuda"] == []
    saved["cuda"] = [base64.b64encode(bytes(16)).decode()]  # as if captured on a GPU machine
    expected = torch.rand(3)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        restore_rng_state(saved)
    assert torch.equal(torch.rand(3), expected)
