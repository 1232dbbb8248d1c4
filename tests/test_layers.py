"""The import graph reads bottom to top as docs/architecture.md's table says.

Every import of `relayrl.X` counts, including imports inside functions: a lazy import is still a
dependency. A new subpackage must be given a place here (and in the doc) before it can land.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "relayrl"

LAYERS: list[set[str]] = [
    {"errors", "types", "models", "asgi", "heap"},  # shared records, errors, models, uvicorn settings, the C heap
    {"kernels"},  # the compiled CPU kernels and the core count: below engine and train, which both use them
    {"chat"},
    {"trajectory"},
    {"engine"},
    {"gateway", "viewer"},  # the viewer is mounted on the gateway app
    {"router"},  # HTTP in front of gateways; imports chat (error bodies) only
    {"client"},
    {"workflow"},
    {"envs", "harness"},  # published environments (reasoning-gym, verifiers, TextArena, OpenEnv) and coding CLIs on Harbor tasks, as agents and workflows
    {"rollout"},
    {"remote_rollout"},
    {"train"},
    {"config"},
    {"launch", "service"},
    {"cli"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _unit(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "relayrl" and len(parts) > 1:
                found.add(parts[1])
    return found


MODULES = sorted(p for p in SRC.rglob("*.py") if _unit(p) not in {"__init__", "__main__"})


def test_every_subpackage_has_a_layer() -> None:
    units = {_unit(p) for p in MODULES}
    assert units <= set(RANK), f"give these a layer: {sorted(units - set(RANK))}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_a_higher_layer(path: Path) -> None:
    unit = _unit(path)
    upward = sorted(t for t in _imports(path) if t in RANK and RANK[t] > RANK[unit])
    assert not upward, f"{path.relative_to(SRC)} ({unit}) imports higher layers: {upward}"


def test_the_trainer_sees_engines_only_through_its_ports() -> None:
    # An engine's threads and load reach the trainer through train/ports.py's protocols; the C
    # kernels both use live below both (relayrl.kernels).
    reaching = sorted(str(p.relative_to(SRC)) for p in MODULES
                      if _unit(p) == "train" and "engine" in _imports(p))
    assert not reaching, f"train modules importing relayrl.engine: {reaching}"
