"""The trajectory interchange format: `TrajectoryRow`s as JSON Lines or Parquet files.

The format is specified in docs/trajectory-format.md so that trainers other than ours can read
it. Every record carries `schema_version` ("relayrl.trajectory/1"); readers accept the same major
version and ignore fields they do not know, so minor additions do not break old readers.

Tradeoff: JSONL is readable with nothing but a JSON parser and appendable line by line; Parquet
(pyarrow, imported lazily) is columnar and about 4x smaller for token lists. Both hold the same
fields; `metadata` is a JSON object in JSONL and JSON text in Parquet (keeping the Parquet schema
fixed whatever the metadata holds).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from relayrl.errors import InvalidRequest
from relayrl.trajectory.export import TrajectoryRow

SCHEMA_VERSION = "relayrl.trajectory/1"
_SCHEMA_NAME, _SCHEMA_MAJOR = SCHEMA_VERSION.split("/")


def _check_version(version: Any) -> None:
    name, _, major = str(version).partition("/")
    if name != _SCHEMA_NAME or major.split(".")[0] != _SCHEMA_MAJOR:
        raise InvalidRequest(
            f"unsupported trajectory schema {version!r}; this reader understands {SCHEMA_VERSION}"
        )


def row_to_dict(row: TrajectoryRow) -> dict[str, Any]:
    """One record of the interchange format (JSON values only)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": row.session_id,
        "task_id": row.task_id,
        "segment_id": row.segment_id,
        "style": row.style,
        "interaction_ids": list(row.interaction_ids),
        "input_ids": list(row.input_ids),
        "loss_mask": list(row.loss_mask),
        "logprobs": list(row.logprobs),
        "versions": list(row.versions),
        "reward": row.reward,
        "turn_spans": [[s, e] for s, e in row.turn_spans],
        "turn_rewards": list(row.turn_rewards),
        "metadata": row.metadata,
    }


def row_from_dict(d: dict[str, Any]) -> TrajectoryRow:
    """Parse one record (checks `schema_version`; unknown fields are ignored)."""
    _check_version(d.get("schema_version"))
    try:
        return TrajectoryRow(
            session_id=str(d["session_id"]),
            task_id=None if d.get("task_id") is None else str(d["task_id"]),
            segment_id=str(d["segment_id"]),
            style=str(d["style"]),
            interaction_ids=[str(x) for x in d["interaction_ids"]],
            input_ids=[int(x) for x in d["input_ids"]],
            loss_mask=[int(x) for x in d["loss_mask"]],
            logprobs=[float(x) for x in d["logprobs"]],
            versions=[int(x) for x in d["versions"]],
            reward=float(d["reward"]),
            turn_spans=[(int(s), int(e)) for s, e in d["turn_spans"]],
            turn_rewards=[float(x) for x in d["turn_rewards"]],
            metadata=dict(d.get("metadata") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"malformed trajectory record: {exc}") from exc


def write_jsonl(rows: Iterable[TrajectoryRow], path: str | Path, *, append: bool = False) -> int:
    """Write rows, one JSON object per line; returns how many were written."""
    count = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for row in rows:
            # allow_nan=False: NaN/Infinity are not JSON; a non-finite value is an upstream bug
            f.write(json.dumps(row_to_dict(row), ensure_ascii=False, allow_nan=False))
            f.write("\n")
            count += 1
    return count


def iter_jsonl(path: str | Path) -> Iterator[TrajectoryRow]:
    """Rows of a JSONL file, one at a time (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{path}:{lineno}: not JSON: {exc}") from exc
            yield row_from_dict(record)


def read_jsonl(path: str | Path) -> list[TrajectoryRow]:
    """All rows of a JSONL file."""
    return list(iter_jsonl(path))


def _arrow_schema() -> Any:
    import pyarrow as pa  # lazy: optional dependency (the `export` extra)

    return pa.schema(
        [
            ("schema_version", pa.string()),
            ("session_id", pa.string()),
            ("task_id", pa.string()),
            ("segment_id", pa.string()),
            ("style", pa.string()),
            ("interaction_ids", pa.list_(pa.string())),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float64())),
            ("versions", pa.list_(pa.int32())),
            ("reward", pa.float64()),
            ("turn_spans", pa.list_(pa.list_(pa.int32(), 2))),
            ("turn_rewards", pa.list_(pa.float64())),
            ("metadata", pa.string()),
        ],
        metadata={"schema_version": SCHEMA_VERSION},
    )


def write_parquet(rows: Iterable[TrajectoryRow], path: str | Path) -> int:
    """Write rows as one Parquet file; returns how many were written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = []
    for row in rows:
        d = row_to_dict(row)
        d["metadata"] = json.dumps(row.metadata, ensure_ascii=False, allow_nan=False)
        records.append(d)
    table = pa.Table.from_pylist(records, schema=_arrow_schema())
    pq.write_table(table, str(path))
    return len(records)


def read_parquet(path: str | Path) -> list[TrajectoryRow]:
    """All rows of a Parquet file written by `write_parquet` (or any writer of this schema)."""
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    rows = []
    for d in table.to_pylist():
        d["metadata"] = json.loads(d["metadata"]) if d.get("metadata") else {}
        rows.append(row_from_dict(d))
    return rows
