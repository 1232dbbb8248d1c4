"""Trajectory dumps: every accepted group's rows as JSON Lines, for reading what the policy did.

Layout (as AReaL's trajectory dumps): `{fileroot}/{experiment}/{trial}/{rollout|eval-rollout}/{version}/{task_id}.jsonl`,
one line per row with `task_id, sample_idx, seqlen, prompt_len, head_version, tail_version,
reward, prompt, completion` (plus `episode_id` and `group_id`, and `role` where the row has one).
`prompt` is the text before the row's first trained token, `completion` the rest (tool results
and later turns included). Each
file is written to a temporary name and renamed, so a reader never sees half a file.

Tradeoff: text needs a tokenizer; without a `decode` function the two text fields hold the token
ids instead, so a dump never needs the model to be loadable.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relayrl.trajectory.batch import RowBatch
from relayrl.types import PROMPT_VERSION
from relayrl.workflow.context import EVAL_SCOPE, ROLLOUT_SCOPE

Decode = Callable[[Sequence[int]], str]


def tokenizer_decoder(model_dir: str | Path) -> Decode:
    """A decode function from a model directory's `tokenizer.json` (special tokens kept)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


class TrajectoryDumper:
    """Writes groups of rows under `{fileroot}/{experiment}/{trial}/...`."""

    def __init__(self, fileroot: str | Path, experiment: str, trial: str,
                 decode: Decode | None = None) -> None:
        self.root = Path(fileroot) / experiment / trial
        self.decode = decode

    def path(self, task_id: str, version: int, is_eval: bool = False) -> Path:
        """Where the rows of `task_id` sampled at `version` go."""
        scope = EVAL_SCOPE if is_eval else ROLLOUT_SCOPE
        return self.root / scope / str(version) / f"{task_id}.jsonl"

    def records(self, batch: RowBatch, task_id: str) -> list[dict[str, Any]]:
        """One JSON-ready record per row of `batch`."""
        return [self._record(batch, i, task_id) for i in range(batch.num_rows)]

    def _record(self, batch: RowBatch, i: int, task_id: str) -> dict[str, Any]:
        row = batch.rows[i]
        ids = row.input_ids
        prompt_len = row.loss_mask.index(1) if 1 in row.loss_mask else len(ids)
        versions = [v for v, m in zip(row.versions, row.loss_mask, strict=True) if m]
        record = {
            "task_id": task_id,
            "sample_idx": i,
            "seqlen": len(ids),
            "prompt_len": prompt_len,
            "head_version": versions[0] if versions else PROMPT_VERSION,
            "tail_version": versions[-1] if versions else PROMPT_VERSION,
            "reward": row.reward,
            "prompt": self._text(ids[:prompt_len]),
            "completion": self._text(ids[prompt_len:]),
            "episode_id": batch.episode_ids[i],
            "group_id": batch.group_ids[i],
        }
        if row.role is not None:  # multi-agent runs: which agent the row trains
            record["role"] = row.role
        return record

    def _text(self, ids: list[int]) -> str | list[int]:
        return self.decode(ids) if self.decode is not None else ids

    def dump(self, batch: RowBatch, task_id: str, version: int, is_eval: bool = False) -> Path:
        """Write `batch`'s rows as `{task_id}.jsonl` under `version`, atomically; returns the path."""
        path = self.path(task_id, version, is_eval)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with tmp.open("w", encoding="utf-8") as f:
                for record in self.records(batch, task_id):
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path
