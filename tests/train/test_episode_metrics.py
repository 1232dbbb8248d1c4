"""Episode metrics (tool use, turns, segments), their export metadata, and the training plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from relayrl.chat.conversation import Message, ToolCall
from relayrl.train.metrics import (
    MetricsLogger,
    episode_metrics,
    eval_points,
    plot_training,
    smooth,
    trained_tokens,
)
from relayrl.train.trainer import EvalResult, TrainResult, _eval_extras
from relayrl.trajectory import Session, export_session
from relayrl.trajectory.batch import RowBatch
from relayrl.types import FinishReason
from tests.trajectory import call

USER = Message("user", "2+3?")


def _episode(name: str, build: Callable[[Session], None]) -> RowBatch:
    s = Session(name, task_id="t")
    build(s)
    return RowBatch.of_episode(export_session(s), name, "g")


def _tool_then_answer(s: Session) -> None:
    add = ToolCall("c1", "add", '{"a": 2, "b": 3}')
    call(s, [USER], "", tool_calls=[add])
    call(s, [USER, Message("assistant", "", tool_calls=(add,)),
             Message("tool", "5", tool_call_id="c1")], "5")
    s.set_final_reward(1.0)


def _answer_directly(s: Session) -> None:
    call(s, [USER], "5")
    s.set_final_reward(1.0)


def _malformed_and_cut(s: Session) -> None:
    call(s, [USER], '<tool_call>{"name": "add", "argu', finish=FinishReason.LENGTH)
    s.set_final_reward(0.0)


def _edited_history(s: Session) -> None:
    call(s, [USER], "4")
    call(s, [USER, Message("assistant", "5"), Message("user", "sure?")], "yes")  # edited
    s.set_final_reward(0.0)


def _batch() -> RowBatch:
    return RowBatch.concat([_episode("a", _tool_then_answer), _episode("b", _answer_directly),
                            _episode("c", _malformed_and_cut), _episode("d", _edited_history)])


def test_export_rows_carry_tool_calls_and_parse_failures_per_call() -> None:
    a = _episode("a", _tool_then_answer).rows
    assert [r.metadata["tool_calls"] for r in a] == [[1, 0]]
    assert [r.metadata["tool_parse_failures"] for r in a] == [[0, 0]]
    (c,) = _episode("c", _malformed_and_cut).rows
    assert c.metadata["tool_parse_failures"] == [1] and c.metadata["tool_calls"] == [0]


def test_episode_metrics_count_each_call_once_per_episode() -> None:
    m = episode_metrics(_batch())
    assert m["tool_call_rate"] == pytest.approx(1 / 6)
    assert m["tool_calls_per_call"] == pytest.approx(1 / 6)
    assert m["tool_parse_failure_rate"] == pytest.approx(1 / 6)
    assert m["truncated_call_rate"] == pytest.approx(1 / 6)
    assert m["turns_per_episode"] == pytest.approx(6 / 4)
    assert m["segments_per_episode"] == pytest.approx(5 / 4)  # d's edit opened a second one
    assert m["rewarded_without_tools"] == pytest.approx(1 / 2)  # b earned 1.0 with no tool
    assert trained_tokens(_batch()) == sum(sum(r.loss_mask) for r in _batch().rows) > 0
    assert episode_metrics(RowBatch((), (), ())) == {}


def test_smoothing_and_eval_points() -> None:
    assert smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # no pull towards 0
    s = smooth([0.0, 1.0, 0.0, 1.0])
    assert 0 < s[-1] < 1 and max(s) < 1
    records = [
        {"step": 2, "reward_mean": 0.5, "eval_reward": 0.4, "eval_reward_se": 0.05},
        {"step": 4, "eval_before_step": 0, "eval_reward_before": 0.333,
         "eval_reward_before_se": 0.1, "eval_reward_after": 0.458, "eval_reward_after_se": 0.1},
    ]
    assert eval_points(records) == [(0.0, 0.333, 0.1, "before"), (2.0, 0.4, 0.05, "during"),
                                    (4.0, 0.458, 0.1, "after")]


def test_summary_reports_tool_call_rate_before_and_after(tmp_path: Path) -> None:
    before = EvalResult(0.333, 24, 0, 0, stderr=0.09, tool_call_rate=0.25)
    after = EvalResult(0.458, 24, 0, 0, stderr=0.1, tool_call_rate=0.75)
    line = TrainResult(12, None, None, before, after, None, tmp_path, 60.0).summary()
    assert "before RL 0.333 -> after RL 0.458" in line
    assert "tool-call rate 0.250 -> 0.750" in line
    extras = _eval_extras({"eval_reward_before": before, "eval_reward_after": after,
                           "eval_reward_base": None})
    assert extras == {"eval_reward_before_se": 0.09, "eval_tool_call_rate_before": 0.25,
                      "eval_reward_after_se": 0.1, "eval_tool_call_rate_after": 0.75}


def test_the_training_plot_renders_evals_beside_smoothed_reward(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "logs", tensorboard=False) as logger:
        for step in range(1, 13):
            noisy = 0.3 + 0.02 * step + (0.25 if step % 2 else -0.25)
            logger.log(step, {"reward_mean": noisy, "loss": 1 / step, "approx_kl": 0.01 * step,
                              "tool_call_rate": 0.4 + 0.03 * step,
                              "tool_parse_failure_rate": 0.1 / step,
                              "turns_per_episode": 2.0, "segments_per_episode": 1.1,
                              "trained_tokens_per_s": 300.0 + step,
                              "aborted_episodes": step // 3, "aborted/TimeoutError": step // 4,
                              "aborted/EpisodeFailed": step // 6,
                              **({"eval_reward": 0.33 + 0.01 * step, "eval_reward_se": 0.08,
                                  "eval_tool_call_rate": 0.5} if step % 4 == 0 else {})})
        logger.log(12, {"eval_before_step": 0, "eval_reward_before": 0.333,
                        "eval_reward_before_se": 0.09, "eval_reward_after": 0.458,
                        "eval_reward_after_se": 0.1, "eval_tool_call_rate_before": 0.3,
                        "eval_tool_call_rate_after": 0.8})
        png = logger.plot(tmp_path / "reward_loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().split("\n")
               if x]
    assert len(eval_points(records)) == 5  # before, steps 4, 8, 12, after
    assert plot_training([], tmp_path / "empty.png").stat().st_size > 1000  # no data: still a PNG
