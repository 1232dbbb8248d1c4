"""Harbor task directories: the loader, the local runtime and the verifier, without any CLI.

Every example task is checked both ways: its solution/solve.sh (the oracle) earns reward 1, and
the untouched workspace earns 0, so each verifier tells a solved task from an unsolved one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from relayrl.errors import EpisodeFailed
from relayrl.harness import CLIAgent, LocalRuntime, TaskError, find_tasks, load_task, read_reward
from relayrl.harness.clis import ADAPTERS, LaunchSpec, get_adapter
from relayrl.harness.docker import DockerRuntime, docker_available

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "cli_agents" / "tasks"
EXAMPLES = find_tasks(TASKS)


def _task(tmp_path: Path, toml: str = "", test_sh: str = "echo 1 > /logs/verifier/reward.txt\n",
          files: dict[str, str] | None = None) -> Path:
    d = tmp_path / "t"
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text("Do the thing.\n")
    (d / "task.toml").write_text(toml)
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    for name, body in (files or {}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(body)
    return d


def test_there_are_at_least_eight_example_tasks_and_all_load() -> None:
    assert len(EXAMPLES) >= 8
    for path in EXAMPLES:
        task = load_task(path)
        assert task.instruction.strip() and task.workdir == "/app" and task.has_solution
        assert task.agent_timeout_s == 300.0 and task.verifier_timeout_s == 60.0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
async def test_each_example_verifier_gives_1_to_the_oracle_and_0_to_no_work(path: Path) -> None:
    task = load_task(path)
    rt = LocalRuntime()
    untouched = await rt.start(task)
    solved = await rt.start(task)
    try:
        assert await rt.verify(untouched) == 0.0
        r = await rt.solve(solved, timeout_s=30)
        assert r.returncode == 0, r.output_tail
        assert await rt.verify(solved) == 1.0
    finally:
        await rt.stop(untouched)
        await rt.stop(solved)
    assert not untouched.root.exists() and not solved.root.exists()


async def test_workspace_files_come_from_the_dockerfile_copy_steps() -> None:
    task = load_task(TASKS / "fix-off-by-one")
    assert [c.dest for c in task.copies] == ["/app/mathx.py"]
    rt = LocalRuntime()
    sb = await rt.start(task)
    try:
        assert (sb.workdir / "mathx.py").read_text().startswith("def total(n):")
        # the container paths of the verifier now point into the sandbox, nowhere else
        assert sb.rewrite("cat /app/x > /logs/verifier/reward.txt") == \
            f"cat {sb.workdir}/x > {sb.verifier_logs}/reward.txt"
        assert sb.rewrite("/application /apps x/app") == "/application /apps x/app"
    finally:
        await rt.stop(sb)


def test_dockerfile_workdir_is_the_default_and_relative_copies_land_in_it(tmp_path: Path) -> None:
    d = _task(tmp_path, files={"environment/Dockerfile": "FROM debian\nWORKDIR /srv\nWORKDIR code\n"
                               "COPY --chown=1:1 a.py b.py ./\nCOPY --from=build /x /y\n"})
    task = load_task(d)
    assert task.workdir == "/srv/code"
    assert [(c.sources, c.dest) for c in task.copies] == [(("a.py", "b.py"), "/srv/code/")]


@pytest.mark.parametrize(("toml", "files", "message"), [
    ("[agent\n", {}, "not valid TOML"),
    ("[agent]\ntimeout_sec = -1\n", {}, "agent.timeout_sec must be a positive number"),
    ("[[steps]]\nname = 'a'\n", {}, "multi-step"),
    ("[environment]\nos = 'windows'\n", {}, "only linux"),
    ("[environment]\nworkdir = 'app'\n", {}, "absolute path"),
    ("verifier = 3\n", {}, "[verifier] in task.toml must be a table"),
])
def test_a_malformed_task_is_refused_with_a_clear_error(tmp_path: Path, toml: str, files: dict,
                                                         message: str) -> None:
    with pytest.raises(TaskError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_task(_task(tmp_path, toml, files=files))


def test_a_task_without_its_verifier_or_instruction_is_refused(tmp_path: Path) -> None:
    d = _task(tmp_path)
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"missing tests/test.sh"):
        load_task(d)
    with pytest.raises(TaskError, match="does not exist"):
        load_task(tmp_path / "nowhere")
    (d / "tests" / "test.sh").write_text("true\n")
    (d / "instruction.md").write_text("  \n")
    with pytest.raises(TaskError, match=r"instruction\.md is empty"):
        load_task(d)


def test_reward_files_are_read_as_harbor_reads_them(tmp_path: Path) -> None:
    (tmp_path / "reward.txt").write_text("0.5\n")
    assert read_reward(tmp_path) == 0.5
    (tmp_path / "reward.json").write_text('{"reward": 1, "style": 0.2}')
    assert read_reward(tmp_path) == 1.0  # reward.json wins, as in Harbor
    assert read_reward(tmp_path, "style") == 0.2
    (tmp_path / "reward.json").write_text('{"passed": 0.75}')
    assert read_reward(tmp_path) == 0.75  # the only value
    (tmp_path / "reward.json").write_text('{"a": 1, "b": 2}')
    with pytest.raises(EpisodeFailed, match="no 'reward'"):
        read_reward(tmp_path)
    (tmp_path / "reward.json").unlink()
    (tmp_path / "reward.txt").write_text("nan")
    with pytest.raises(EpisodeFailed, match="not a finite number"):
        read_reward(tmp_path)
    (tmp_path / "reward.txt").unlink()
    with pytest.raises(EpisodeFailed, match="wrote no reward"):
        read_reward(tmp_path)


async def test_a_verifier_that_writes_no_reward_or_hangs_is_a_failure_not_0(tmp_path: Path) -> None:
    rt = LocalRuntime()
    for test_sh, toml, match in [("exit 3\n", "", "wrote no reward.*exited 3"),
                                 ("sleep 30\n", "[verifier]\ntimeout_sec = 1\n", "ran past")]:
        shutil.rmtree(tmp_path / "t", ignore_errors=True)
        task = load_task(_task(tmp_path, toml, test_sh))
        sb = await rt.start(task)
        t0 = time.monotonic()
        try:
            with pytest.raises(EpisodeFailed, match=match):
                await rt.verify(sb)
        finally:
            await rt.stop(sb)
        assert time.monotonic() - t0 < 15


def test_every_adapter_writes_its_config_under_the_episode_home(tmp_path: Path) -> None:
    seen = set()
    for name in ADAPTERS:
        adapter = get_adapter(name)
        if adapter.name in seen:
            continue
        seen.add(adapter.name)
        home = tmp_path / adapter.name
        home.mkdir()
        spec = LaunchSpec("Say hi.", "http://127.0.0.1:9/s/sk-sess/v1", "sk-sess", "m", home,
                          tmp_path, "/bin/" + adapter.bin, 32768, 512)
        launch = adapter.launch(spec)
        assert launch.env["HOME"] == str(home) and "Say hi." in launch.argv
        # the key reaches the CLI through the environment, never through a config file or argv
        assert not any("sk-sess" in a and a != spec.base_url for a in launch.argv)
        for f in home.rglob("*"):
            if f.is_file():
                assert "sk-sess\"" not in f.read_text() or spec.base_url in f.read_text()
    codex = (tmp_path / "codex" / ".codex" / "config.toml").read_text()
    assert 'wire_api = "responses"' in codex and 'web_search = "disabled"' in codex
    import tomllib
    assert tomllib.loads(codex)["model_providers"]["relayrl"]["base_url"].endswith("/v1")
    claude = get_adapter("claude").launch(LaunchSpec("x", "http://h/s/k/v1", "k", "m",
                                                     tmp_path / "claude", tmp_path, "c", 1, 1))
    assert claude.env["ANTHROPIC_BASE_URL"] == "http://h/s/k"  # the SDK appends /v1 itself


def test_the_agent_refuses_bad_settings_and_data(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.errors import ConfigError, InvalidRequest
    with pytest.raises(ConfigError, match="unknown CLI"):
        CLIAgent(cli="vim")
    with pytest.raises(ConfigError, match="runtime"):
        CLIAgent(runtime="k8s")
    with pytest.raises(InvalidRequest, match="needs 'task'"):
        CLIAgent().task_for({"prompt": "x"})
    agent = CLIAgent(tasks_root=str(TASKS))
    assert agent.task_for({"task": "hello-file"}).name == "hello-file"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("RELAYRL_CLIS_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"not installed: run scripts/install_clis\.sh"):
        get_adapter("qwen").locate(str(tmp_path))


def test_the_docker_container_gets_the_episode_mounts_and_no_secret_on_its_command_line(
        tmp_path: Path) -> None:
    task = load_task(TASKS / "hello-file")
    rt = DockerRuntime()
    from relayrl.harness.runtime import Sandbox
    sb = Sandbox(task, tmp_path, tmp_path / "home", {}, container="relayrl-x")
    args = rt.run_args(sb, "img:1", tmp_path / ".clis", "/usr/bin/node")
    assert args[:4] == ["run", "-d", "--name", "relayrl-x"]
    assert f"{tmp_path / 'fs' / 'logs'}:/logs" in args and "-w" in args
    assert args[-3:] == ["sleep", "img:1", "infinity"] or args[-2:] == ["img:1", "infinity"]


@pytest.mark.skipif(not docker_available(), reason="no docker daemon")
async def test_the_oracle_solves_a_task_in_docker() -> None:
    task = load_task(TASKS / "hello-file")
    rt = DockerRuntime()
    sb = await rt.start(task)
    try:
        r = await rt.exec(sb, ["bash", "-c", "echo 'hello relayrl' > /app/hello.txt"], {}, 60,
                          sb.root / "oracle.log")
        assert r.returncode == 0
        assert await rt.verify(sb) == 1.0
    finally:
        await rt.stop(sb)


def test_the_example_config_trains_a_cli_agent_in_groups_on_every_task() -> None:
    pytest.importorskip("torch", reason="relayrl.config imports relayrl.train, which needs torch "
                        "(`pip install 'relayrl[train]'`)")
    from relayrl.client.session_client import SessionClient
    from relayrl.config import RelayConfig, load_config
    from relayrl.workflow import AgentWorkflow, GroupedWorkflow, resolve_workflow

    cfg = load_config(RelayConfig, str(ROOT / "examples" / "cli_agents" / "config.yaml"), [])
    wf = resolve_workflow(cfg.workflow, cfg.workflow_kwargs, cfg.rollout.group_size,
                          gateway=SessionClient("http://127.0.0.1:9"),
                          agent_config=cfg.rollout.agent)
    assert isinstance(wf, GroupedWorkflow) and wf.group_size == 4
    assert isinstance(wf.workflow, AgentWorkflow) and isinstance(wf.workflow.agent, CLIAgent)
    agent = wf.workflow.agent
    assert cfg.rollout.episode_timeout_s > agent.timeout_s + 60  # the CLI's limit, then test.sh
    items = (ROOT / cfg.data.train).read_text().splitlines()
    names = {agent.task_for(json.loads(x)).path for x in items}
    assert names == set(EXAMPLES)


async def test_the_cli_inherits_tools_and_locale_but_no_keys_or_proxies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-users-own")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    task = load_task(TASKS / "hello-file")
    rt = LocalRuntime()
    sb = await rt.start(task)
    try:
        r = await rt.run_agent(sb, ["bash", "-c", "env; pwd"], {"EXTRA": "1"}, 30)
        assert r.returncode == 0
        seen = r.output_tail
    finally:
        await rt.stop(sb)
    assert "sk-users-own" not in seen and "proxy.invalid" not in seen
    assert "EXTRA=1" in seen and f"PATH={os.environ['PATH']}" in seen
    assert str(sb.workdir) in seen
