"""Tensor dicts: strict validation that names the bad field, and padded concatenation."""

from __future__ import annotations

import pytest
import torch

from relayrl.errors import InvalidRequest
from relayrl.workflow import concat_padded, validate_tensor_dict
from tests.workflow.helpers import make_td


def _broken(field: str, value: object) -> dict:
    td = make_td(2, 5)
    if value is None:
        del td[field]
    else:
        td[field] = value
    return td


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("input_ids", None, "'input_ids'"),
        ("attention_mask", None, "'attention_mask'"),
        ("input_ids", torch.zeros(2, 5, dtype=torch.int64), "dtype torch.int32"),
        ("attention_mask", torch.ones(2, 5, dtype=torch.int32), "dtype torch.bool"),
        ("loss_mask", torch.ones(2, 4, dtype=torch.int32), "shape [2, 5]"),
        ("logprobs", torch.zeros(2, 5, dtype=torch.float64), "dtype torch.float32"),
        ("versions", torch.zeros(2, 5, dtype=torch.float32), "dtype torch.int32"),
        ("rewards", torch.zeros(2, 1, dtype=torch.float32), "shape [2]"),
        ("rewards", [1.0, 2.0], "expected a tensor"),
        ("episode_ids", ("a",), "1 labels for 2 rows"),
        ("extra", torch.zeros(3, dtype=torch.float32), "expected 2 rows"),
    ],
)
def test_a_malformed_tensor_dict_is_refused_naming_the_field(field, value, says) -> None:
    with pytest.raises(InvalidRequest) as err:
        validate_tensor_dict(_broken(field, value))
    assert f"'{field}'" in str(err.value)
    assert says in str(err.value)


def test_the_seed_example_tensor_dict_is_valid() -> None:
    validate_tensor_dict({
        "input_ids": torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32),
        "attention_mask": torch.ones(1, 5, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0, 0.0, -0.5, -0.3, -0.2]], dtype=torch.float32),
        "rewards": torch.tensor([1.0], dtype=torch.float32),
        "versions": torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.int32),
    })


def test_concatenation_right_pads_each_field_with_its_neutral_value() -> None:
    short, long = make_td(1, 3, reward=0.0), make_td(2, 6, reward=1.0)
    out = concat_padded([dict(short, episode_ids=("a",)),
                         dict(long, episode_ids=("b", "c"))])
    validate_tensor_dict(out)
    assert out["input_ids"].shape == (3, 6)
    assert out["episode_ids"] == ("a", "b", "c")
    assert out["attention_mask"][0].tolist() == [True] * 3 + [False] * 3
    assert out["loss_mask"][0, 3:].tolist() == [0, 0, 0]
    assert out["versions"][0, 3:].tolist() == [-1, -1, -1]
    assert out["input_ids"][0, :3].tolist() == short["input_ids"][0].tolist()
    assert out["rewards"].tolist() == [0.0, 1.0, 1.0]


def test_concatenating_dicts_with_different_fields_names_the_difference() -> None:
    a, b = make_td(1, 3), make_td(1, 3)
    del b["logprobs"]
    with pytest.raises(InvalidRequest, match="logprobs"):
        concat_padded([a, b])
