"""Tests of the runnable examples, which are scripts, not packages: `load_example` imports one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(folder: str, name: str, on_path: bool = False) -> ModuleType:
    """`examples/{folder}/{name}.py` as a module. `on_path` puts its folder on sys.path for good,
    for examples whose modules import each other by name (two examples' folders both on the path
    would shadow each other's modules: both have a `run_episodes`)."""
    here = EXAMPLES / folder
    if on_path and str(here) not in sys.path:
        sys.path.insert(0, str(here))
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", here / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module
