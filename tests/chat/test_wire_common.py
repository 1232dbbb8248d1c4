"""Every wire module is a `WireFormat`, and none borrows from another wire module."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from relayrl.chat import wire_anthropic, wire_openai_chat, wire_openai_responses
from relayrl.chat.wire_common import StreamEncoder, StreamEncoderFactory, WireFormat
from relayrl.gateway.wires import WIRES, interaction_id

MODULES = [wire_anthropic, wire_openai_chat, wire_openai_responses]


def _members(protocol: type) -> list[str]:
    return sorted(n for n in vars(protocol) if not n.startswith("_"))


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_each_wire_module_provides_what_wire_format_names(module) -> None:
    for name in [*_members(WireFormat), "ID_PREFIX"]:
        assert hasattr(module, name), f"{module.__name__} lacks {name}"
    encoder = module.StreamEncoder
    for name in _members(StreamEncoderFactory):
        assert callable(getattr(encoder, name, None)), f"{encoder} lacks {name}"
    for name in _members(StreamEncoder):
        ours = inspect.signature(getattr(StreamEncoder, name))
        theirs = inspect.signature(getattr(encoder, name))
        assert list(ours.parameters) == list(theirs.parameters), f"{encoder}.{name}"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_no_wire_module_imports_another(module) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    others = {m.__name__ for m in MODULES} - {module.__name__}
    assert not imported & others


def test_the_gateway_serves_each_wire_once_and_strips_its_id_prefix() -> None:
    assert sorted(w.format.__name__ for w in WIRES) == sorted(m.__name__ for m in MODULES)
    for w in WIRES:
        assert interaction_id(w.format.ID_PREFIX + "call-1") == "call-1"
    assert interaction_id("call-2") == "call-2"
