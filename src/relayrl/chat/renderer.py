"""The `Renderer`: a model's chat template applied exactly as Hugging Face applies it, without torch.

It loads `tokenizer.json` with the `tokenizers` package, reads `tokenizer_config.json` (special
tokens) and the chat template (`chat_template.jinja`, or `chat_template` in the config), and renders
with a jinja2 sandbox configured like `transformers.utils.chat_template_utils` (trim_blocks,
lstrip_blocks, loopcontrols, HF's `tojson`, `raise_exception`, `strftime_now`, a no-op
`{% generation %}` tag). Rendered text is encoded with `add_special_tokens=False`: the template
writes the special tokens itself. The tests check ids token for token against `apply_chat_template`.

Incremental encoding (`extend`) is the main tradeoff. A multi-turn agent's next prompt is built as
the previous call's exact ids (prompt + sampled output) + boundary glue + the new turns encoded +
the generation prompt; sampled text is never re-tokenized. This is what keeps training on exactly
the tokens that were sampled, but the result equals a fresh full render only when the model wrote
exactly what the template would render for its reply. When it did not (Qwen2.5 writing a tool call
as bare JSON that the template renders inside `<tool_call>` tags, a reply with reasoning a template
drops, re-serialized tool-call JSON), `extend` keeps the sampled tokens and the full render differs
inside that reply only; the prefix before it and the new turns after it are identical.

The glue is derived from the template itself by rendering probes, never hard-coded: the text the
template writes after an assistant's content ("turn end", `<|im_end|>\\n` for ChatML) is found by
rendering one conversation with and without a sentinel assistant reply. If the sampled output ended
with a stop token whose text opens the turn end (`<|im_end|>`), the glue is the rest (`\\n`);
if it ended for any other reason (length, a different stop token such as `<|endoftext|>`), the
glue is the whole turn end, so the next turn always starts where the template expects it.
The new turns' text is the part of the full render that follows the render of the earlier
messages (the history as stored, not as the client re-sent it). When the template is not
append-only for that step (it rewrites history, e.g. drops earlier reasoning), reasoning is
ignored on both sides and it tries again; `None` is returned if that fails too, so the caller
opens a new segment instead of training on a prompt nobody saw.

`extends_prefix` says whether the template is append-only for the conversations the gateway
produces: after each assistant turn, the render of the conversation so far is a prefix of the
next render (checked on probes: plain turns, tool calls and results, tools listed, reasoning).
`renders_locally` says, on the same probes, whether the new turns' text comes out the same when
only the first message and the last earlier turn are rendered beside them. Then `extend` renders
that short window (the first message and the last `EXTEND_WINDOW` turns) instead of the whole
history twice, so a call late in a 100-message episode costs about what the second call does;
a template that numbers its turns, or refuses the window, renders everything as before.

What HF does that we copy on purpose: message keys whose value is None are dropped; reasoning is
given as `reasoning_content` and aliased as `thinking`; special tokens (`bos_token`, `eos_token`, ...)
are template variables; control tokens in user text are not sanitized (HF's default), so text that
spells `<|im_end|>` is encoded as that special token, exactly as `apply_chat_template` does.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from relayrl.chat.conversation import (
    Conversation,
    Message,
    Tool,
    ToolCall,
)
from relayrl.errors import InvalidRequest, ModelError

SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
"""Named special tokens that HF passes to every chat template as variables."""

DOCUMENT_END_TOKENS = (
    "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
)
"""End-of-document/turn tokens that also stop generation when the vocabulary has them as special
tokens: a chat model that writes its pretraining document end is done, whatever its config says."""

_PROBE_USER = "relayrl-probe-user"
_PROBE_REPLY = "relayrl-probe-reply"


# ---------------------------------------------------------------------------------------------
# The jinja environment, configured like transformers' `_cached_compile_jinja_template`.


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF overrides jinja's tojson: no HTML escaping, and these options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict` for templates, without attribute access to the real type (as HF does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        """Like `dict.fromkeys`."""
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as HF's does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own trick: `self` may be a kwarg
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace: {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` and render its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block into a call that returns its body."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with a fast path for `message.role` on the plain dicts we pass."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        """`obj.attribute` as the sandbox resolves it (a dict's key when dict has no such name)."""
        # Templates spell `message.role`, which the sandbox resolves by trying the attribute,
        # catching AttributeError and then indexing: half the render time of a long history.
        # A dict instance has no attributes beyond its type's, so the result is the same.
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like transformers' (cached per source)."""
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"chat template does not compile: {e}") from e


# ---------------------------------------------------------------------------------------------
# Conversation -> the OpenAI-style dicts chat templates read.


def template_message(m: Message) -> dict[str, Any]:
    """One message as a chat template sees it (OpenAI-style dict; None-valued keys left out)."""
    d: dict[str, Any] = {"role": m.role}
    # OpenAI sends content=null on an assistant turn that only calls tools; HF drops None keys.
    if m.content or not (m.role == "assistant" and m.tool_calls):
        d["content"] = m.content
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_obj()}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    if m.reasoning is not None:
        # HF fills `thinking` from `reasoning_content` for templates (gpt-oss) that read that name.
        d = {"thinking": m.reasoning, **d, "reasoning_content": m.reasoning}
    return d


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    """Tools as chat templates see them; None when there are none (as HF passes `tools=None`)."""
    if not tools:
        return None
    return [
        {"type": "function",
         "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]


def first_divergence(prev: Sequence[Message], messages: Sequence[Message]) -> int | None:
    """Index of the first message of `prev` that `messages` does not repeat; None if it extends `prev`."""
    # canonical_bytes is cached on each message: the session's parent lookup has computed it
    for i, m in enumerate(prev):
        if i >= len(messages):
            return i
        n = messages[i]
        if m is not n and m.canonical_bytes != n.canonical_bytes:
            return i
    return None


# ---------------------------------------------------------------------------------------------
# Loading.


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates, as transformers 5 finds them ("default" is the plain one)."""
    templates: dict[str, str] = {}
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    main = folder / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        templates["default"] = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):
        for entry in config["chat_template"]:
            templates[entry["name"]] = entry["template"]
    return templates


def _generation_eos_ids(folder: Path) -> tuple[int, ...]:
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(i for i in eos if isinstance(i, int))
    return ()


PIECE_CACHE_CHARS = 1 << 21
"""Characters of text pieces whose ids a `PieceEncoder` keeps (2M: at most a few tens of MB)."""
PIECE_CACHE_MAX_PIECE = 1 << 16
"""Pieces longer than this (a huge tool result) are encoded every time rather than cached."""
LONG_TEXT_CHARS = 1 << 16
"""Texts longer than this are encoded whole, past the piece cache, with the GIL released."""
EXTEND_WINDOW = 2
"""Earlier messages (besides the first) rendered beside a call's new turns when the template
renders locally: enough for templates that look back at the previous turn (Qwen's tool-result
grouping)."""


class PieceEncoder:
    """`Tokenizer.encode(text, add_special_tokens=False)`, split on added tokens, with a piece cache.

    HF tokenizers first splits a text on its added tokens (`<|im_start|>`, ...) and normalizes,
    pre-tokenizes and encodes each piece between them on its own. Chat prompts repeat the same
    pieces call after call (the system prompt, every earlier turn), so this does the split itself
    (leftmost-longest, as HF's matcher) and keeps each piece's ids in a bounded LRU cache: a
    growing conversation only encodes its new turns. The tradeoff is that it is exact only when
    the split is all there is to it: no added token strips whitespace, matches single words or is
    matched after normalization, and nothing treats the first piece of a text specially
    (Metaspace `prepend_scheme="first"`, truncation, padding). `for_tokenizer` returns None for
    other tokenizers, and for any tokenizer it fails on a probe text.
    """

    def __init__(self, tokenizer: Tokenizer, max_chars: int = PIECE_CACHE_CHARS) -> None:
        self._tok = tokenizer
        self._added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()
                       if t.content}
        # Longest first: at one position the alternation takes the longest token, and the scan
        # takes the leftmost position, which is HF's leftmost-longest matching.
        alternatives = sorted(self._added, key=len, reverse=True)
        self._split = (re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
                       if alternatives else None)
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        # One lock per `encode` (not per piece): the gateway's thread never waits on it, and
        # trainer threads sharing a renderer cannot corrupt the cache or its size.
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> PieceEncoder | None:
        """A `PieceEncoder` for `tokenizer`, or None when splitting could change the ids."""
        added = tokenizer.get_added_tokens_decoder().values()
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
            return None
        if getattr(tokenizer, "encode_special_tokens", False):
            return None  # special tokens are then encoded as text: no split on them
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return None
        pre = tokenizer.pre_tokenizer
        if pre is not None and '"first"' in pre.__getstate__().decode(errors="replace"):
            return None  # Metaspace prepends only to a text's first piece
        encoder = cls(tokenizer)
        if any(t.content and tokenizer.token_to_id(t.content) != i
               for i, t in tokenizer.get_added_tokens_decoder().items()):
            return None
        for text in encoder._probes():
            if encoder.encode(text) != tokenizer.encode(text, add_special_tokens=False).ids:
                return None
        encoder.clear()
        return encoder

    def _probes(self) -> list[str]:
        tokens = sorted(self._added, key=len)[:4] + sorted(self._added, key=len)[-2:]
        glued = [f"x{t} y\n{t}\n  z {t}{t}é\t" for t in tokens]
        return [*glued, "".join(tokens) + " tail", " lead  and trail  ", "\n\nword"]

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, equal to the tokenizer's `encode(text, add_special_tokens=False).ids`."""
        # With a capturing group, split alternates text piece, added token, text piece, ...
        parts = self._split.split(text) if self._split is not None else [text]
        with self._lock:
            cache = self._cache
            missing = [p for p in dict.fromkeys(parts[::2]) if p and p not in cache]
            fresh = dict(zip(missing, self._encode_pieces(missing), strict=True))
            ids: list[int] = []
            for i, p in enumerate(parts):
                if i & 1:
                    ids.append(self._added[p])
                elif p:
                    got = fresh.get(p)
                    if got is None:
                        got = cache[p]
                        cache.move_to_end(p)
                    ids.extend(got)
            for p, got in fresh.items():
                self._remember(p, got)
        return ids

    def _encode_pieces(self, pieces: list[str]) -> list[tuple[int, ...]]:
        if not pieces:
            return []
        if len(pieces) == 1:
            return [tuple(self._tok.encode(pieces[0], add_special_tokens=False).ids)]
        return [tuple(e.ids) for e in self._tok.encode_batch(pieces, add_special_tokens=False)]

    def _remember(self, piece: str, ids: tuple[int, ...]) -> None:
        if len(piece) > PIECE_CACHE_MAX_PIECE or piece in self._cache:
            return
        self._cache[piece] = ids
        self._chars += len(piece)
        for _ in range(len(self._cache)):  # evict least recently used until within budget
            if self._chars <= self.max_chars:
                break
            old, _ids = self._cache.popitem(last=False)
            self._chars -= len(old)

    @property
    def cached_chars(self) -> int:
        """Characters of text whose ids are cached now (never more than `max_chars`)."""
        return self._chars

    def clear(self) -> None:
        """Forget every cached piece."""
        with self._lock:
            self._cache.clear()
            self._chars = 0


@dataclass(frozen=True)
class _TurnEnd:
    """What the template writes after an assistant reply's content, found by probing."""

    text: str
    """E.g. `<|im_end|>\\n` for ChatML."""
    token_id: int | None
    """The special token that opens `text` (the end-of-turn token), if one does."""


class Renderer:
    """A model's chat template and tokenizer: conversation -> prompt ids, and incremental prompts."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: Mapping[str, str],
        special_tokens: Mapping[str, str],
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        if not templates:
            raise ModelError("the model has no chat template")
        self._tok = tokenizer
        self._templates = dict(templates)
        self.special_tokens = dict(special_tokens)
        """Named special tokens (bos_token, eos_token, ...) as the template sees them."""
        self.deterministic: bool = not any("strftime_now" in t or "random" in t
                                           for t in self._templates.values())
        """Whether the same conversation always renders to the same text: False when a template
        may read the clock (`strftime_now`) or draw at random, so renders must not be cached."""
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        """Size of the tokenizer's vocabulary (the model's embedding may be padded larger)."""
        self._added = {
            t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        eos = self.special_tokens.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos else None
        if eos_id is None and extra_stop_ids:
            eos_id = extra_stop_ids[0]
        if eos_id is None:
            raise ModelError("the tokenizer has no eos token (tokenizer_config.json eos_token)")
        self.eos_token_id: int = eos_id
        self._pieces = PieceEncoder.for_tokenizer(tokenizer)
        self._openers = tuple(self._added)
        self._turn_end = self._probe_turn_end()
        stops = [eos_id]
        if self._turn_end is not None and self._turn_end.token_id is not None:
            stops.append(self._turn_end.token_id)
        stops += list(extra_stop_ids)
        stops += [self._added[t] for t in DOCUMENT_END_TOKENS if t in self._added]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        """Token ids that end an assistant turn (eos, the template's end-of-turn token, ...)."""
        self.extends_prefix: bool = self._turn_end is not None and self._probe_append_only()
        """Whether, after each assistant turn, the template's render so far is a prefix of the next
        render, for the conversations the gateway produces (plain turns, tool calls and results,
        tools listed, replies with reasoning). When True, `extend` equals a full render whenever the model wrote exactly
        what the template renders for its reply."""
        self.renders_locally: bool = self.extends_prefix and self._probe_local()
        """Whether the new turns render the same beside only the first and the last earlier
        messages as beside the whole history (checked on the same probes): then `extend` renders
        that window, not the whole conversation twice."""

    @classmethod
    def from_pretrained(cls, path: str) -> Renderer:
        """Load from a local Hugging Face directory (cached per resolved path)."""
        return _load(str(Path(path).expanduser().resolve()))

    # -- rendering ------------------------------------------------------------------------------

    def render_text(self, conv: Conversation, add_generation_prompt: bool = True) -> str:
        """The prompt text the chat template writes for `conv`."""
        return self._render(conv.messages, conv.rendered_tools(), conv.template_kwargs,
                            add_generation_prompt)

    def render(self, conv: Conversation, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids for `conv`, equal to HF's `apply_chat_template(..., tokenize=True)`."""
        return self.encode(self.render_text(conv, add_generation_prompt))

    def _render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
    ) -> str:
        if not messages:
            raise InvalidRequest("cannot render an empty conversation: at least one message is needed")
        return self._render_dicts([template_message(m) for m in messages], template_tools(tools),
                                  template_kwargs, add_generation_prompt)

    def _render_dicts(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
    ) -> str:
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        source = self._templates.get(name) or next(iter(self._templates.values()))
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return compile_template(source).render(
                messages=messages, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **variables,
            )
        except jinja2.TemplateError as e:
            # raise_exception() in a template rejects the conversation (e.g. roles out of order).
            raise InvalidRequest(f"the chat template rejected the conversation: {e}") from e

    # -- rendering after a known head ----------------------------------------------------------

    def render_with_head(self, conv: Conversation, head: int) -> tuple[list[int], int | None]:
        """`render(conv)`, and how many of its ids are the render of its first `head` messages.

        The count is given (else None) only when the template renders locally, message `head - 1`
        is an assistant turn, and the ids split there exactly: the head's ids followed by the ids
        of the rest, which opens on a special token. `render_after_head` builds later
        conversations with the same head from those ids.
        """
        text = self.render_text(conv)
        ids = self.encode(text)
        tail = self._tail_text(conv, head)
        if tail is None or not text.endswith(tail):
            return ids, None
        head_ids = self.encode(text[:len(text) - len(tail)])
        if [*head_ids, *self.encode(tail)] != ids:
            return ids, None
        return ids, len(head_ids)

    def render_after_head(self, head_ids: Sequence[int], conv: Conversation,
                          head: int) -> list[int] | None:
        """`render(conv)` given the ids `render_with_head` found for its first `head` messages:
        only the turns after them are rendered (beside a window) and encoded. None if it cannot."""
        tail = self._tail_text(conv, head)
        return None if tail is None else [*head_ids, *self.encode(tail)]

    def _tail_text(self, conv: Conversation, head: int) -> str | None:
        messages = conv.messages
        if (not self.renders_locally or self._pieces is None or not 0 < head < len(messages)
                or messages[head - 1].role != "assistant"):
            return None
        # Opening on a special token makes the boundary clean: the tokenizer splits there first.
        text = self._new_turns_text(messages[:head], conv)
        return text if text and text.startswith(self._openers) else None

    # -- incremental encoding -------------------------------------------------------------------

    def extend(
        self,
        prev_ids: Sequence[int],
        prev_messages: Sequence[Message] | Conversation,
        conv: Conversation,
    ) -> list[int] | None:
        """Prompt ids for `conv` that continue an earlier call's exact ids; None if it does not extend.

        `prev_ids` is the earlier prompt + its sampled output; `prev_messages` the earlier messages
        plus the reply. Pass the earlier call as a `Conversation` (messages + reply, its tools and
        template kwargs) to also return None when tools or template kwargs changed; a plain message
        sequence asserts they did not.
        """
        if isinstance(prev_messages, Conversation):
            if (prev_messages.rendered_tools() != conv.rendered_tools()
                    or dict(prev_messages.template_kwargs) != dict(conv.template_kwargs)):
                return None
            prev_msgs: Sequence[Message] = prev_messages.messages
        else:
            prev_msgs = prev_messages
        if (self._turn_end is None or not prev_msgs or prev_msgs[-1].role != "assistant"
                or first_divergence(prev_msgs, conv.messages) is not None):
            return None
        new_text = self._new_turns_text(prev_msgs, conv)
        if new_text is None:
            return None
        return [*prev_ids, *self.encode(self.boundary_glue(prev_ids) + new_text)]

    def boundary_glue(self, prev_ids: Sequence[int]) -> str:
        """Text the template puts between an assistant's sampled output and the next turn."""
        if self._turn_end is None:
            raise ModelError("this chat template's assistant turns could not be probed")
        end = self._turn_end.text
        if prev_ids and prev_ids[-1] in self.stop_token_ids:
            stop_text = self._tok.decode([prev_ids[-1]], skip_special_tokens=False)
            if stop_text and end.startswith(stop_text):
                return end[len(stop_text):]
        # Ended by length, or by a stop token the template does not write: close the turn fully.
        return end

    def _new_turns_text(self, prev_msgs: Sequence[Message], conv: Conversation,
                        window: int | None = EXTEND_WINDOW) -> str | None:
        """The template's text for the turns after `prev_msgs`, plus the generation prompt.

        With a `window` (and a template probed to render locally), only the first message and the
        last `window` earlier messages are rendered beside the new turns: a long history costs
        what a short one does. A window the template refuses or that does not line up falls back
        to rendering everything.
        """
        assert self._turn_end is not None
        tools, kwargs = conv.rendered_tools(), conv.template_kwargs
        # The history is rendered as stored, not as re-sent: the two are canonically equal, but a
        # client may have re-serialized tool-call JSON, which the template would render differently.
        before = tuple(prev_msgs)
        new = conv.messages[len(prev_msgs):]
        if window is not None and self.renders_locally and len(before) > window + 1:
            try:
                text = self._text_after((before[0], *before[-window:]), new, tools, kwargs)
            except InvalidRequest:  # e.g. a template that wants roles in order
                text = None
            if text is not None:
                return text
        return self._text_after(before, new, tools, kwargs)

    def _text_after(self, before: tuple[Message, ...], new: Sequence[Message],
                    tools: Sequence[Tool], kwargs: Mapping[str, Any]) -> str | None:
        assert self._turn_end is not None
        for attempt in range(2):
            if attempt:  # not append-only with reasoning (the template drops old reasoning)
                before, new = _without_reasoning(before), _without_reasoning(new)
            head = self._render(before, tools, kwargs, add_generation_prompt=False)
            full = self._render((*before, *new), tools, kwargs, add_generation_prompt=True)
            if full.startswith(head) and head.endswith(self._turn_end.text):
                return full[len(head):]
        return None

    # -- tokens ---------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens spelled in it become their ids, none are added."""
        if len(text) > LONG_TEXT_CHARS:
            # `encode_batch` releases the GIL (`encode` does not), so a long prompt tokenized in a
            # worker thread does not stall the event loop; the piece cache would not keep it anyway
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if self._pieces is None:
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._pieces.encode(text)

    def forget_cached_pieces(self) -> None:
        """Drop the piece cache (it refills as prompts come; the gateway's upkeep calls this)."""
        if self._pieces is not None:
            self._pieces.clear()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Most characters one token stands for (the longest vocabulary entry): a text of `c`
        characters is at least `c / max_token_chars` tokens."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(t) for t in vocab), default=1) or 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (special tokens kept unless asked otherwise, as HF's `decode`)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The decoded text of each token alone (a piece of a multi-byte character shows as U+FFFD)."""
        return [self._tok.decode([i], skip_special_tokens=False) for i in ids]

    # -- probes ---------------------------------------------------------------------------------

    def _probe_turn_end(self) -> _TurnEnd | None:
        user = Message(role="user", content=_PROBE_USER)
        reply = Message(role="assistant", content=_PROBE_REPLY)
        try:
            prompt = self._render((user,), (), {}, add_generation_prompt=True)
            whole = self._render((user, reply), (), {}, add_generation_prompt=False)
        except InvalidRequest:
            return None
        if not whole.startswith(prompt) or _PROBE_REPLY not in whole[len(prompt):]:
            return None
        text = whole[whole.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
        opening = [t for t in self._added if t and text.startswith(t)]
        token_id = self._added[max(opening, key=len)] if opening else None
        return _TurnEnd(text=text, token_id=token_id)

    def _probe_append_only(self) -> bool:
        """Check the append-only property on the conversation shapes the gateway produces."""
        tool = Tool(name="probe_tool", description="a probe", parameters={
            "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})
        for conv in _probe_conversations(tool):
            for i, m in enumerate(conv.messages):
                if m.role != "assistant":
                    continue
                before = Conversation(conv.messages[:i], conv.tools)
                upto = Conversation(conv.messages[: i + 1], conv.tools)
                after = Conversation(conv.messages[: i + 2], conv.tools)
                try:
                    prompt = self.render_text(before, True)
                    head = self.render_text(upto, False)
                    full = self.render_text(after, True)
                except InvalidRequest:
                    return False
                if not (head.startswith(prompt) and full.startswith(head)):
                    return False
        return True

    def _probe_local(self) -> bool:
        """Check that a one-message window gives the new turns' text a full render gives."""
        tool = Tool(name="probe_tool", description="a probe", parameters={
            "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})
        for conv in _probe_conversations(tool):
            for i, m in enumerate(conv.messages[:-1]):
                if m.role != "assistant" or i < 2:
                    continue
                prev = conv.messages[:i + 1]
                ends = [j for j in range(i + 1, len(conv.messages))
                        if conv.messages[j].role == "assistant"]
                call = Conversation(conv.messages[:ends[0] if ends else None], conv.tools)
                try:
                    local = self._new_turns_text(prev, call, window=None)
                    windowed = self._text_after((prev[0], prev[-1]), call.messages[i + 1:],
                                                call.rendered_tools(), call.template_kwargs)
                except InvalidRequest:
                    return False
                if local != windowed:
                    return False
        return True


def _probe_conversations(tool: Tool) -> list[Conversation]:
    call = ToolCall(id="call_probe1", name="probe_tool", arguments='{"q": "a"}')
    call2 = ToolCall(id="call_probe2", name="probe_tool", arguments='{"q": "b"}')
    plain = (
        Message("user", "first question"),
        Message("assistant", "first answer"),
        Message("user", "second question"),
        Message("assistant", "second answer"),
        Message("user", "third question"),
    )
    tooly = (
        Message("system", "be brief"),
        Message("user", "look it up"),
        Message("assistant", "", tool_calls=(call, call2)),
        Message("tool", "result a", tool_call_id="call_probe1"),
        Message("tool", "result b", tool_call_id="call_probe2"),
        Message("assistant", "done"),
        Message("user", "thanks"),
    )
    thought = (
        Message("user", "think first"),
        Message("assistant", "thought through", reasoning="some reasoning"),
        Message("user", "and now?"),
    )
    return [Conversation(plain), Conversation(tooly, (tool,)), Conversation(plain, (tool,)),
            Conversation(thought)]


def _without_reasoning(messages: Sequence[Message]) -> tuple[Message, ...]:
    return tuple(
        Message(m.role, m.content, None, m.tool_calls, m.tool_call_id, m.name) for m in messages
    )


@functools.lru_cache(maxsize=16)
def _load(folder_str: str) -> Renderer:
    folder = Path(folder_str)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelError(f"{folder} has no tokenizer.json (the renderer reads only that format)")
    config = _read_json(folder / "tokenizer_config.json")
    templates = _read_templates(folder, config)
    if not templates:
        raise ModelError(f"{folder} has no chat template (chat_template.jinja or tokenizer_config)")
    special = {
        name: text for name in SPECIAL_TOKEN_NAMES
        if (text := _token_text(config.get(name))) is not None
    }
    return Renderer(Tokenizer.from_file(str(tokenizer_file)), templates, special,
                    _generation_eos_ids(folder))
