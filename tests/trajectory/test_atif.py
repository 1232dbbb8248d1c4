"""ATIF export: a recorded session, through `relayrl export`, as Harbor's ATIF v1.8 with tokens,
validated by Harbor's own models and validator (in .venv-harbor, scripts/install_harbor.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from relayrl.chat.renderer import Renderer
from relayrl.cli import main
from relayrl.errors import InvalidRequest
from relayrl.trajectory.atif import read_sft_rows
from tests.gateway.conftest import fake_gateway
from tests.trajectory.harbor import harbor_validate, needs_harbor

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def chat(url: str, key: str, messages: list[dict], **kw: object) -> dict:
    r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                   json={"model": "m", "messages": messages, **kw}, timeout=60)
    r.raise_for_status()
    return r.json()


@pytest.fixture
def recorded(model_dir: str, tmp_path: Path) -> tuple[Path, str]:
    """A durable log holding one session: a tool-using turn pair, then an edited history."""
    log = tmp_path / "gw.sqlite"
    gw = fake_gateway(model_dir, tmp_log=str(log))
    assert gw.script is not None
    gw.script.replies += ['<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
                          "</tool_call>", "Sunny in Paris.", "A different answer."]
    try:
        s = gw.start_session(task_id="weather-1")
        key = s["api_key"]
        user = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"}]
        r1 = chat(gw.url, key, user, tools=[WEATHER])["choices"][0]["message"]
        tool = {"role": "tool", "tool_call_id": r1["tool_calls"][0]["id"], "content": "sunny"}
        chat(gw.url, key, [*user, r1, tool], tools=[WEATHER])
        # the agent rewrites its history: a new segment
        chat(gw.url, key, [*user, {"role": "assistant", "content": "I think it rains."},
                           {"role": "user", "content": "Sure?"}])
        h = {"authorization": f"Bearer {key}"}
        httpx.post(gw.url + "/rl/set_reward", json={"reward": 1.0}, headers=h,
                   timeout=60).raise_for_status()
        httpx.post(gw.url + "/rl/end_session", headers=h, timeout=60).raise_for_status()
        session = gw.deps.store.get(s["session_id"])
        assert session.stats().segments == 2
        return log, s["session_id"]
    finally:
        gw.thread.stop()


def test_export_writes_one_atif_trajectory_per_session_with_its_tokens(
        recorded: tuple[Path, str], tmp_path: Path) -> None:
    log, sid = recorded
    out = tmp_path / "atif"
    assert main(["export", str(log), "--format", "atif", "--out", str(out),
                 "--model-name", "smollm2"]) == 0
    traj = json.loads((out / f"{sid}.json").read_text())
    assert traj["schema_version"] == "ATIF-v1.8" and traj["session_id"] == sid
    assert traj["extra"]["relayrl"]["task_id"] == "weather-1"
    steps = traj["steps"]
    assert [s["source"] for s in steps] == ["system", "user", "agent", "agent"]
    call, answer = steps[2], steps[3]
    assert call["tool_calls"][0]["function_name"] == "weather"
    assert call["tool_calls"][0]["arguments"] == {"city": "Paris"}
    result = call["observation"]["results"][0]
    assert result["source_call_id"] == call["tool_calls"][0]["tool_call_id"]
    assert result["content"] == "sunny"
    m1, m2 = call["metrics"], answer["metrics"]
    # the second call's prompt extends the first call's prompt + output: the same tokens
    assert m2["prompt_token_ids"][: len(m1["prompt_token_ids"])] == m1["prompt_token_ids"]
    assert len(m1["logprobs"]) == len(m1["completion_token_ids"]) == m1["completion_tokens"]
    assert answer["message"] == "Sunny in Paris."
    assert answer["extra"]["reward"] is None  # set_reward went to the session's last call
    assert all(v == 0 for v in m1["extra"]["versions"])
    sub = traj["subagent_trajectories"]
    assert len(sub) == 1 and sub[0]["extra"]["branch_reason"] == "history_edited"
    # the edited assistant turn was written by the client, not sampled: no metrics
    edited = [s for s in sub[0]["steps"] if s["source"] == "agent"]
    assert "metrics" not in edited[0] and edited[-1]["metrics"]["completion_tokens"] > 0
    assert edited[-1]["extra"]["reward"] == 1.0


@needs_harbor
def test_harbors_own_validator_accepts_the_export(recorded: tuple[Path, str],
                                                  tmp_path: Path) -> None:
    log, sid = recorded
    out = tmp_path / "atif"
    assert main(["export", str(log), "--out", str(out)]) == 0
    assert harbor_validate(out / f"{sid}.json", "len(t.steps)", "len(subs)") == [4, 1]


def test_export_of_training_rows_from_the_same_log(recorded: tuple[Path, str],
                                                   tmp_path: Path) -> None:
    log, _ = recorded
    out = tmp_path / "rows"
    assert main(["export", str(log), "--format", "jsonl", "--out", str(out)]) == 0
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 2  # one row per segment
    assert main(["export", str(tmp_path / "missing.sqlite"), "--out", str(out)]) == 2


def test_an_exported_trajectory_imports_as_rows_with_the_recorded_tokens(
        recorded: tuple[Path, str], tmp_path: Path, model_dir: str) -> None:
    log, sid = recorded
    out = tmp_path / "atif"
    assert main(["export", str(log), "--out", str(out)]) == 0
    rows = read_sft_rows(out, model_dir)
    # two calls in the first segment; in the edited one, the client's own assistant turn
    # (rendered: it has no tokens) and the call answering it
    assert [r.metadata["tokens"] for r in rows] == ["recorded", "recorded", "rendered",
                                                    "recorded"]
    traj = json.loads((out / f"{sid}.json").read_text())
    call = traj["steps"][2]["metrics"]
    first = rows[0]
    assert first.metadata["tokens"] == "recorded"
    assert first.input_ids == call["prompt_token_ids"] + call["completion_token_ids"]
    assert sum(first.loss_mask) == len(call["completion_token_ids"])
    assert first.logprobs[-len(call["logprobs"]):] == call["logprobs"]
    assert rows[-1].reward == 1.0


def test_a_trajectory_without_tokens_is_rendered_with_the_models_template(
        model_dir: str, tmp_path: Path) -> None:
    traj = {"schema_version": "ATIF-v1.6", "agent": {"name": "other-tool", "version": "1"},
            "steps": [{"step_id": 1, "source": "user", "message": "Say hi."},
                      {"step_id": 2, "source": "agent", "message": "Hi!"}],
            "final_metrics": {"extra": {"reward": 0.5}}}
    (tmp_path / "t.json").write_text(json.dumps(traj))
    [row] = read_sft_rows(tmp_path / "t.json", model_dir)
    assert row.metadata["tokens"] == "rendered" and row.reward == 0.5
    renderer = Renderer.from_pretrained(model_dir)
    trained = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert renderer.decode(trained).startswith("Hi!")
    (tmp_path / "bad.json").write_text(json.dumps({"schema_version": "v9", "steps": []}))
    with pytest.raises(InvalidRequest, match="not an ATIF"):
        read_sft_rows(tmp_path / "bad.json", model_dir)
