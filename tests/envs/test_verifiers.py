"""relayrl.envs.verifiers with the real verifiers package (0.4, `verifiers.v1`): an installed
environment loaded by its id, run by verifiers' own rollout code against relayrl's per-episode
session URL.

No environment package on PyPI runs offline, so these tests install `tests/envs/vf_packages`'s
environments, each built with verifiers' own classes: `vf-addition` (single turn: `vf.Taskset`,
`vf.Task`, `@vf.reward`), `vf-calculator` (tools: a `vf.Toolset` of `@vf.tool` Python functions,
verifiers 0.4's form of a ToolEnv, served over MCP by verifiers) and `vf-retry` (multi-turn: its
own `vf.Env` answering each turn through an `Interaction`, 0.4's form of a MultiTurnEnv). The
rollouts use verifiers' `null` harness (its chat program, prepared by uv) in the subprocess
runtime, and verifiers' built-in `user-sim` env for the untrainable-seat check. verifiers pins
openai<3, so these run in a venv of their own (see docs/environments/verifiers.md); the
scripted-engine tests here, the real model in the slow ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.errors import ConfigError

PACKAGES = Path(__file__).resolve().parent / "vf_packages"
ROOT = Path(__file__).resolve().parents[2]


vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed: it pins openai<3, "
                         "so it runs in a venv of its own (docs/environments/verifiers.md)")

from relayrl.client.session_client import SessionClient  # noqa: E402
from relayrl.envs import verifiers as vfenv  # noqa: E402
from relayrl.workflow import EpisodeStatus, resolve_workflow, run_episode  # noqa: E402
from tests.episodes import episode_ctx  # noqa: E402
from tests.gateway.conftest import Gateway  # noqa: E402

AGENT = "relayrl.envs.verifiers:VerifiersAgent"


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test environments importable, as `pip install` would make them: here and in the
    tool servers verifiers starts as `python -m <module>`."""
    monkeypatch.syspath_prepend(str(PACKAGES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(PACKAGES), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))


def tool_call(name: str, args: dict[str, object]) -> str:
    """A reply the scripted engine gives: one Hermes-style tool call the gateway parses."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


async def _one_episode(gw: Gateway, client: SessionClient, env_id: str, replies: list[str],
                       **kwargs: object) -> tuple[object, object]:
    """One episode of task 0 of `env_id` with the scripted `replies`; (outcome, workflow)."""
    item = vfenv.make_items(env_id, taskset={"num_tasks": 2})[0]
    workflow = resolve_workflow(AGENT, {"env_id": env_id, "taskset": {"num_tasks": 2},
                                        "max_tokens": 64, **kwargs}, group_size=1,
                                gateway=client)
    try:
        gw.script.replies.extend(replies)
        out = await run_episode(workflow, None, item, episode_ctx())
    finally:
        await workflow.aclose()
    return out, workflow


def _text(gw: Gateway, ids: list[int]) -> str:
    return gw.thread.deps.engine.tokenizer.decode(ids)


def test_an_unknown_environment_id_names_the_close_installed_ones() -> None:
    with pytest.raises(ConfigError, match=r"no verifiers environment 'vf-additon'.*vf_addition"):
        vfenv.make_items("vf-additon")


def test_items_are_the_tasksets_tasks_and_bad_settings_name_the_environment() -> None:
    items = vfenv.make_items("vf-addition", taskset={"num_tasks": 3})
    assert [i["verifiers"]["index"] for i in items] == [0, 1, 2]
    assert items[0]["prompt"].startswith("What is 1 + 3?")
    with pytest.raises(ConfigError, match="verifiers environment 'vf-addition'"):
        vfenv.make_items("vf-addition", taskset={"num_tasks": "many"})


async def test_a_group_runs_through_verifiers_rollout_and_gets_the_rubrics_reward(
        gw, client) -> None:
    item = vfenv.make_items("vf-addition", taskset={"num_tasks": 2})[0]  # 1 + 3
    workflow = resolve_workflow(AGENT, {"env_id": "vf-addition", "taskset": {"num_tasks": 2},
                                        "max_tokens": 16}, group_size=2, gateway=client)
    try:
        gw.script.replies.extend(["The sum is 4", "I think it is 5"])
        out = await run_episode(workflow, None, item, episode_ctx())
    finally:
        await workflow.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    rows = out.rows.rows
    assert sorted(r.reward for r in rows) == [0.0, 1.0]  # the @vf.reward's verdicts
    # the gateway recorded the harness's call token by token, with the task's prompt
    prompt = gw.thread.deps.engine.tokenizer.decode(gw.script.requests[-1].prompt_ids)
    assert "What is 1 + 3?" in prompt
    assert all(r.loss_mask and any(r.loss_mask) for r in rows)
    assert workflow.counters() == {"episodes": 2, "failed_episodes": 0, "model_turns": 2}


async def test_a_failed_rollout_is_aborted_never_scored_zero(gw, client) -> None:
    item = vfenv.make_items("vf-addition", taskset={"num_tasks": 1})[0]
    agent = vfenv.VerifiersAgent("vf-addition", taskset={"num_tasks": 1}, max_tokens=16)
    # an endpoint that refuses the harness's call: the rollout fails inside verifiers
    workflow = resolve_workflow(agent, gateway=client)
    try:
        out = await run_episode(workflow, None, {**item, "verifiers": {"index": 5}}, episode_ctx())
        assert out.status == EpisodeStatus.ABORTED and "outside the taskset" in out.error
        ctx = agent.model_context(gw.url + "/no-such-route/v1", "wrong-key")
        env, tasks = await agent._serving()
        episode = await env.run_slot(env.slots(tasks[0], 1)[0], ctx)
        assert not episode.ok
    finally:
        await workflow.aclose()


async def test_a_tool_environment_runs_its_python_tools_in_one_token_exact_segment(
        gw, client) -> None:
    # task 0 is 12 * 34: the model calls verifiers' MCP tool, reads 408, answers
    out, workflow = await _one_episode(gw, client, "vf-calculator", [
        tool_call("multiply", {"a": 12, "b": 34}), "12 * 34 = 408"])
    assert out.status == EpisodeStatus.FINISHED, out.error
    (row,) = out.rows.rows  # one segment: the second call extends the first's tokens
    assert row.reward == 1.0  # the rubric's `correct`
    assert len(row.interaction_ids) == 2 and len(row.turn_spans) == 2
    first, second = gw.script.requests[-2:]
    assert "multiply" in _text(gw, first.prompt_ids)  # the toolset's schema reached the model
    # the tool result the real tool server computed is in the second prompt, right after the
    # first call's own tokens
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert "408" in _text(gw, second.prompt_ids[len(first.prompt_ids):])
    assert row.input_ids[:len(second.prompt_ids)] == second.prompt_ids
    assert workflow.counters()["model_turns"] == 2


async def test_a_multi_turn_environment_answers_each_turn_in_one_segment(gw, client) -> None:
    # task 0 is 3 + 5: a wrong first answer gets the env's feedback, the second is right
    out, workflow = await _one_episode(gw, client, "vf-retry", ["It is 7", "It is 8"])
    assert out.status == EpisodeStatus.FINISHED, out.error
    (row,) = out.rows.rows
    assert row.reward == 1.0  # `correct` (weight 1); `first_try` (weight 0.5) gave nothing
    assert len(row.interaction_ids) == 2
    first, second = gw.script.requests[-2:]
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    new_turn = _text(gw, second.prompt_ids[len(first.prompt_ids):])
    assert "It is 7" in new_turn and "That is not right" in new_turn
    assert workflow.counters()["model_turns"] == 2

    out, workflow = await _one_episode(gw, client, "vf-retry", ["8"])
    assert out.status == EpisodeStatus.FINISHED, out.error
    (row,) = out.rows.rows
    assert row.reward == 1.5 and len(row.interaction_ids) == 1  # right at once: no more turns


async def test_an_untrainable_seat_on_the_policys_session_fails_the_episode(gw, client) -> None:
    # verifiers' built-in user-sim: a modelled user (untrainable) talks to the assistant; both
    # seats would call the session, so the user's turns would be trained as the policy's
    out, _ = await _one_episode(gw, client, "vf-addition", ["What is 1 + 3?", "4", "###DONE###"],
                                env={"id": "user-sim"})
    assert out.status == EpisodeStatus.ABORTED
    assert "untrainable seat(s) user" in out.error and "client" in out.error


def test_verifiers_retries_are_refused() -> None:
    with pytest.raises(ConfigError, match="retries are set"):
        vfenv.env_config("vf-addition", env={"retries": {"max_retries": 2}})
    with pytest.raises(ConfigError, match=r"retries are set \(solver\)"):
        vfenv.env_config("vf-retry", env={"solver": {"retries": {"max_retries": 1}}})


def test_every_seat_gets_the_runs_harness_and_a_local_runtime() -> None:
    config = vfenv.env_config("vf-retry", env={"max_attempts": 2})
    assert type(config).__name__ == "RetryEnvConfig" and config.max_attempts == 2
    assert config.solver.harness.id == "null" and config.solver.runtime.type == "subprocess"
    with pytest.raises(ConfigError, match="verifiers environment 'vf-retry'"):
        vfenv.env_config("vf-retry", env={"max_attempts": "several"})


@pytest.mark.slow
def test_one_grpo_step_on_a_tool_and_a_multi_turn_environment_with_the_real_model(
        tmp_path: Path) -> None:
    """One group of 2 episodes of each environment (task 0 of vf-calculator, task 0 of
    vf-retry) in one GRPO step with the real default model, through `relayrl train`."""
    items = (vfenv.make_items("vf-calculator", taskset={"num_tasks": 1})
             + vfenv.make_items("vf-retry", taskset={"num_tasks": 1}))
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in items))
    kwargs = {"envs": [{"env_id": "vf-calculator", "taskset": {"num_tasks": 1}},
                       {"env_id": "vf-retry", "taskset": {"num_tasks": 1},
                        "env": {"max_attempts": 2}}],
              "max_tokens": 32}
    config = tmp_path / "config.yaml"
    config.write_text(f"""
experiment_name: vf
trial_name: smoke
fileroot: {tmp_path}
workflow: relayrl.envs.verifiers:VerifiersAgent
workflow_kwargs: {json.dumps(kwargs)}
data: {{train: {data}}}
rollout: {{group_size: 2, batch_size: 2, dynamic_sampling: false, progress: false,
          dump_to_file: true}}
train: {{total_steps: 1, drop_uniform_groups: false, checkpoint_every: 0}}
""")
    # CI runs this file at the lowest CPU priority beside the whole 3.11 suite, which on a CPU
    # without AMX holds both cores for half an hour: the bound leaves room for that wait
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", str(config)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "vf" / "smoke"
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in lines if "step_s" in m)
    assert step["workflow/episodes"] >= 4 and step["workflow/failed_episodes"] == 0
    assert step["workflow/model_turns"] >= step["workflow/episodes"]
    rows = [json.loads(x) for f in sorted((run / "rollout").rglob("*.jsonl"))
            for x in f.read_text().splitlines()]
    # one row per episode: each episode's calls (tool rounds, the env's turns) formed one
    # segment, extended token-exact
    episodes = [r["episode_id"] for r in rows]
    assert len(episodes) >= 4 and len(set(episodes)) == len(episodes)
    tool = [r for r in rows if "* 34" in r["prompt"]]
    multi = [r for r in rows if "3 + 5" in r["prompt"]]
    assert len(tool) >= 2 and len(multi) >= 2  # a group of each environment
    assert all("multiply" in r["prompt"] for r in tool)  # verifiers' tool schema was offered
    assert all(r["reward"] in (0.0, 1.0) for r in tool)  # the rubric's `correct`
    assert all(r["reward"] in (0.0, 1.0, 1.5) for r in multi)  # `correct` + 0.5 `first_try`
    # a retried answer: the env's feedback sits inside the row, between the model's answers
    assert all(r["reward"] <= 1.0 for r in multi if "That is not right" in r["completion"])


def test_several_environments_are_one_agent_and_bad_entries_are_config_errors() -> None:
    agent = vfenv.VerifiersAgent(envs=[{"env_id": "vf-addition"},
                                       {"env_id": "vf-retry", "env": {"max_attempts": 2}}])
    assert set(agent.configs) == {"vf-addition", "vf-retry"}
    assert agent.configs["vf-retry"].max_attempts == 2
    with pytest.raises(ConfigError, match="not both or neither"):
        vfenv.VerifiersAgent()
    with pytest.raises(ConfigError, match="got \\['env_id', 'tasks'\\]"):
        vfenv.VerifiersAgent(envs=[{"env_id": "vf-addition", "tasks": 3}])
    with pytest.raises(ConfigError, match="listed twice"):
        vfenv.VerifiersAgent(envs=[{"env_id": "vf-addition"}, {"env_id": "vf-addition"}])


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """uv offline, and every non-loopback request sent to a closed loopback port, so a download
    fails; verifiers and the adapter forget what this process already prepared."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    monkeypatch.setenv("UV_OFFLINE", "1")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setattr(SubprocessRuntime, "_interpreters", {})
    monkeypatch.setattr(vfenv, "_OFFLINE_READY", set())


async def test_tool_and_multi_turn_episodes_run_offline_once_installed(
        gw, client, offline) -> None:
    # verifiers prepares its chat program with `uv sync --script` (UV_OFFLINE forced off) before
    # the first rollout: after scripts/install_verifiers.sh that reads nothing from PyPI
    out, _ = await _one_episode(gw, client, "vf-calculator", [
        tool_call("multiply", {"a": 12, "b": 34}), "12 * 34 = 408"])
    assert out.status == EpisodeStatus.FINISHED, out.error
    assert out.rows.rows[0].reward == 1.0
    out, _ = await _one_episode(gw, client, "vf-retry", ["It is 7", "It is 8"])
    assert out.status == EpisodeStatus.FINISHED, out.error
    assert out.rows.rows[0].reward == 1.0


async def test_an_unprepared_chat_program_names_the_install_script_instead_of_downloading(
        offline, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "empty-uv-cache"))
    agent = vfenv.VerifiersAgent("vf-addition", taskset={"num_tasks": 1})
    with pytest.raises(ConfigError, match=r"(?s)not prepared to run offline.*install_verifiers\.sh"):
        await agent._serving()
    assert not any((tmp_path / "empty-uv-cache").rglob("*.whl"))  # nothing was fetched
    await agent.aclose()
