"""The remote rollout example's warm-up traces and its one-command training run, CI-sized."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.examples import load_example

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "remote_rollout"


def _load(name: str) -> ModuleType:
    return load_example("remote_rollout", name, on_path=True)


def test_teacher_traces_are_the_calculator_servers_tool_calls(model_dir: str) -> None:
    from tests.remote_rollout.conftest import start_rollout_server

    teacher = _load("calc_teacher")
    tasks = [json.loads(x) for x in (ROOT / "examples" / "math_agent" / "train.jsonl")
             .read_text().splitlines()[:6]]
    server, state = start_rollout_server()
    try:
        rows = teacher.generate_traces(model_dir, tasks, 6, server.url)
    finally:
        server.stop()
    assert len(rows) == 6 and state.completed == 6 and state.errors == 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    for row, task in zip(rows, tasks, strict=True):
        assert row["reward"] == 1.0
        assert row["metadata"]["remote_rollout"]["mask_mismatches"] == 0
        text = tok.decode(row["input_ids"], skip_special_tokens=False)
        # the server's four tools are in the rendered system prompt the model is trained on
        for name in ("add", "subtract", "multiply", "divide"):
            assert f'"name": "{name}"' in text
        trained = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True)
                              if m], skip_special_tokens=False)
        calls = re.findall(r'<tool_call>\n\{"name": "(add|multiply)", "arguments": '
                           r'\{"a": -?[\d.]+, "b": -?[\d.]+\}\}\n</tool_call>', trained)
        assert calls and trained.endswith(f"The answer is {task['answer']}.<|im_end|>")
        assert "<tool_response>" not in trained  # tool results are never trained on


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> str:
    """A 2-layer Llama with the default model's tokenizer and room for the ~600-token traces."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from relayrl.train.checkpoint import copy_tokenizer_files

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-2k")
    LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, tie_word_embeddings=True, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048)).save_pretrained(path)
    copy_tokenizer_files(model_dir, path)
    return str(path)


@pytest.mark.slow
def test_train_py_starts_the_server_warms_up_trains_and_stops_it(tiny_model_dir: str,
                                                                 tmp_path: Path) -> None:
    overrides = [
        f"model={tiny_model_dir}", f"fileroot={tmp_path / 'runs'}", "trial_name=ci",
        "sft.max_rows=4", "sft.rows_per_step=2", "eval.max_items=2", "eval.base=false",
        "train.total_steps=1", "rollout.group_size=2", "rollout.batch_size=1",
        "rollout.max_concurrent_rollouts=2", "train.drop_uniform_groups=false",
        f"data.train={ROOT / 'examples' / 'math_agent' / 'train.jsonl'}",
        f"data.eval={ROOT / 'examples' / 'math_agent' / 'eval.jsonl'}",
    ]
    proc = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "generating 4 warm-up traces" in out and "eval before RL" in out
    assert "held-out reward" in out and "total wall time" in out
    run = tmp_path / "runs" / "remote_rollout" / "ci"
    assert len((run / "warmup_traces.jsonl").read_text().splitlines()) == 4
    assert (run / "logs" / "sft" / "metrics.jsonl").read_text()  # the warm-start ran
    steps = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in steps if m["step"] == 1 and "step_s" in m)
    # the rollouts went through the server: their masks were checked and agreed
    assert step["workflow/episodes"] >= 2 and step["workflow/mask_checks"] >= 2
    assert step["workflow/mask_mismatches"] == 0
    assert re.search(r"^step 1/1 .* workflow .*mask_mismatches=0", out, re.M)
    pid = int(re.search(r"child process (\d+)", out).group(1))  # type: ignore[union-attr]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server was stopped with the run
