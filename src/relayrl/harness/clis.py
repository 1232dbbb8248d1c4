"""Per-CLI adapters: the config files, environment and command line that make a coding CLI run
one non-interactive prompt against an episode's session URL, and nothing else.

Each adapter writes its CLI's config into the episode's own HOME (and the CLI's config dir
variable), so nothing of the user's config is read and nothing is written outside the sandbox.
What each keeps and switches off, and why, is in docs/cli-agents/.
"""

from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from relayrl.errors import ConfigError

KEY_VAR = "RELAYRL_SESSION_KEY"
"""The environment variable holding the session's API key (config files name it, never hold it)."""


@dataclass(frozen=True)
class LaunchSpec:
    """What an adapter needs to launch its CLI for one episode."""

    instruction: str
    base_url: str
    """The session's OpenAI-style base URL (`.../s/{session_key}/v1`)."""
    api_key: str
    model: str
    home: Path
    workdir: Path
    executable: str
    context_window: int
    max_output_tokens: int
    subagents: bool = False
    """opencode: switch its `task` tool (sub-agents) on; the other CLIs keep their own default."""
    system_prompt: str | None = None
    """Replaces the CLI's own system prompt (through the CLI's own option), when set."""
    tools: tuple[str, ...] | None = None
    """The CLI's tools to keep (its own names), when set; every other tool it can drop is off."""


@dataclass(frozen=True)
class Launch:
    """The command and environment that run the CLI."""

    argv: list[str]
    env: dict[str, str]


def _base_env(spec: LaunchSpec) -> dict[str, str]:
    home = spec.home
    for sub in (".config", ".local/share", ".local/state", ".cache"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_STATE_HOME": str(home / ".local/state"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "NO_UPDATE_NOTIFIER": "1", "CI": "1", "TERM": "dumb", "NO_COLOR": "1",
            KEY_VAR: spec.api_key}


class CLIAdapter(ABC):
    """How one coding CLI is configured and launched."""

    name: str
    package: str
    """Its npm package."""
    version: str
    """The version scripts/install_clis.sh pins (and the tests use)."""
    bin: str
    """Its executable's name under node_modules/.bin."""

    @abstractmethod
    def launch(self, spec: LaunchSpec) -> Launch:
        """Write the CLI's config under `spec.home`; return its command line and environment."""

    def locate(self, clis_dir: str | None = None) -> str:
        """The executable: `<clis_dir>/node_modules/.bin/<bin>`, then PATH; ConfigError if none."""
        for base in filter(None, [clis_dir, os.environ.get("RELAYRL_CLIS_DIR"),
                                  str(Path.cwd() / ".clis")]):
            candidate = Path(base) / "node_modules" / ".bin" / self.bin
            if candidate.exists():
                return str(candidate.resolve())
        found = shutil.which(self.bin)
        if found:
            return found
        raise ConfigError(f"{self.name} ({self.package}@{self.version}) is not installed: run "
                          "scripts/install_clis.sh, or pass clis_dir / put it on PATH")


OPENCODE_TOOLS = ("bash", "edit", "write", "patch", "multiedit", "apply_patch", "read", "glob",
                  "grep", "list", "lsp", "skill", "question", "codesearch", "webfetch",
                  "websearch", "todowrite", "todoread", "task")
"""opencode's built-in tools (1.18): with `tools` set, each is switched on or off by name."""


class OpenCode(CLIAdapter):
    """opencode: Chat Completions through its openai-compatible provider."""

    name = "opencode"
    package = "opencode-ai"
    version = "1.18.33"
    bin = "opencode"

    def launch(self, spec: LaunchSpec) -> Launch:
        """opencode.json in XDG_CONFIG_HOME/opencode; `opencode run --auto -m relayrl/<model>`."""
        env = _base_env(spec)
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"relayrl": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "relayrl",
                "options": {"baseURL": spec.base_url, "apiKey": f"{{env:{KEY_VAR}}}"},
                "models": {spec.model: {"name": spec.model, "tool_call": True,
                                        "limit": {"context": spec.context_window,
                                                  "output": spec.max_output_tokens}}},
            }},
            "model": f"relayrl/{spec.model}",
            "small_model": f"relayrl/{spec.model}",
            "enabled_providers": ["relayrl"],
            "autoupdate": False,
            "share": "disabled",
            "snapshot": False,
            "lsp": False,
            "formatter": False,
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
            "tools": {"webfetch": False, "websearch": False, "todowrite": False,
                      "todoread": False, "task": spec.subagents},
        }
        if spec.system_prompt is not None:  # the build agent's prompt replaces opencode's own
            config["agent"] = {"build": {"prompt": spec.system_prompt}}
        if spec.tools is not None:
            config["tools"] = {t: t in spec.tools or (t == "task" and spec.subagents)
                               for t in OPENCODE_TOOLS}
            # a tool is off only when the last permission rule naming it denies it
            edits = ("edit", "write", "patch", "multiedit", "apply_patch")
            config["permission"] = {
                "edit": "allow" if any(t in spec.tools for t in edits) else "deny",
                "bash": "allow" if "bash" in spec.tools else "deny", "webfetch": "deny"}
        cfg_dir = spec.home / ".config" / "opencode"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        (cfg_dir / "opencode.json").write_text(json.dumps(config, indent=2))
        env.update({
            "OPENCODE_CONFIG": str(cfg_dir / "opencode.json"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
            "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
            "OPENCODE_FAKE_VCS": "git",
        })
        argv = [spec.executable, "run", "--auto", "--pure", "--model", f"relayrl/{spec.model}",
                "--dir", str(spec.workdir), "--title", "relayrl episode", "--", spec.instruction]
        return Launch(argv, env)


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


CODEX_FEATURE_TOOLS: dict[str, tuple[str, ...]] = {
    "multi_agent": ("spawn_agent", "send_input", "resume_agent", "wait_agent", "close_agent"),
    "goals": ("get_goal", "create_goal", "update_goal"),
}
"""Codex's feature flags (`[features]`) and the tools each adds: a flag is turned off when
`tools` keeps none of them. Codex's shell tools and `request_user_input` have no switch."""


class Codex(CLIAdapter):
    """Codex CLI: the Responses API through a custom model provider."""

    name = "codex"
    package = "@openai/codex"
    version = "0.171.0"
    bin = "codex"

    def launch(self, spec: LaunchSpec) -> Launch:
        """config.toml in CODEX_HOME; `codex exec --skip-git-repo-check --dangerously-bypass-...`."""
        env = _base_env(spec)
        codex_home = spec.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        lines = [
            f"model = {_toml_str(spec.model)}",
            'model_provider = "relayrl"',
            'approval_policy = "never"',
            'sandbox_mode = "danger-full-access"',
            'web_search = "disabled"',
            "check_for_update_on_startup = false",
            f"model_context_window = {spec.context_window}",
            'model_reasoning_summary = "none"',
            "",
            "[analytics]",
            "enabled = false",
            "",
            "[feedback]",
            "enabled = false",
            "",
            "[history]",
            'persistence = "none"',
            "",
            "[model_providers.relayrl]",
            'name = "relayrl"',
            f"base_url = {_toml_str(spec.base_url)}",
            'wire_api = "responses"',
            f'env_key = "{KEY_VAR}"',
            "request_max_retries = 0",
            "stream_max_retries = 0",
            "",
        ]
        if spec.system_prompt is not None:
            instructions = codex_home / "instructions.md"
            instructions.write_text(spec.system_prompt)
            # before the first table: the base instructions, and no permissions message either
            lines[1:1] = [f"model_instructions_file = {_toml_str(str(instructions))}",
                          "include_permissions_instructions = false"]
        if spec.tools is not None:
            lines += ["[features]", *(f"{feature} = false" for feature, tools
                                      in CODEX_FEATURE_TOOLS.items()
                                      if not any(t in spec.tools for t in tools)), ""]
            if "view_image" not in spec.tools:
                lines += ["[tools]", "view_image = false", ""]
        (codex_home / "config.toml").write_text("\n".join(lines))
        env.update({"CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "", "CODEX_API_KEY": ""})
        argv = [spec.executable, "exec", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "--color", "never",
                "--cd", str(spec.workdir), spec.instruction]
        return Launch(argv, env)


class ClaudeCode(CLIAdapter):
    """Claude Code: the Anthropic Messages API at the session's base URL (without /v1)."""

    name = "claude"
    package = "@anthropic-ai/claude-code"
    version = "2.1.197"
    bin = "claude"

    def launch(self, spec: LaunchSpec) -> Launch:
        """settings.json in CLAUDE_CONFIG_DIR; `claude -p PROMPT --dangerously-skip-permissions`."""
        env = _base_env(spec)
        config_dir = spec.home / ".claude"
        config_dir.mkdir(parents=True, exist_ok=True)
        settings = {
            "permissions": {"defaultMode": "bypassPermissions",
                            "deny": ["WebSearch", "WebFetch"]},
            "autoUpdates": False,
            "includeCoAuthoredBy": False,
            "cleanupPeriodDays": 1,
        }
        (config_dir / "settings.json").write_text(json.dumps(settings, indent=2))
        base = spec.base_url.removesuffix("/").removesuffix("/v1")
        env.update({
            "CLAUDE_CONFIG_DIR": str(config_dir),
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": spec.api_key,
            "ANTHROPIC_AUTH_TOKEN": "",
            "ANTHROPIC_MODEL": spec.model,
            "ANTHROPIC_SMALL_FAST_MODEL": spec.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": spec.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": spec.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": spec.model,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(spec.max_output_tokens),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_PROMPT_CACHING": "1",
            "MAX_THINKING_TOKENS": "0",
            "IS_SANDBOX": "1",  # bypassPermissions as root (the Docker runtime runs as root)
        })
        argv = [spec.executable, "-p", spec.instruction, "--dangerously-skip-permissions",
                "--model", spec.model, "--output-format", "text"]
        if spec.system_prompt is not None:
            argv += ["--system-prompt", spec.system_prompt]
        if spec.tools is not None:
            argv += ["--tools", ",".join(spec.tools)]
        return Launch(argv, env)


QWEN_TOOLS = ("run_shell_command", "read_file", "write_file", "edit", "glob", "grep_search",
              "list_directory", "todo_write", "monitor", "agent", "skill", "tool_search",
              "task_stop", "send_message", "ask_user_question", "exit_plan_mode", "web_fetch",
              "web_search")
"""Qwen Code's tools (0.15): with `tools` set, the others are excluded (`core` alone leaves its
agent, skill and deferred-tool machinery in)."""


class QwenCode(CLIAdapter):
    """Qwen Code: Chat Completions through its OpenAI auth type."""

    name = "qwen"
    package = "@qwen-code/qwen-code"
    version = "0.15.10"
    bin = "qwen"

    def launch(self, spec: LaunchSpec) -> Launch:
        """~/.qwen/settings.json; `qwen --yolo --auth-type openai -p PROMPT`, key in env."""
        env = _base_env(spec)
        qdir = spec.home / ".qwen"
        qdir.mkdir(parents=True, exist_ok=True)
        settings = {
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "security": {"auth": {"selectedType": "openai"}},
            "tools": ({"exclude": ["web_fetch", "web_search"]} if spec.tools is None else
                      {"core": list(spec.tools),
                       "exclude": [t for t in QWEN_TOOLS if t not in spec.tools]}),
            # its memory lives in HOME, which is new each episode: the extraction call after
            # every turn would be an extra call per episode that nothing rewards
            "memory": {"enableManagedAutoMemory": False},
            "model": {"name": spec.model},
        }
        (qdir / "settings.json").write_text(json.dumps(settings, indent=2))
        env.update({"OPENAI_BASE_URL": spec.base_url, "OPENAI_API_KEY": spec.api_key,
                    "OPENAI_MODEL": spec.model})
        argv = [spec.executable, "--yolo", "--auth-type", "openai", "--model", spec.model,
                "-p", spec.instruction]
        if spec.system_prompt is not None:
            argv += ["--system-prompt", spec.system_prompt]
        return Launch(argv, env)


ADAPTERS: dict[str, type[CLIAdapter]] = {
    "opencode": OpenCode, "codex": Codex, "claude": ClaudeCode, "claude-code": ClaudeCode,
    "qwen": QwenCode, "qwen-code": QwenCode,
}


def get_adapter(name: str) -> CLIAdapter:
    """The adapter named `name` (opencode, codex, claude, qwen); ConfigError for others."""
    try:
        return ADAPTERS[name]()
    except KeyError:
        raise ConfigError(f"unknown CLI {name!r}; one of {sorted(ADAPTERS)}") from None
