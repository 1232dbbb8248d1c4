"""Trajectory dumps: the seed's path layout and fields, text decoding, atomic writes."""

from __future__ import annotations

import json

from relayrl.trajectory.batch import RowBatch
from relayrl.workflow import TrajectoryDumper, rows_from_tensor_dict, tokenizer_decoder
from tests.workflow.helpers import make_td


def _group() -> RowBatch:
    a = make_td(1, 5, reward=1.0, prompt_len=2, version=3)
    b = make_td(1, 7, reward=0.0, prompt_len=3, version=4)
    b["versions"][0, 6] = 5  # a weight update landed before the last token
    return RowBatch.concat([RowBatch.of_episode(rows_from_tensor_dict(a, "e0"), "e0", "g"),
                            RowBatch.of_episode(rows_from_tensor_dict(b, "e1"), "e1", "g")])


def test_a_group_is_dumped_in_the_seed_layout_one_line_per_sample(tmp_path) -> None:
    dumper = TrajectoryDumper(tmp_path, "exp", "trial1")
    path = dumper.dump(_group(), task_id="42", version=5)
    assert path == tmp_path / "exp" / "trial1" / "rollout" / "5" / "42.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["sample_idx"] for x in lines] == [0, 1]
    first, second = lines
    assert {"task_id", "sample_idx", "seqlen", "prompt_len", "head_version", "tail_version",
            "reward", "prompt", "completion"} <= set(first)
    assert (first["task_id"], first["seqlen"], first["prompt_len"]) == ("42", 5, 2)
    assert (second["seqlen"], second["prompt_len"]) == (7, 3)
    assert (first["head_version"], first["tail_version"]) == (3, 3)
    assert (second["head_version"], second["tail_version"]) == (4, 5)
    assert (first["reward"], second["reward"]) == (1.0, 0.0)
    assert first["prompt"] == [1, 2] and first["completion"] == [3, 4, 5]  # no tokenizer: ids
    assert (first["episode_id"], second["group_id"]) == ("e0", "g")
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_eval_dumps_go_under_eval_rollout_and_text_is_decoded(tmp_path, model_dir) -> None:
    decode = tokenizer_decoder(model_dir)
    dumper = TrajectoryDumper(tmp_path, "exp", "t", decode=decode)
    td = _group()
    path = dumper.dump(td, task_id="7", version=0, is_eval=True)
    assert path.parts[-3:] == ("eval-rollout", "0", "7.jsonl")
    first = json.loads(path.read_text().splitlines()[0])
    assert first["prompt"] == decode([1, 2])
    assert first["completion"] == decode([3, 4, 5])


def test_a_rewrite_replaces_the_file_whole(tmp_path) -> None:
    dumper = TrajectoryDumper(tmp_path, "exp", "t")
    dumper.dump(_group(), task_id="1", version=0)
    one = RowBatch.of_episode(rows_from_tensor_dict(make_td(1, 4), "x"), "x", "y")
    path = dumper.dump(one, task_id="1", version=0)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["episode_id"] == "x"
    assert json.loads(lines[0])["seqlen"] == 4
