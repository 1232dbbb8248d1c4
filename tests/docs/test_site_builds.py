"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page in the
navigation or a reference that no longer matches the code fails it), and its generated reference
pages say what the code says.

The build runs as CI would run it, in a subprocess, into a temporary folder.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS_TORCH = ("the reference documents RelayConfig, and relayrl.config imports relayrl.train, "
               "which needs torch (`pip install 'relayrl[train]'`)")


def _gen_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch", reason=NEEDS_TORCH)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_the_site_builds_strict_with_every_page_of_the_navigation(site: Path) -> None:
    for page in ("index.html", "quickstart/index.html", "concepts/sessions/index.html",
                 "benchmarks/index.html", "design-decisions/index.html",
                 "reference/python-api/index.html"):
        assert (site / page).is_file(), page


def test_the_generated_reference_matches_the_code(site: Path) -> None:
    from relayrl.cli import build_parser
    from relayrl.config import RelayConfig

    config_page = (site / "reference/config/index.html").read_text()
    assert "train.lr" in config_page and "rollout.agent.credit" in config_page
    assert str(RelayConfig().train.lr) in config_page
    cli_page = (site / "reference/cli/index.html").read_text()
    for command in build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        assert f"relayrl {command}" in cli_page
    http_page = (site / "reference/http-api/index.html").read_text()
    assert "/v1/chat/completions" in http_page and "/rl/start_session" in http_page
    assert (site / "reference/openapi.json").is_file()
    assert "SessionClient" in (site / "reference/python-api/index.html").read_text()


def test_the_benchmarks_page_is_results_md(site: Path) -> None:
    page = (site / "benchmarks/index.html").read_text()
    first_heading = next(line for line in (ROOT / "benchmarks/RESULTS.md").read_text().splitlines()
                         if line.startswith("## "))
    assert first_heading[3:] in page


def test_every_config_key_is_documented_in_the_code() -> None:
    pytest.importorskip("torch", reason=NEEDS_TORCH)
    from relayrl.config import RelayConfig
    from relayrl.remote_rollout.config import ServerConfig

    gen = _gen_reference()
    assert gen.undocumented(RelayConfig) == []
    assert gen.undocumented(ServerConfig) == []


@dataclasses.dataclass
class _Example:
    trailing: int = 1          # on the field's line
    # above a field with no comment of its own
    above: str = "x"
    docstring: float = 2.0     # the docstring below wins
    """An attribute docstring."""
    continued: bool = True     # a field's comment
    # continues on the next line when the next field has its own
    last: int | None = None    # the last one
    plain: int = 0


def test_field_docs_come_from_comments_and_attribute_docstrings() -> None:
    docs = _gen_reference().field_docs(_Example)
    assert docs == {"trailing": "on the field's line",
                    "above": "above a field with no comment of its own",
                    "docstring": "An attribute docstring.",
                    "continued": "a field's comment continues on the next line when the next "
                                 "field has its own",
                    "last": "the last one",
                    "plain": ""}
