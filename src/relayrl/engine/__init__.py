"""relayrl.engine: the `InferenceEngine` protocol and the engines that implement it.

`LocalEngine` needs torch and transformers, so it is imported lazily (on first use of the name or
through `load_engine("local", ...)`): importing this package, as the gateway does, pulls in
neither. `FakeEngine` needs only the `tokenizers` package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relayrl.engine.base import InferenceEngine, validate_request
from relayrl.engine.fake import FakeEngine
from relayrl.errors import ConfigError

if TYPE_CHECKING:
    from relayrl.engine.local import LocalEngine

__all__ = ["FakeEngine", "InferenceEngine", "LocalEngine", "load_engine", "validate_request"]

ENGINE_KINDS = ("local", "fake")


def load_engine(kind: str, model_path: str, **kw: Any) -> InferenceEngine:
    """An engine of `kind` ("local" or "fake") serving the model at `model_path`.

    For "fake", `model_path` names the folder whose tokenizer.json the fake encodes with
    (empty: byte-level ids); the other keyword arguments go to the engine's constructor.
    """
    if kind == "local":
        from relayrl.engine.local import LocalEngine

        return LocalEngine(model_path, **kw)
    if kind == "fake":
        kw.setdefault("tokenizer_path", model_path or None)
        return FakeEngine(**kw)
    raise ConfigError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}")


def __getattr__(name: str) -> Any:
    # PEP 562: `from relayrl.engine import LocalEngine` works, but only then imports torch.
    if name == "LocalEngine":
        from relayrl.engine.local import LocalEngine

        return LocalEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
