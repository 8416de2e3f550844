"""Plain values of the state: what JSON would change is refused, non-finite floats travel."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, OrderedDict, UserList, defaultdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unbroken.checkpoint import json_values
from unbroken.checkpoint.json_values import FLOAT_TAG, check, decode, encode

plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


def same(a, b) -> bool:
    """Equality in which nan equals nan and the types match exactly."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class ListOf(list):
    """A list of the user's own kind: its methods would not come back."""


def strict_loads(data: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(data, parse_constant=refuse)


@given(plain)
def test_every_plain_value_comes_back_exactly_through_strict_json(value):
    check("state['v']", value)
    text = json.dumps(encode(value), allow_nan=False)
    assert same(decode(strict_loads(text)), value)


def test_non_finite_floats_are_tagged():
    value = {"best": math.inf, "worst": -math.inf, "loss": [1.5, math.nan]}
    doc = encode(value)
    assert doc == {
        "best": {FLOAT_TAG: "inf"},
        "worst": {FLOAT_TAG: "-inf"},
        "loss": [1.5, {FLOAT_TAG: "nan"}],
    }
    assert value["best"] == math.inf  # encode copies, the caller's value is untouched


@dataclasses.dataclass
class _Point:
    x: int
    y: int


@pytest.mark.parametrize(
    "value, match",
    [
        ((1, 2), r"state\['v'\] is a tuple, which would come back .* as a list"),
        ({"a": [0, (1,)]}, r"state\['v'\]\['a'\]\[1\] is a tuple"),
        ({3: "x"}, r"state\['v'\] has the key 3 \(int\), which would come back .* as a string"),
        ({"a": {None: 1}}, r"state\['v'\]\['a'\] has the key None"),
        ({FLOAT_TAG: "inf"}, r"only key is '__float__'"),
        ([object()], r"state\['v'\]\[0\] is an object, which JSON cannot hold"),
        ({"s": {1, 2}}, r"state\['v'\]\['s'\] is a set"),
        (defaultdict(int), r"is a defaultdict, which would come back .* as a plain dict"),
        ({"c": Counter("ab")}, r"state\['v'\]\['c'\] is a Counter.* dict\(value\)"),
        (OrderedDict(a=1), r"is an OrderedDict"),
        (np.float32(1), r"is a numpy.float32, which JSON cannot hold; store value.item\(\)"),
        (np.zeros(2), r"is a numpy.ndarray, .*; store value.tolist\(\), or a tensor"),
        (_Point(1, 2), r"is a _Point, .*; store dataclasses.asdict\(value\)"),
        (UserList([1]), r"is a UserList, which JSON cannot hold"),
        ([ListOf([1])], r"state\['v'\]\[0\] is a ListOf, .* as a plain list"),
    ],
)
def test_what_json_would_change_is_refused_by_path(value, match):
    with pytest.raises(TypeError, match=match):
        check("state['v']", value)


def test_a_value_that_contains_itself_is_refused():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(TypeError, match=r"state\['v'\]\[1\] contains itself"):
        check("state['v']", loop)
    shared = [1]
    check("state['v']", [shared, shared])  # the same list twice is no loop


def test_a_tag_like_mapping_from_an_old_manifest_is_left_alone():
    assert decode({FLOAT_TAG: "big"}) == {FLOAT_TAG: "big"}
    assert json_values.decode({"a": {FLOAT_TAG: "inf", "b": 1}}) == {
        "a": {FLOAT_TAG: "inf", "b": 1}
    }


def test_rank_values_names_only_what_differs_from_rank_0():
    from unbroken.checkpoint.json_values import rank_values

    values = {"epoch": 3, "seen": [0]}
    per_rank = [values, {"epoch": 3, "seen": [1]}, {"epoch": 3, "seen": [0]}]
    assert rank_values(values, per_rank) == {"1": {"seen": [1]}}
    assert rank_values(values, [values, values]) == {}
