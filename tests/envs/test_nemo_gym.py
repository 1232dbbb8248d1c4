"""NeMo Gym: a real resources server and NeMo Gym's own agent server, the policy served by relayrl
over the Responses API, the reward from the resources server's `/verify`.

The servers are the ones `nemo-gym` ships (`resources_servers/equivalence_rule`, which needs no
download: its `verify` compares the reply with the item's `expected_answer`, and
`responses_api_agents/simple_agent`), run from `.venv-nemo-gym` (`bash
scripts/install_nemo_gym.sh`: NeMo Gym needs Python >= 3.12) on 127.0.0.1. The episodes run
against a real gateway whose engine is scripted (FakeEngine), so replies and rewards are known;
the last test trains the real default model with `relayrl train examples/nemo_gym/config.yaml`.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from relayrl.client.session_client import SessionClient
from relayrl.envs import nemo_gym as ngenv
from relayrl.errors import ConfigError, EpisodeFailed
from relayrl.workflow import EpisodeStatus, resolve_workflow, run_episode
from tests.episodes import episode_ctx
from tests.gateway.conftest import Gateway

ROOT = Path(__file__).resolve().parents[2]
AGENT = "relayrl.envs.nemo_gym:NeMoGymAgent"
EXAMPLE = ROOT / "examples" / "nemo_gym"
SERVER = "equivalence_rule"
HAS_VENV = (ngenv.default_venv() / "bin" / "python").exists()
needs_venv = pytest.mark.skipif(not HAS_VENV, reason="no NeMo Gym venv (.venv-nemo-gym): "
                                "bash scripts/install_nemo_gym.sh makes it")


def _item(question: str, answer: str) -> dict:
    """A /run body of equivalence_rule's shape (its shipped rows are long documents)."""
    return {"responses_create_params": {"input": [{"role": "user", "content": question}]},
            "expected_answer": answer}


# -- wire shapes (no NeMo Gym needed) --------------------------------------------------------

def test_the_run_body_is_the_item_with_its_episode_in_the_metadata() -> None:
    item = {"responses_create_params": {"input": "hi", "metadata": {"k": "v"}},
            "expected_answer": "x"}
    body = ngenv.run_body(item, "ep1", model="default", max_output_tokens=8, temperature=0.5)
    params = body["responses_create_params"]
    assert params == {"input": "hi", "metadata": {"k": "v", ngenv.EPISODE_KEY: "ep1"},
                      "model": "default", "max_output_tokens": 8, "temperature": 0.5}
    assert body["expected_answer"] == "x"  # what /verify needs rides along unchanged
    assert item["responses_create_params"]["metadata"] == {"k": "v"}  # the item is not edited
    kept = ngenv.run_body({"responses_create_params": {"input": "hi", "temperature": 0.0}},
                          "e", model="m", max_output_tokens=None, temperature=1.0)
    assert kept["responses_create_params"]["temperature"] == 0.0  # the item's own wins
    assert "max_output_tokens" not in kept["responses_create_params"]
    with pytest.raises(EpisodeFailed, match="responses_create_params"):
        ngenv.run_body({"question": "?"}, "e", model="m", max_output_tokens=8, temperature=None)


def test_the_global_config_is_ng_runs_shape_with_the_agent_pointing_at_both() -> None:
    cfg = ngenv.global_config(
        ("rs", "equivalence_rule", {"entrypoint": "app.py", "host": "127.0.0.1", "port": 1,
                                    "grading_rule": "exact"}),
        ("ag", "simple_agent", {"entrypoint": "app.py", "host": "127.0.0.1", "port": 2,
                                "datasets": [{"name": "example"}]}),
        ("policy_model", 3))
    assert cfg["rs"] == {"resources_servers": {"equivalence_rule": {
        "entrypoint": "app.py", "host": "127.0.0.1", "port": 1, "grading_rule": "exact"}}}
    agent = cfg["ag"]["responses_api_agents"]["simple_agent"]
    assert agent["resources_server"] == {"type": "resources_servers", "name": "rs"}
    assert agent["model_server"] == {"type": "responses_api_models", "name": "policy_model"}
    assert "datasets" not in agent
    model = cfg["policy_model"]["responses_api_models"]["relayrl"]
    assert (model["host"], model["port"]) == ("127.0.0.1", 3)
    assert cfg["dry_run"] is False and cfg["head_server"]["host"] == "127.0.0.1"


def test_verify_answers_without_a_numeric_reward_fail_the_episode() -> None:
    assert ngenv.verified_reward({"reward": 1}) == 1.0
    for bad in ({}, {"reward": "1"}, {"reward": True}, {"reward": float("nan")}, []):
        with pytest.raises(EpisodeFailed, match="reward"):
            ngenv.verified_reward(bad)


def test_a_missing_venv_says_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"bash scripts/install_nemo_gym\.sh"):
        ngenv.NeMoGymAgent(SERVER, venv=str(tmp_path / "nope"))
    (tmp_path / "empty" / "bin").mkdir(parents=True)
    (tmp_path / "empty" / "bin" / "python").write_text("")
    with pytest.raises(ConfigError, match="no nemo-gym installed"):
        ngenv.NeMoGymAgent(SERVER, venv=str(tmp_path / "empty"))


async def test_the_relay_passes_a_call_to_its_episodes_session_only(
        gw: Gateway, client: SessionClient) -> None:
    session = await client.start_session(task_id="relay")
    relay = ngenv.Relay().start(ngenv.free_port())
    url = f"http://127.0.0.1:{relay.server.servers[0].sockets[0].getsockname()[1]}"
    relay.sessions["ep"] = (session.base_url, session.api_key)
    gw.script.replies.append("Paris")
    body = {"model": "default", "input": [{"role": "user", "content": "Capital of France?"}],
            "max_output_tokens": 8, "metadata": {ngenv.EPISODE_KEY: "ep", "keep": "me"}}
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            ok = await c.post(f"{url}/v1/responses", json=body)
            unknown = await c.post(f"{url}/v1/responses",
                                   json={**body, "metadata": {ngenv.EPISODE_KEY: "other"}})
            bare = await c.post(f"{url}/v1/responses", json={"model": "m", "input": "x"})
            junk = await c.post(f"{url}/v1/responses", content=b"{not json")
    finally:
        relay.stop()
    assert ok.status_code == 200, ok.text
    answer = ok.json()
    assert answer["object"] == "response" and answer["output"][0]["content"][0]["text"] == "Paris"
    assert answer["metadata"] == {"keep": "me"}  # the relay's entry never reached the gateway
    assert len(gw.script.requests) == 1  # only the known episode's call was served
    for r in (unknown, bare):
        assert r.status_code == 404 and "no episode" in r.json()["error"]["message"]
    assert junk.status_code == 400 and junk.json()["error"]["type"] == "invalid_request_error"
    await client.abort_session(session.session_id)


# -- the real NeMo Gym servers ----------------------------------------------------------------

@needs_venv
def test_an_unknown_server_or_dataset_names_the_close_ones() -> None:
    with pytest.raises(ConfigError, match=r"no resources server 'equivalence_rul'.*"
                                          r"equivalence_rule"):
        ngenv.NeMoGymAgent("equivalence_rul")
    with pytest.raises(ConfigError, match=r"no responses api agent 'simple_agnt'.*simple_agent"):
        ngenv.NeMoGymAgent(SERVER, agent="simple_agnt")
    with pytest.raises(ConfigError, match=r"ships no dataset 'train' \(it has: example"):
        ngenv.make_items(SERVER, "train")
    rows = ngenv.make_items(SERVER, limit=2)
    assert len(rows) == 2 and all("expected_answer" in r for r in rows)


@needs_venv
def test_the_servers_settings_are_their_shipped_yaml_with_relayrls_over_it() -> None:
    cfg = ngenv.NeMoGymAgent(SERVER, server_config={"grading_rule": "seq_match"},
                             max_steps=3).config(1, 2, 3)
    res = cfg[SERVER]["resources_servers"][SERVER]
    assert res["grading_rule"] == "seq_match" and res["domain"] == "knowledge"  # shipped YAML
    assert (res["host"], res["port"]) == ("127.0.0.1", 1)
    agent = cfg["simple_agent_agent"]["responses_api_agents"]["simple_agent"]
    assert agent["max_steps"] == 3 and agent["port"] == 2
    assert agent["resources_server"]["name"] == SERVER
    own = ngenv.NeMoGymAgent(SERVER, agent_config={"max_steps": 5}).config(1, 2, 3)
    assert own["simple_agent_agent"]["responses_api_agents"]["simple_agent"]["max_steps"] == 5
    with pytest.raises(ConfigError, match="max_steps"):
        ngenv.NeMoGymAgent(SERVER, max_steps=0)


@needs_venv
async def test_episodes_run_through_nemo_gyms_agent_and_take_verifys_reward(
        gw: Gateway, client: SessionClient) -> None:
    wf = resolve_workflow(AGENT, {"server": SERVER, "max_output_tokens": 8}, gateway=client)
    agent = wf.agent  # type: ignore[attr-defined]
    item = _item("What is the capital of France? Answer with one word.", "Paris")
    gw.script.replies.extend(["Paris", "Lyon"])
    try:
        right = await run_episode(wf, None, item, episode_ctx(0))
        wrong = await run_episode(wf, None, item, episode_ctx(1))
        procs = list(agent._procs)
        assert len(procs) == 2 and all(p.proc.poll() is None for p in procs)
    finally:
        await wf.aclose()
    assert right.status == EpisodeStatus.FINISHED, right.error
    assert wrong.status == EpisodeStatus.FINISHED, wrong.error
    # equivalence_rule's default rule, `exact`: 1.0 for the answer, 0.0 otherwise
    assert [r.reward for r in right.rows.rows] == [1.0]
    assert [r.reward for r in wrong.rows.rows] == [0.0]
    # the policy saw the item's input, sent by simple_agent over the Responses API
    prompt = gw.thread.deps.engine.tokenizer.decode(list(gw.script.requests[0].prompt_ids))
    assert "What is the capital of France?" in prompt
    assert gw.script.requests[0].params.max_new_tokens == 8
    assert all(p.proc.poll() is not None for p in procs)  # aclose stopped both servers


@needs_venv
async def test_a_tool_call_runs_on_the_resources_server_between_two_model_calls(
        gw: Gateway, client: SessionClient) -> None:
    item = ngenv.make_items("example_single_tool_call", limit=1)[0]  # "what's it like in sf?"
    call = json.dumps({"name": "get_weather", "arguments": {"city": "San Francisco"}})
    gw.script.replies.extend([f"<tool_call>\n{call}\n</tool_call>", "It is cold there."])
    wf = resolve_workflow(AGENT, {"server": "example_single_tool_call"}, gateway=client)
    try:
        out = await run_episode(wf, None, item, episode_ctx(0, "tool"))
    finally:
        await wf.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    assert len(gw.script.requests) == 2  # the tool call, then the answer: simple_agent's loop
    tok = gw.thread.deps.engine.tokenizer
    first = tok.decode(list(gw.script.requests[0].prompt_ids))
    second = tok.decode(list(gw.script.requests[1].prompt_ids))
    assert "get_weather" in first and "what's it like in sf?" in first  # the item's tools, input
    # the resources server's /get_weather answered, and simple_agent gave it back to the policy
    assert "The weather in San Francisco is cold." in second
    rows = out.rows.rows
    assert rows[-1].reward == 1.0  # this server's /verify: 1.0 for every rollout


@needs_venv
async def test_a_server_setting_reaches_the_resources_server(
        gw: Gateway, client: SessionClient) -> None:
    wf = resolve_workflow(AGENT, {"server": SERVER, "server_config": {"grading_rule":
                                                                      "seq_match"}},
                          gateway=client)
    gw.script.replies.append("Pariss")
    try:
        out = await run_episode(wf, None, _item("Capital of France?", "Paris"),
                                episode_ctx(0, "sq"))
    finally:
        await wf.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    expected = difflib.SequenceMatcher(None, "pariss", "paris").ratio()
    assert [r.reward for r in out.rows.rows] == [pytest.approx(expected)]


@needs_venv
async def test_a_server_that_cannot_start_fails_every_episode_at_once_with_its_output(
        gw: Gateway, client: SessionClient) -> None:
    wf = resolve_workflow(AGENT, {"server": SERVER, "server_config": {"grading_rule": "nope"}},
                          gateway=client)
    try:
        first = await run_episode(wf, None, _item("?", "x"), episode_ctx(0, "bad"))
        t0 = time.monotonic()
        second = await run_episode(wf, None, _item("?", "x"), episode_ctx(1, "bad"))
        again_s = time.monotonic() - t0
    finally:
        await wf.aclose()
    for out in (first, second):
        assert out.status == EpisodeStatus.ABORTED
        # the server's own complaint (its config validation), from its output
        assert "did not start" in out.error and "grading_rule" in out.error, out.error
    assert again_s < 2.0  # no second start: the first failure is the answer
    assert gw.script.requests == []  # no episode reached the policy


@needs_venv
async def test_a_broken_item_fails_its_episode_with_the_servers_answer(
        gw: Gateway, client: SessionClient) -> None:
    wf = resolve_workflow(AGENT, {"server": SERVER}, gateway=client)
    try:
        out = await run_episode(wf, None, {"responses_create_params": {"input": "hi"}},
                                episode_ctx(0))
    finally:
        await wf.aclose()
    # equivalence_rule's /run body needs expected_answer: NeMo Gym answers 422, relayrl says so
    assert out.status == EpisodeStatus.ABORTED and "422" in out.error


@needs_venv
@pytest.mark.slow
def test_relayrl_train_runs_grpo_on_a_nemo_gym_resources_server(tmp_path: Path) -> None:
    """The real default model and `relayrl train examples/nemo_gym/config.yaml`: one GRPO step,
    one group of four episodes of equivalence_rule (`seq_match`), each scored by its /verify."""
    dumps = tmp_path / "dumps"
    overrides = [f"fileroot={tmp_path / 'runs'}", "trial_name=ci", "train.total_steps=1",
                 "rollout.group_size=4", "rollout.batch_size=1", f"rollout.dump_root={dumps}",
                 "train.drop_uniform_groups=false"]  # the one batch takes its step
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train",
                           str(EXAMPLE / "config.yaml"), *overrides],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "nemo_gym" / "ci"
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "step_s" in m] == [1]
    answers = {i["responses_create_params"]["input"][0]["content"]: i["expected_answer"]
               for i in map(json.loads, (EXAMPLE / "train.jsonl").read_text().splitlines())}
    rows = [json.loads(x) for f in sorted(dumps.rglob("*.jsonl"))
            for x in f.read_text().splitlines()]
    assert len({r["episode_id"] for r in rows}) == 4
    for row in rows:
        (answer,) = [a for q, a in answers.items() if q in row["prompt"]]
        # /verify's seq_match of the reply the model wrote against the answer, nothing else
        reply = row["completion"].replace("<|im_end|>", "").replace("<|endoftext|>", "")
        reply = re.sub(r"\s+", " ", reply.strip().lower())
        assert row["reward"] == pytest.approx(
            difflib.SequenceMatcher(None, reply, answer.lower()).ratio(), abs=1e-6), reply
