"""The import graph's promises: the serving side imports without torch, `relayrl.workflow` imports
without openai, and each package's `__all__` is sorted and names only what exists."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

TORCH_FREE = [
    "relayrl.chat",
    "relayrl.chat.wire_anthropic",
    "relayrl.chat.wire_openai_chat",
    "relayrl.chat.wire_openai_responses",
    "relayrl.chat.renderer",
    "relayrl.trajectory",
    "relayrl.gateway",
    "relayrl.gateway.app",
    "relayrl.gateway.server",
    "relayrl.router",
    "relayrl.router.app",
    "relayrl.router.server",
    "relayrl.viewer",
    "relayrl.viewer.app",
    "relayrl.client",
    "relayrl.workflow",
    "relayrl.rollout",
    "relayrl.remote_rollout",
    "relayrl.envs.reasoning_gym",
    "relayrl.envs.verifiers",
]

PACKAGES = [
    "relayrl",
    "relayrl.chat",
    "relayrl.chat.schema",
    "relayrl.client",
    "relayrl.engine",
    "relayrl.gateway",
    "relayrl.rollout",
    "relayrl.train",
    "relayrl.trajectory",
    "relayrl.viewer",
    "relayrl.workflow",
]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter that finds this checkout's `relayrl` first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_serving_side_imports_without_torch() -> None:
    result = _run(f"""
        import importlib, sys
        for name in {TORCH_FREE!r}:
            importlib.import_module(name)
            assert "torch" not in sys.modules, f"importing {{name}} imported torch"
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_workflow_imports_without_openai() -> None:
    # openai (and httpx2, which only it brings) come with the `agents` extra; block them
    result = _run("""
        import sys
        from importlib.abc import MetaPathFinder

        class Absent(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("openai", "httpx2"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Absent())
        import relayrl.workflow, relayrl.client
        from relayrl.workflow import AgentWorkflow
        assert "openai" not in sys.modules and "httpx2" not in sys.modules
        print(AgentWorkflow.__name__)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "AgentWorkflow"


def _isort_key(name: str) -> tuple[int, str]:
    # ruff's RUF022 order: CONSTANTS, then Classes, then everything else
    if name.isupper() or re.fullmatch(r"[A-Z0-9_]+", name):
        return (0, name)
    if name[:1].isupper():
        return (1, name)
    return (2, name)


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_sorted_and_every_name_resolves(package: str) -> None:
    if package == "relayrl.train":
        pytest.importorskip("torch")
    module = importlib.import_module(package)
    names = module.__all__
    assert names, f"{package}.__all__ is empty"
    assert list(names) == sorted(names, key=_isort_key), f"{package}.__all__ is not sorted"
    assert len(set(names)) == len(names), f"{package}.__all__ repeats a name"
    missing = [n for n in names if getattr(module, n, None) is None]
    assert not missing, f"{package}.__all__ names what it lacks: {missing}"
