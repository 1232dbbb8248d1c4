"""relayrl.engine: the `InferenceEngine` protocol and the engines that implement it.

`LocalEngine` needs torch and transformers, so it is imported lazily (on first use of the name or
through `load_engine("local", ...)`): importing this package, as the gateway does, pulls in
neither. `FakeEngine` needs only the `tokenizers` package; `VLLMEngine` (a vLLM server over HTTP)
only httpx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relayrl.engine.base import InferenceEngine, validate_request
from relayrl.engine.fake import FakeEngine
from relayrl.engine.vllm import VLLMEngine
from relayrl.errors import ConfigError

if TYPE_CHECKING:
    from relayrl.engine.local import LocalEngine

__all__ = [
    "FakeEngine",
    "InferenceEngine",
    "LocalEngine",
    "VLLMEngine",
    "load_engine",
    "validate_request",
]

ENGINE_KINDS = ("local", "fake", "vllm", "sglang")


def load_engine(kind: str, model_path: str, **kw: Any) -> InferenceEngine:
    """An engine of `kind` ("local", "fake", "vllm" or "sglang") serving the model at `model_path`.

    For "fake", `model_path` names the folder whose tokenizer.json the fake encodes with
    (empty: byte-level ids); for "vllm", `url=` names the running server and `model_path` gives
    the vocabulary for validation. Other keyword arguments go to the engine's constructor.
    """
    if kind == "local":
        from relayrl.engine.local import LocalEngine

        return LocalEngine(model_path, **kw)
    if kind == "fake":
        kw.setdefault("tokenizer_path", model_path or None)
        return FakeEngine(**kw)
    if kind == "vllm":
        url = kw.pop("url", None)
        if not url:
            raise ConfigError("engine 'vllm' needs the server's url (engine_url / --engine-url)")
        kw.setdefault("model_path", model_path or None)
        return VLLMEngine(url, **kw)
    if kind == "sglang":
        from relayrl.engine.sglang import SGLangEngine

        url = kw.pop("url", None)
        if not url:
            raise ConfigError("engine 'sglang' needs the server's url (engine_url / --engine-url)")
        kw.setdefault("model_path", model_path or None)
        return SGLangEngine(url, **kw)
    raise ConfigError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}")


def __getattr__(name: str) -> Any:
    # PEP 562: `from relayrl.engine import LocalEngine` works, but only then imports torch.
    if name == "LocalEngine":
        from relayrl.engine.local import LocalEngine

        return LocalEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
