"""Tensor dicts (AReaL's RolloutWorkflow training format): validation, per-row labels, padded concatenation,
and their conversion to `TrajectoryRow`s, the form everything after an episode handles.

A tensor dict maps field names to `[B, T]` (or `[B]`) tensors. Two optional *label* fields,
`episode_ids` and `group_ids`, are tuples of strings with one entry per row: they let every row
keep the episode and group it came from through merging and batching, without a side table
that could fall out of step with the tensors. Validation is strict (no silent dtype casts) so a
workflow that builds its tensors wrongly fails at the episode, naming the field, rather than
deep in the trainer. torch is imported inside the functions, so that importing the workflow
package (as every subprocess agent worker does) does not pay for torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relayrl.errors import InvalidRequest
from relayrl.trajectory.export import TrajectoryRow
from relayrl.types import PROMPT_VERSION

if TYPE_CHECKING:
    import torch

TensorDict = dict[str, Any]
"""Field name -> tensor (`[B, T]` or `[B]`), plus optional label tuples (`episode_ids`, ...)."""

LABEL_FIELDS = ("episode_ids", "group_ids")
"""Per-row string labels carried next to the tensors."""

REQUIRED_FIELDS: dict[str, str] = {"input_ids": "int32", "attention_mask": "bool"}
"""Field -> torch dtype name."""
OPTIONAL_FIELDS: dict[str, str] = {
    "loss_mask": "int32",
    "logprobs": "float32",
    "versions": "int32",
    "rewards": "float32",
}
PER_ROW_FIELDS = frozenset({"rewards"})
"""Fields shaped `[B]`; every other known field is `[B, T]`."""

PAD_VALUES: dict[str, float | int | bool] = {
    "input_ids": 0,
    "attention_mask": False,
    "loss_mask": 0,
    "logprobs": 0.0,
    "versions": PROMPT_VERSION,
}
"""What right-padding fills each `[B, T]` field with (0 for fields not listed)."""


def batch_size(td: Mapping[str, Any]) -> int:
    """Number of rows in a (valid) tensor dict."""
    return int(td["input_ids"].shape[0])


def validate_tensor_dict(td: Mapping[str, Any]) -> None:
    """Raise InvalidRequest naming the first field whose presence, shape or dtype is wrong."""
    import torch

    if not isinstance(td, Mapping):
        raise InvalidRequest(f"a tensor dict must be a dict, got {type(td).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in td:
            raise InvalidRequest(f"tensor dict has no {name!r} field (required: "
                                 f"{sorted(REQUIRED_FIELDS)})")
    ids = td["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise InvalidRequest(f"tensor dict field 'input_ids': expected a [batch, seq_len] tensor, "
                             f"got {_describe(ids)}")
    b, t = ids.shape
    for name, value in td.items():
        if name in LABEL_FIELDS:
            _check_labels(name, value, b)
            continue
        if not isinstance(value, torch.Tensor):
            raise InvalidRequest(f"tensor dict field {name!r}: expected a tensor, "
                                 f"got {_describe(value)}")
        dtype_name = REQUIRED_FIELDS.get(name) or OPTIONAL_FIELDS.get(name)
        want = getattr(torch, dtype_name) if dtype_name else None
        if want is not None and value.dtype != want:
            raise InvalidRequest(f"tensor dict field {name!r}: expected dtype {want}, "
                                 f"got {value.dtype}")
        if name in PER_ROW_FIELDS:
            if tuple(value.shape) != (b,):
                raise InvalidRequest(f"tensor dict field {name!r}: expected shape [{b}] "
                                     f"(one per row), got {list(value.shape)}")
        elif want is not None and tuple(value.shape) != (b, t):
            raise InvalidRequest(f"tensor dict field {name!r}: expected shape [{b}, {t}] "
                                 f"like input_ids, got {list(value.shape)}")
        elif value.ndim == 0 or value.shape[0] != b:
            raise InvalidRequest(f"tensor dict field {name!r}: expected {b} rows like "
                                 f"input_ids, got shape {list(value.shape)}")


def _check_labels(name: str, value: Any, rows: int) -> None:
    if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest(f"tensor dict field {name!r}: expected a tuple of strings, "
                             f"got {_describe(value)}")
    if len(value) != rows:
        raise InvalidRequest(f"tensor dict field {name!r}: {len(value)} labels for {rows} rows")


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__


def with_labels(td: Mapping[str, Any], episode_id: str, group_id: str) -> TensorDict:
    """A copy of `td` whose rows all carry these labels (existing labels are kept)."""
    out = dict(td)
    b = batch_size(td)
    out.setdefault("episode_ids", (episode_id,) * b)
    out.setdefault("group_ids", (group_id,) * b)
    return out


def concat_padded(parts: Sequence[Mapping[str, Any]]) -> TensorDict:
    """Concatenate tensor dicts along rows, right-padding `[B, T]` fields to the longest T."""
    import torch

    if not parts:
        raise InvalidRequest("nothing to concatenate")
    keys = set(parts[0])
    for i, p in enumerate(parts[1:], start=1):
        if set(p) != keys:
            diff = sorted(keys.symmetric_difference(p))
            raise InvalidRequest(f"tensor dict {i} has different fields from tensor dict 0: "
                                 f"{diff}")
    t = max(int(p["input_ids"].shape[1]) for p in parts)
    out: TensorDict = {}
    for name in parts[0]:
        if name in LABEL_FIELDS:
            out[name] = tuple(label for p in parts for label in p[name])
        elif name in PER_ROW_FIELDS or parts[0][name].ndim < 2:
            out[name] = torch.cat([p[name] for p in parts])
        else:
            out[name] = torch.cat([_pad_to(p[name], t, PAD_VALUES.get(name, 0)) for p in parts])
    return out


def _pad_to(x: torch.Tensor, t: int, value: float | int | bool) -> torch.Tensor:
    import torch

    if x.shape[1] == t:
        return x
    pad_shape = (x.shape[0], t - x.shape[1], *x.shape[2:])
    return torch.cat([x, torch.full(pad_shape, value, dtype=x.dtype)], dim=1)


def rows_from_tensor_dict(td: Mapping[str, Any], episode_id: str,
                          task_id: str | None = None) -> list[TrajectoryRow]:
    """A validated tensor dict as `TrajectoryRow`s: the edge where tensor dicts become rows.

    Each row keeps its real tokens (the attention mask's prefix); its turns are the runs of
    trained tokens, each credited with the row's reward. Fields the dict lacks are filled with
    their neutral value and named in `metadata["missing"]`, so the trainer can refuse rows that
    carry no loss mask or behaviour logprobs instead of training on made-up numbers.
    """
    validate_tensor_dict(td)
    b = batch_size(td)
    missing = sorted(k for k in ("loss_mask", "logprobs", "versions", "rewards") if k not in td)
    lengths = td["attention_mask"].sum(dim=1).tolist()
    episodes = td.get("episode_ids") or (episode_id,) * b
    return [_row_from_tensors(td, i, int(lengths[i]), episodes[i], task_id, missing)
            for i in range(b)]


def _row_from_tensors(td: Mapping[str, Any], i: int, n: int, episode_id: str,
                      task_id: str | None, missing: list[str]) -> TrajectoryRow:
    def field(name: str, default: float | int) -> list[Any]:
        return td[name][i, :n].tolist() if name in td else [default] * n

    loss_mask = [int(bool(m)) for m in field("loss_mask", 0)]
    spans = _runs_of_ones(loss_mask)
    reward = float(td["rewards"][i]) if "rewards" in td else 0.0
    segment = f"{episode_id}/row{i}"
    return TrajectoryRow(
        session_id=episode_id, task_id=task_id, segment_id=segment, style="concat",
        interaction_ids=[f"{segment}/turn{k}" for k in range(len(spans))],
        input_ids=[int(t) for t in td["input_ids"][i, :n].tolist()], loss_mask=loss_mask,
        logprobs=[float(x) for x in field("logprobs", 0.0)],
        versions=[int(v) for v in field("versions", PROMPT_VERSION)],
        reward=reward, turn_spans=spans, turn_rewards=[reward] * len(spans),
        metadata={"source": "tensor_dict", "missing": missing} if missing
        else {"source": "tensor_dict"},
    )


def _runs_of_ones(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in `mask`."""
    runs: list[tuple[int, int]] = []
    start = None
    for t, m in enumerate([*mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs
