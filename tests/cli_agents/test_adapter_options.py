"""`system_prompt`, `tools` and `subagents` become each CLI's own options (no CLI is run here:
the real-model turn in test_real_model_turn.py shows the CLIs obey them)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from relayrl.harness.clis import LaunchSpec, get_adapter


def _spec(tmp_path: Path, **kw) -> LaunchSpec:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return LaunchSpec(instruction="Do it.", base_url="http://127.0.0.1:1/s/k/v1", api_key="k",
                      model="policy", home=home, workdir=tmp_path, executable="/bin/true",
                      context_window=32768, max_output_tokens=64, **kw)


def test_without_options_each_cli_keeps_its_own_prompt_and_tools(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    oc = get_adapter("opencode").launch(spec)
    config = json.loads(Path(oc.env["OPENCODE_CONFIG"]).read_text())
    assert "agent" not in config and config["tools"]["task"] is False
    get_adapter("codex").launch(spec)
    codex = tomllib.loads((spec.home / ".codex" / "config.toml").read_text())
    assert "model_instructions_file" not in codex and "features" not in codex
    claude = get_adapter("claude").launch(spec).argv
    assert "--system-prompt" not in claude and "--tools" not in claude
    qwen = get_adapter("qwen").launch(spec)
    settings = json.loads((spec.home / ".qwen" / "settings.json").read_text())
    assert "--system-prompt" not in qwen.argv and "core" not in settings["tools"]
    assert settings["memory"] == {"enableManagedAutoMemory": False}


def test_system_prompt_and_tools_become_each_clis_own_options(tmp_path: Path) -> None:
    spec = _spec(tmp_path, system_prompt="Be brief.", tools=("read", "Read", "read_file"))
    oc = get_adapter("opencode").launch(spec)
    config = json.loads(Path(oc.env["OPENCODE_CONFIG"]).read_text())
    assert config["agent"] == {"build": {"prompt": "Be brief."}}
    assert [t for t, on in config["tools"].items() if on] == ["read"]
    assert config["permission"]["edit"] == config["permission"]["bash"] == "deny"

    get_adapter("codex").launch(spec)
    codex = tomllib.loads((spec.home / ".codex" / "config.toml").read_text())
    assert Path(codex["model_instructions_file"]).read_text() == "Be brief."
    assert codex["include_permissions_instructions"] is False
    assert codex["features"] == {"multi_agent": False, "goals": False}
    assert codex["model_providers"]["relayrl"]["wire_api"] == "responses"  # tables intact

    claude = get_adapter("claude").launch(spec).argv
    assert claude[claude.index("--system-prompt") + 1] == "Be brief."
    assert claude[claude.index("--tools") + 1] == "read,Read,read_file"

    qwen = get_adapter("qwen").launch(spec)
    settings = json.loads((spec.home / ".qwen" / "settings.json").read_text())
    assert qwen.argv[qwen.argv.index("--system-prompt") + 1] == "Be brief."
    assert settings["tools"]["core"] == ["read", "Read", "read_file"]
    assert "agent" in settings["tools"]["exclude"] and "read_file" not in settings["tools"]["exclude"]


def test_opencode_subagents_switch_its_task_tool_on(tmp_path: Path) -> None:
    for tools in (None, ("read",)):
        oc = get_adapter("opencode").launch(_spec(tmp_path, subagents=True, tools=tools))
        assert json.loads(Path(oc.env["OPENCODE_CONFIG"]).read_text())["tools"]["task"] is True
