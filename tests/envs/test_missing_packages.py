"""Each ecosystem's package is an optional extra: without it, the adapter says how to install it."""

from __future__ import annotations

import sys

import pytest

from relayrl.envs import reasoning_gym as rgenv
from relayrl.envs import verifiers as vfenv


def test_reasoning_gym_missing_says_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import now fails
    with pytest.raises(ImportError, match=r"pip install 'reasoning-gym>=0.1.19,<0.2'"):
        rgenv.make_items("leg_counting", size=2, seed=1)


def test_verifiers_missing_says_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"pip install 'verifiers>=0.4,<0.5'"):
        vfenv.make_items("vf-addition")
