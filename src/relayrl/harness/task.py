"""Harbor task directories, read with `tomllib` (Harbor itself needs Python 3.12 and is not a dependency).

A task is a folder::

    instruction.md      the prompt the agent gets
    task.toml           [metadata], [agent] timeout_sec, [verifier] timeout_sec and env,
                        [environment] docker_image / workdir / env ...
    environment/        Dockerfile (and the files it COPYs) or a docker_image in task.toml
    tests/test.sh       the verifier: writes /logs/verifier/reward.txt (a number)
                        or /logs/verifier/reward.json (name -> number)
    solution/solve.sh   optional reference solution (the "oracle")

Only what relayrl's runtimes use is read into `HarborTask`; every other key of `task.toml` is
accepted and ignored, as long as the file parses. Multi-step tasks (`[[steps]]`) and Windows
tasks are refused: the runtimes here run one Linux instruction per episode.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, overload

from relayrl.errors import InvalidRequest


class TaskError(InvalidRequest):
    """A task directory that does not follow Harbor's format."""


DEFAULT_WORKDIR = "/app"
"""Where the agent works when neither task.toml nor the Dockerfile says (Terminal-Bench's habit)."""


@dataclass(frozen=True)
class CopyStep:
    """One `COPY src... dest` of the task's Dockerfile (sources relative to environment/)."""

    sources: tuple[str, ...]
    dest: str


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task directory, validated."""

    path: Path
    name: str
    instruction: str
    agent_timeout_s: float | None
    """`[agent] timeout_sec`; None when the task leaves it to the harness."""
    verifier_timeout_s: float
    """`[verifier] timeout_sec` (Harbor's default: 600 s)."""
    verifier_env: dict[str, str]
    environment_env: dict[str, str]
    workdir: str
    """The agent's working directory inside the environment (e.g. /app)."""
    docker_image: str | None
    dockerfile: Path | None
    copies: tuple[CopyStep, ...]
    """The Dockerfile's COPY steps from the build context (what the local runtime mirrors)."""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def tests_dir(self) -> Path:
        """tests/ (copied to /tests before the verifier runs)."""
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        """solution/ (copied to /solution by the oracle run)."""
        return self.path / "solution"

    @property
    def environment_dir(self) -> Path:
        """environment/ (the Docker build context)."""
        return self.path / "environment"

    @property
    def has_solution(self) -> bool:
        """Whether solution/solve.sh exists."""
        return (self.solution_dir / "solve.sh").is_file()


def load_task(path: str | Path) -> HarborTask:
    """Read and check one task directory; TaskError saying what is wrong, and where."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise TaskError(f"task directory {str(path)!r} does not exist")
    missing = [n for n in ("instruction.md", "task.toml", "tests/test.sh")
               if not (root / n).is_file()]
    if missing:
        raise TaskError(f"task {root.name!r} ({root}) is missing {', '.join(missing)}; a Harbor "
                        "task has instruction.md, task.toml and tests/test.sh")
    instruction = (root / "instruction.md").read_text()
    if not instruction.strip():
        raise TaskError(f"task {root.name!r}: instruction.md is empty")
    try:
        config = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"task {root.name!r}: task.toml is not valid TOML: {e}") from None
    if config.get("steps"):
        raise TaskError(f"task {root.name!r} is a multi-step task ([[steps]]); relayrl runs "
                        "single-step tasks only")
    agent = _table(config, "agent", root)
    verifier = _table(config, "verifier", root)
    env_cfg = _table(config, "environment", root)
    if str(env_cfg.get("os", "linux")).lower() != "linux":
        raise TaskError(f"task {root.name!r} targets os={env_cfg['os']!r}; only linux tasks run")
    dockerfile = root / "environment" / "Dockerfile"
    docker_workdir, copies = (_read_dockerfile(dockerfile) if dockerfile.is_file()
                              else (None, ()))
    workdir = env_cfg.get("workdir") or docker_workdir or DEFAULT_WORKDIR
    if not PurePosixPath(workdir).is_absolute():
        raise TaskError(f"task {root.name!r}: workdir {workdir!r} must be an absolute path")
    meta = config.get("metadata") or {}
    return HarborTask(
        path=root,
        name=str((config.get("task") or {}).get("name") or root.name),
        instruction=instruction,
        agent_timeout_s=_seconds(agent.get("timeout_sec"), "agent.timeout_sec", root, None),
        verifier_timeout_s=_seconds(verifier.get("timeout_sec"), "verifier.timeout_sec", root,
                                    600.0),
        verifier_env=_str_dict(verifier.get("env"), "verifier.env", root),
        environment_env=_str_dict(env_cfg.get("env"), "environment.env", root),
        workdir=str(workdir),
        docker_image=env_cfg.get("docker_image") or None,
        dockerfile=dockerfile if dockerfile.is_file() else None,
        copies=copies,
        metadata=dict(meta) if isinstance(meta, dict) else {},
    )


def find_tasks(root: str | Path) -> list[Path]:
    """The task directories under `root` (those holding a task.toml), sorted by path."""
    base = Path(root)
    if (base / "task.toml").is_file():
        return [base]
    return sorted(p.parent for p in base.rglob("task.toml"))


def _table(config: dict[str, Any], key: str, root: Path) -> dict[str, Any]:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise TaskError(f"task {root.name!r}: [{key}] in task.toml must be a table")
    return value


@overload
def _seconds(value: Any, what: str, root: Path, default: float) -> float: ...
@overload
def _seconds(value: Any, what: str, root: Path, default: None) -> float | None: ...
def _seconds(value: Any, what: str, root: Path, default: float | None) -> float | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise TaskError(f"task {root.name!r}: {what} must be a positive number of seconds, "
                        f"got {value!r}")
    return float(value)


def _str_dict(value: Any, what: str, root: Path) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TaskError(f"task {root.name!r}: {what} must be a table of strings")
    return {str(k): str(v) for k, v in value.items()}


_INSTRUCTION = re.compile(r"^\s*(WORKDIR|COPY|ADD)\s+(.*)$", re.IGNORECASE)


def _read_dockerfile(path: Path) -> tuple[str | None, tuple[CopyStep, ...]]:
    """The last WORKDIR and the COPY/ADD steps that copy from the build context."""
    text = re.sub(r"\\\n", " ", path.read_text())  # line continuations
    workdir: str | None = None
    copies: list[CopyStep] = []
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op, rest = m.group(1).upper(), m.group(2).strip()
        if op == "WORKDIR":
            target = rest.strip("\"'")
            workdir = str(PurePosixPath(workdir or "/") / target)
            continue
        try:
            words = shlex.split(rest)
        except ValueError:
            continue
        if any(w.startswith("--from") for w in words):
            continue  # from another build stage, not from environment/
        args = [w for w in words if not w.startswith("--")]
        if len(args) < 2 or any("://" in a for a in args):
            continue
        dest = args[-1]
        if not PurePosixPath(dest).is_absolute():
            dest = str(PurePosixPath(workdir or "/") / dest) + ("/" if dest.endswith("/") else "")
        copies.append(CopyStep(tuple(args[:-1]), dest))
    return workdir, tuple(copies)
