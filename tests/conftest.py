"""Shared fixtures: the default model's directory (provisioned once per machine).

Where torch is not installed (CI's Python 3.12 and 3.13 environments: relayrl's core, gateway,
client and workflow need no torch), a test module whose import needs torch is skipped as a whole,
with that reason, instead of failing to collect: the modules that import torch are found by
importing them, so a module that starts importing torch moves out of those runs by itself and
shows in their skip count (`-rs` lists them). A folder whose conftest.py imports torch is not
collected there (the summary names it). A test that imports torch only when it runs fails there;
give it `pytest.importorskip("torch")`. Everything else runs on every Python.
"""

from __future__ import annotations

import ast
import gc
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relayrl.heap import MALLOC_TRIM
from relayrl.models import DEFAULT_MODEL, model_path

# `gw`, `client`: a fake-engine gateway and its admin client, for the tests that run episodes
pytest_plugins = ("tests.episodes",)

def _have_torch() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # an import hook that refuses it
        return False


HAVE_TORCH = _have_torch()
_NEEDS_TORCH = ("needs torch, which this environment does not have (relayrl's core, gateway, "
                "client and workflow run without it; `pip install torch` for the rest)")


def _missing_torch(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is the import of torch failing."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _TorchOptionalModule(pytest.Module):
    """A test module that is skipped, not an error, when importing it needs the missing torch."""

    def _getobj(self) -> Any:
        try:
            return super()._getobj()
        except self.CollectError as e:
            if _missing_torch(e):
                raise pytest.skip.Exception(f"{self.path.name} {_NEEDS_TORCH}",
                                            allow_module_level=True) from None
            raise


def _conftest_imports_torch(folder: Path) -> bool:
    """Whether `folder`'s conftest.py imports torch at its top level."""
    conftest = folder / "conftest.py"
    if not conftest.is_file():
        return False
    for node in ast.parse(conftest.read_text()).body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n.split(".")[0] == "torch" for n in names):
            return True
    return False


_UNCOLLECTED: list[Path] = []


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without torch, leave out folders whose conftest.py imports it."""
    if not HAVE_TORCH and collection_path.is_dir() and _conftest_imports_torch(collection_path):
        _UNCOLLECTED.append(collection_path)
        return True
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the folders left out for want of torch."""
    for folder in _UNCOLLECTED:
        terminalreporter.write_line(f"not collected: {folder} ({_NEEDS_TORCH})")


def pytest_pycollect_makemodule(module_path: Any, parent: Any) -> pytest.Module | None:
    """Without torch, collect test modules as `_TorchOptionalModule`s (with it, as usual)."""
    if HAVE_TORCH or module_path.name == "conftest.py":
        return None
    return _TorchOptionalModule.from_parent(parent, path=module_path)


@pytest.fixture(scope="session")
def model_dir() -> str:
    """Local HF directory of the default packaged model."""
    return model_path(DEFAULT_MODEL)


def _rss_mb() -> int:
    """This process's resident memory (MB), from /proc (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


@pytest.fixture(scope="module", autouse=True)
def _return_memory_after_module() -> Iterator[None]:
    """After each module, hand its freed memory back to the system.

    A worker runs hundreds of modules, many of which load a model or an engine; without this,
    glibc keeps the freed heap and each of the two CI workers grew to 6-9 GB, and the whole
    suite past what a 24 GiB machine holds.
    """
    yield
    gc.collect()
    if MALLOC_TRIM is not None:  # None where the C library is not glibc
        MALLOC_TRIM(0)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """With RELAYRL_TEST_RSS_LOG=FILE, append each test's worker and resident memory to FILE
    (to find the tests that hold memory; docs/contributing.md)."""
    path = os.environ.get("RELAYRL_TEST_RSS_LOG")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a") as f:
            f.write(f"{worker}\t{_rss_mb()}\t{nodeid}\n")
