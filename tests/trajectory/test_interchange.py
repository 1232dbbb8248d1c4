from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.errors import InvalidRequest
from relayrl.trajectory import (
    SCHEMA_VERSION,
    Session,
    TrajectoryRow,
    export_session,
    read_jsonl,
    read_parquet,
    row_from_dict,
    row_to_dict,
    write_jsonl,
    write_parquet,
)

from . import assistant, call, sys_msg, three_turn_session, user

DOC = Path(__file__).resolve().parents[2] / "docs" / "trajectory-format.md"


def _rows() -> list[TrajectoryRow]:
    s = Session("s-1", task_id="t-1", metadata={"note": "ünïcode", "n": 3})
    three_turn_session(s)
    h = [sys_msg(), user("other")]
    call(s, h, "x")
    call(s, [*h, assistant("x"), user("y")], "z")
    s.set_final_reward(0.5)
    untasked = Session("s-2")
    three_turn_session(untasked)
    return (export_session(s, "individual", discount=0.9)
            + export_session(s, "concat", credit="returns_to_go", discount=0.9)
            + export_session(untasked, "concat"))


def test_jsonl_round_trip_keeps_every_field(tmp_path: Path) -> None:
    rows = _rows()
    path = tmp_path / "rows.jsonl"
    assert write_jsonl(rows, path) == len(rows)
    assert read_jsonl(path) == rows
    for line in path.read_text(encoding="utf-8").splitlines():
        assert json.loads(line)["schema_version"] == SCHEMA_VERSION


def test_jsonl_append_adds_lines(tmp_path: Path) -> None:
    rows = _rows()
    path = tmp_path / "rows.jsonl"
    write_jsonl(rows[:2], path)
    write_jsonl(rows[2:], path, append=True)
    assert read_jsonl(path) == rows


def test_parquet_round_trip_keeps_every_field(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    path = tmp_path / "rows.parquet"
    assert write_parquet(rows, path) == len(rows)
    assert read_parquet(path) == rows
    table = pq.read_table(path)
    assert table.schema.metadata[b"schema_version"] == SCHEMA_VERSION.encode()
    assert table.schema.field("input_ids").type.value_type == pa.int32()


def test_another_major_version_is_refused_and_unknown_fields_are_ignored() -> None:
    row = _rows()[0]
    d = row_to_dict(row)
    assert row_from_dict({**d, "schema_version": "relayrl.trajectory/1.3", "extra": 1}) == row
    for bad in ("relayrl.trajectory/2", "other/1", None):
        with pytest.raises(InvalidRequest, match="schema"):
            row_from_dict({**d, "schema_version": bad})
    with pytest.raises(InvalidRequest, match="malformed"):
        row_from_dict({k: v for k, v in d.items() if k != "input_ids"})


def test_non_json_lines_are_reported_with_their_line_number(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    write_jsonl(_rows()[:1], path)
    with open(path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(InvalidRequest, match=":2:"):
        read_jsonl(path)


def test_the_documented_example_is_a_valid_row() -> None:
    text = DOC.read_text(encoding="utf-8")
    example = re.search(r"## Example.*?```json\n(.*?)```", text, re.S)
    assert example is not None
    row = row_from_dict(json.loads(example.group(1)))
    trained = [i for i, m in enumerate(row.loss_mask) if m]
    assert trained == [i for s, e in row.turn_spans for i in range(s, e)]
    assert all(row.versions[i] == -1 and row.logprobs[i] == 0.0
               for i in range(len(row.input_ids)) if i not in trained)
    assert row.reward == row.turn_rewards[-1]


def test_every_row_field_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name in row_to_dict(_rows()[0]):
        assert f"| `{name}` |" in text, name


def test_the_trajectory_package_imports_without_torch_transformers_or_pyarrow() -> None:
    code = ("import sys, relayrl.trajectory; "
            "print([m for m in ('torch', 'transformers', 'pyarrow') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
