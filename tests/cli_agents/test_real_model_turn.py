"""Each real CLI (opencode, Codex CLI, Claude Code, Qwen Code) for one turn against the gateway
serving the long-context packaged model `qwen2.5-coder-0.5b-instruct` (LocalEngine, real
sampling): every call it makes is recorded token-exact — the recorded output ids decode to the
text the CLI received (the CLI prints it), one logprob per sampled token, and the exported row
is the call's prompt ids followed by its output ids.

The CLIs' own first prompts are 5k (opencode) to 18k (Claude Code) tokens of system prompt and
tool schemas: prefilling them on a CI runner's CPU would take minutes. Each CLI is shrunk here
with its OWN options, through `CLIAgent(system_prompt=..., tools=[...])`: a one-line system prompt
(opencode's build-agent `prompt`, Codex's `model_instructions_file`, Claude Code's and Qwen Code's
`--system-prompt`) and a single read tool (opencode's `tools` map, Codex's feature flags, Claude
Code's `--tools`, Qwen Code's `tools.core`/`tools.exclude`). What remains is each CLI's own: its
environment context, its tool schema, its wire format and request fields. docs/cli-agents/ says
the same per CLI.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.harness import CLIAgent, get_adapter
from relayrl.models import model_path
from tests.gateway.conftest import ADMIN, Gateway

ROOT = Path(__file__).resolve().parents[2]
CLIS = ROOT / ".clis"
MODEL = "qwen2.5-coder-0.5b-instruct"
SYSTEM = "You are a coding agent. Answer in one short sentence."
KEEP = {"opencode": ["read"], "codex": ["exec_command"], "claude": ["Read"],
        "qwen": ["read_file"]}
"""The one tool each CLI keeps (Codex's shell tools have no switch: `exec_command` stays)."""
INSTRUCTION = "What is the capital of France? Answer with one word, without using any tool."

pytestmark = pytest.mark.slow


def _installed(cli: str) -> bool:
    try:
        get_adapter(cli).locate(str(CLIS))
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def qwen_gw() -> Iterator[Gateway]:
    cfg = GatewayConfig(model=model_path(MODEL), engine="local", admin_key=ADMIN,
                        model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg)).start()
    yield Gateway(thread.url, thread)
    thread.stop()


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Harbor task whose verifier always runs and scores 1: the turn, not the answer, is tested."""
    root = tmp_path_factory.mktemp("task") / "capital"
    (root / "tests").mkdir(parents=True)
    (root / "environment").mkdir()
    (root / "instruction.md").write_text(INSTRUCTION + "\n")
    (root / "task.toml").write_text('schema_version = "1.4"\n[agent]\ntimeout_sec = 240.0\n'
                                    '[verifier]\ntimeout_sec = 30.0\n'
                                    '[environment]\nworkdir = "/app"\n')
    (root / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (root / "tests" / "test.sh").write_text("#!/bin/bash\nmkdir -p /logs/verifier\n"
                                            "echo 1 > /logs/verifier/reward.txt\n")
    return root


@pytest.mark.parametrize("cli", ["opencode", "codex", "claude", "qwen"])
async def test_one_real_model_turn_is_recorded_token_exact(
        qwen_gw: Gateway, task: Path, cli: str, tmp_path: Path) -> None:
    if not _installed(cli):
        pytest.skip(f"{cli} is not installed (scripts/install_clis.sh)")
    tokenizer = Tokenizer.from_file(str(Path(model_path(MODEL)) / "tokenizer.json"))
    agent = CLIAgent(cli=cli, clis_dir=str(CLIS), timeout_s=240, context_window=32768,
                     max_output_tokens=24, system_prompt=SYSTEM, tools=KEEP[cli],
                     keep_sandboxes=True, tmp_root=str(tmp_path))
    session = qwen_gw.start_session(task_id="capital")
    started = time.monotonic()
    reward = await agent.run({"task": str(task)}, session["base_url"], session["api_key"])
    wall = time.monotonic() - started
    assert reward == 1.0  # the CLI exited 0 and the verifier ran
    (sandbox,) = list(tmp_path.iterdir())
    cli_output = (sandbox / "fs" / "logs" / "agent" / "cli.log").read_text(errors="replace")
    calls = qwen_gw.deps.store.get(session["session_id"]).interactions
    assert calls, "the CLI made no call"
    for c in calls:
        text = tokenizer.decode(list(c.output_ids), skip_special_tokens=True)
        assert len(c.logprobs) == len(c.output_ids) > 0
        assert all(lp <= 0.0 for lp in c.logprobs)
        if not c.reply.tool_calls:  # the text the CLI was sent is the sampled tokens' text
            assert text.strip() == c.reply.content.strip()
        prompt = tokenizer.decode(list(c.prompt_ids))
        assert SYSTEM in prompt and INSTRUCTION in prompt  # the CLI's own request, shrunk
        names = [t.name for t in c.conversation.tools]
        if cli == "codex":  # its multi-agent and goal tools are off, its shell tools stay
            assert "exec_command" in names
            assert not [n for n in names if "agent" in n or "goal" in n], names
        else:
            assert names == KEEP[cli]
    last = calls[-1]
    if not last.reply.tool_calls:  # the CLI printed what it received, token for token
        assert last.reply.content.strip() in cli_output, cli_output[-2000:]
    with qwen_gw.admin() as admin:
        admin.post("/rl/v1/finalize", json={"final_reward": reward},
                   headers={"authorization": f"Bearer {session['api_key']}"}).raise_for_status()
    for row in qwen_gw.export(session["session_id"]):  # each call's prompt, then its sample
        first = next(c for c in calls if c.id == row["interaction_ids"][0])
        start, end = row["turn_spans"][0]
        assert row["input_ids"][:start] == list(first.prompt_ids)
        assert row["input_ids"][start:end] == list(first.output_ids)
        assert row["logprobs"][start:end] == pytest.approx(list(first.logprobs))
    print(f"{cli}: {len(calls)} call(s), prompts {[len(c.prompt_ids) for c in calls]} tokens, "
          f"outputs {[len(c.output_ids) for c in calls]} tokens, {wall:.1f} s")
