"""Incremental detokenization through the real tokenizers: deltas join to the full decode."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from relayrl.chat.detokenize import IncrementalDecoder
from relayrl.chat.renderer import Renderer

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
TEXTS = [
    "Plain ASCII, nothing special.",
    "Emoji: 👩‍👩‍👧 🇯🇵 🤖🧪🫠🙏🏽 done, and 𓂀ꙮ",
    "日本語のテキストと中文混合，还有한국어.",
    "Accents: naïve café Zürich, e\u0301 and ﬁ ligature",
    "<|im_start|>assistant\nspecial tokens 🎉<|im_end|>",
    "   leading spaces\n\n\ttabs and newlines\n",
]


def pieces(decoder: IncrementalDecoder, ids: list[int], step: int) -> list[str]:
    out = [decoder.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return [*out, decoder.flush()]


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("model", MODELS)
def test_deltas_join_to_the_full_decode_and_never_split_a_character(
    model: str, step: int, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(model)
    for text in TEXTS:
        ids = r.encode(text)
        out = pieces(IncrementalDecoder(r), ids, step)
        assert "".join(out) == r.decode(ids)
        assert not any("\ufffd" in p for p in out)


@pytest.mark.parametrize("model", MODELS)
def test_an_emoji_spread_over_tokens_waits_for_its_last_byte(
    model: str, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(model)
    ids = r.encode("🫠")  # a rare emoji: byte-level BPE splits it over several tokens
    assert len(ids) > 1
    assert all(s == "\ufffd" for s in r.token_strings(ids))
    decoder = IncrementalDecoder(r)
    assert [decoder.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🫠"]
    assert decoder.flush() == ""


@pytest.mark.parametrize("model", MODELS)
def test_a_character_cut_off_for_good_is_flushed_as_replacement(
    model: str, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(model)
    ids = r.encode("ok 🫠")[:-1]  # generation stopped mid-character
    decoder = IncrementalDecoder(r)
    text = "".join(decoder.push([i]) for i in ids)
    assert text + decoder.flush() == r.decode(ids)
    assert r.decode(ids).endswith("\ufffd") and not text.endswith("\ufffd")


def test_a_raw_tokenizer_works_and_special_tokens_can_be_skipped(
    model_path: Callable[[str], str],
) -> None:
    tok = Tokenizer.from_file(str(Path(model_path(MODELS[0])) / "tokenizer.json"))
    ids = tok.encode("<|im_start|>hé 🎉<|im_end|>", add_special_tokens=False).ids
    kept = pieces(IncrementalDecoder(tok), ids, 1)
    skipped = pieces(IncrementalDecoder(tok, skip_special_tokens=True), ids, 1)
    assert "".join(kept) == "<|im_start|>hé 🎉<|im_end|>"
    assert "".join(skipped) == tok.decode(ids, skip_special_tokens=True) == "hé 🎉"


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), data=st.data())
def test_any_text_and_any_push_sizes_join_to_the_full_decode(
    text: str, data: st.DataObject, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(MODELS[1])
    ids = r.encode(text)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(ids)), max_size=8))))
    decoder = IncrementalDecoder(r)
    bounds = [0, *cuts, len(ids)]
    out = "".join(decoder.push(ids[a:b]) for a, b in itertools.pairwise(bounds))
    assert out + decoder.flush() == r.decode(ids)
