"""The math example's per-form table, read from dumps the real TrajectoryDumper wrote."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from relayrl.errors import ConfigError
from relayrl.trajectory.batch import RowBatch
from relayrl.workflow import TrajectoryDumper, rows_from_tensor_dict, tokenizer_decoder
from tests.examples import load_example
from tests.workflow.helpers import make_td

forms = load_example("math_agent", "forms")

CALL = '<tool_call>\n{{"name": "{}", "arguments": {{"a": 2, "b": 3}}}}\n</tool_call><|im_end|>\n'


def _dump(dumper: TrajectoryDumper, tokenizer, task: int, version: int, tools: list[str],
          reward: float) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    completion = tokenizer.encode("".join(CALL.format(t) for t in tools) + "The answer is 5.")
    td = make_td(1, len(prompt) + len(completion), reward=reward, prompt_len=len(prompt))
    td["input_ids"] = torch.tensor([prompt + completion], dtype=torch.int32)
    rows = rows_from_tensor_dict(td, f"e{task}")
    dumper.dump(RowBatch.of_episode(rows, f"e{task}", f"g{task}"), str(task), version,
                is_eval=True)


def test_the_table_has_each_forms_reward_and_tool_sequences_per_eval(tmp_path,
                                                                     model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dumper = TrajectoryDumper(tmp_path, "math_agent", "t", decode=tokenizer_decoder(model_dir))
    # items 0, 2: "add"; item 1: "multiply" (eval task ids count the items in file order)
    for task, tools, reward in ((0, ["add"], 1.0), (1, ["multiply", "add"], 0.0),
                                (2, ["add", "add"], 0.0)):
        _dump(dumper, tokenizer, task, 0, tools, reward)
    for task, tools, reward in ((0, ["add"], 1.0), (1, ["multiply"], 1.0), (2, ["add"], 1.0)):
        _dump(dumper, tokenizer, task, 12, tools, reward)
    evals = forms.load_evals(tmp_path / "math_agent" / "t")
    table = forms.form_table(evals, ["add", "multiply", "add"]).splitlines()
    assert table[0] == "| form | v0 | v12 |"
    assert table[2] == "| add | 0.50 (a x1, a-a x1) | 1.00 (a x2) |"
    assert table[3] == "| multiply | 0.00 (m-a x1) | 1.00 (m x1) |"
    assert len(table) == 4


def test_the_script_reads_forms_from_the_eval_file(tmp_path, model_dir, capsys) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dumper = TrajectoryDumper(tmp_path, "math_agent", "t", decode=tokenizer_decoder(model_dir))
    _dump(dumper, tokenizer, 0, 0, [], 0.0)
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"messages": [], "answer": "5", "form": "add"}) + "\n")
    forms.main([str(tmp_path / "math_agent" / "t"), "--eval", str(eval_file)])
    assert "| add | 0.00 (none x1) |" in capsys.readouterr().out


def test_a_trial_without_eval_dumps_or_with_unknown_tasks_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.dump_root"):
        forms.load_evals(tmp_path)
    episode = {"task_id": "3", "reward": 1.0, "completion": ""}
    with pytest.raises(ConfigError, match="task 3 is past the 1 eval items"):
        forms.form_table({0: [episode]}, ["add"])
