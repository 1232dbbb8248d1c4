"""Tokenizers for the rollout server: a chat template on a real tokenizer, and an LRU cache of them.

The server needs only `apply_chat_template(messages, tools) -> ids`, to count the tokens it adds
between LLM calls (the `response_mask`). Two backends: `relayrl` (default) renders the model
folder's chat template with jinja2 as Hugging Face does and encodes with the `tokenizers`
package, so the server stays torch-free and loads a tokenizer in well under a second;
`transformers` uses `AutoTokenizer` (and honours `trust_remote_code`), for tokenizers only it
can load. May import relayrl.chat.renderer (the template environment), relayrl.models and
relayrl.errors; never the gateway or anything above it.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from relayrl.chat.renderer import SPECIAL_TOKEN_NAMES, compile_template

BACKENDS = ("relayrl", "transformers")


class TokenizerLoadError(Exception):
    """A tokenizer (or its chat template) could not be loaded."""


class ChatTokenizer(Protocol):
    """What a rollout session needs from a tokenizer."""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation."""
        ...


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates read them: None-valued keys dropped, tool-call arguments as objects."""
    out = []
    for m in messages:
        d = {k: v for k, v in m.items() if v is not None}
        if d.get("tool_calls"):
            d["tool_calls"] = [_template_call(c) for c in d["tool_calls"]]
        out.append(d)
    return out


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    # OpenAI sends arguments as JSON text; templates (and vLLM, verl) render them as an object.
    c = dict(call)
    fn = dict(c.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    c["function"] = fn
    return c


class TemplateTokenizer:
    """A model folder's chat template and `tokenizer.json`, applied as `apply_chat_template` does."""

    def __init__(self, tokenizer: Any, template: str, special_tokens: Mapping[str, str]) -> None:
        self._tok = tokenizer
        self._template = compile_template(template)
        self.special_tokens = dict(special_tokens)

    @classmethod
    def from_dir(cls, folder: str | Path, template: str | None = None) -> TemplateTokenizer:
        """Load from a Hugging Face folder; `template` overrides its chat template."""
        from tokenizers import Tokenizer

        path = Path(folder)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerLoadError(f"{path} has no tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        source = template or _chat_template(path, config)
        if not source:
            raise TokenizerLoadError(f"{path} has no chat template")
        special = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(n)))}
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), source, special)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (special tokens spelled by the template)."""
        text = self._template.render(messages=template_messages(messages),
                                     tools=list(tools) if tools else None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens kept."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TransformersTokenizer:
    """`transformers.AutoTokenizer` behind the same interface (imports transformers when built)."""

    def __init__(self, folder: str, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids from `AutoTokenizer.apply_chat_template`."""
        out = self._tok.apply_chat_template(template_messages(messages),
                                            tools=[dict(t) for t in tools] if tools else None,
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens kept."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


def load_tokenizer(name: str, backend: str = "relayrl",
                   trust_remote_code: bool = False) -> ChatTokenizer:
    """Load `name` (a packaged relayrl model name or a local HF folder); TokenizerLoadError if not."""
    if backend not in BACKENDS:
        raise TokenizerLoadError(f"tokenizer backend {backend!r} is not one of {list(BACKENDS)}")
    try:
        from relayrl.models import model_path

        folder = model_path(name)
        if backend == "transformers":
            return TransformersTokenizer(folder, trust_remote_code)
        if not Path(folder).is_dir():
            raise TokenizerLoadError(f"{name!r} is neither a packaged model nor a local folder "
                                     "(the relayrl backend loads no hub ids)")
        return TemplateTokenizer.from_dir(folder)
    except TokenizerLoadError:
        raise
    except Exception as e:
        raise TokenizerLoadError(f"could not load tokenizer {name!r}: {type(e).__name__}: "
                                 f"{e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: the default one
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class TokenizerCache:
    """At most `max_size` tokenizers, least recently used evicted; each loaded once, even when
    many rollouts ask for it at the same moment (double-checked under an `asyncio.Lock`).

    Loading runs in a thread so the event loop keeps serving. One lock for all names: loads are
    rare (a server sees a handful of tokenizers) and a single lock keeps eviction simple.
    """

    def __init__(self, max_size: int, loader: Callable[[str], ChatTokenizer]) -> None:
        if max_size < 1:
            raise ValueError(f"tokenizer cache size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._loader = loader
        self._items: OrderedDict[str, ChatTokenizer] = OrderedDict()
        self._lock = asyncio.Lock()
        self.loads = 0
        self.hits = 0
        self.evictions = 0

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Cached names, least recently used first."""
        return list(self._items)

    async def get(self, name: str) -> ChatTokenizer:
        """The tokenizer for `name`, loading it (once) if it is not cached."""
        tok = self._lookup(name)
        if tok is not None:
            return tok
        async with self._lock:
            tok = self._lookup(name)  # another task may have loaded it while we waited
            if tok is not None:
                return tok
            tok = await _in_thread(self._loader, name)
            self.loads += 1
            self._items[name] = tok
            while len(self._items) > self.max_size:
                self._items.popitem(last=False)
                self.evictions += 1
            return tok

    def _lookup(self, name: str) -> ChatTokenizer | None:
        tok = self._items.get(name)
        if tok is not None:
            self._items.move_to_end(name)
            self.hits += 1
        return tok


def _in_thread(fn: Callable[[str], ChatTokenizer], name: str) -> Awaitable[ChatTokenizer]:
    return asyncio.to_thread(fn, name)


__all__ = ["BACKENDS", "ChatTokenizer", "TemplateTokenizer", "TokenizerCache",
           "TokenizerLoadError", "TransformersTokenizer", "load_tokenizer", "template_messages"]
