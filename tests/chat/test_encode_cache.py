"""The Renderer's piece-cached encode against the tokenizer's own encode, id for id."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from relayrl.chat.renderer import PieceEncoder, Renderer

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")

_WHITESPACE = (" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "\u3000", "\u00a0")
_UNICODE = ("é", "e\u0301", "日本語", "🙂", "👩‍💻", "ﬁ", "Ω", "\u200b", "ß", "İ")


def _tokenizer(model_path: Callable[[str], str], name: str) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_path(name)) / "tokenizer.json"))


def _texts(tokenizer: Tokenizer) -> st.SearchStrategy[str]:
    """Texts mixing every added token, pieces of them, whitespace, unicode and random text."""
    added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    fragments = [t[: len(t) // 2] for t in added] + [t[1:] for t in added]
    piece = st.one_of(
        st.sampled_from(added),
        st.sampled_from(fragments),
        st.sampled_from(_WHITESPACE),
        st.sampled_from(_UNICODE),
        st.text(max_size=12),
        st.text(alphabet="ab <|>_\n", max_size=8),
    )
    return st.lists(piece, max_size=14).map("".join)


@pytest.mark.parametrize("name", MODELS)
def test_both_packaged_tokenizers_get_the_piece_encoder(
    name: str, model_path: Callable[[str], str], renderer_for: Callable[[str], Renderer]
) -> None:
    # otherwise the property below would compare the plain encode with itself
    assert PieceEncoder.for_tokenizer(_tokenizer(model_path, name)) is not None
    assert renderer_for(name)._pieces is not None


@pytest.mark.parametrize("name", MODELS)
def test_piece_encode_equals_tokenizer_encode_for_mixed_texts(
    name: str, model_path: Callable[[str], str], renderer_for: Callable[[str], Renderer]
) -> None:
    tokenizer = _tokenizer(model_path, name)
    encoder = PieceEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    renderer = renderer_for(name)

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_texts(tokenizer))
    def check(text: str) -> None:
        expected = tokenizer.encode(text, add_special_tokens=False).ids
        assert encoder.encode(text) == expected
        assert encoder.encode(text) == expected  # again, now from the cache
        assert renderer.encode(text) == expected

    check()


@pytest.mark.parametrize("name", MODELS)
def test_piece_encode_equals_tokenizer_encode_on_a_rendered_chat(
    name: str, model_path: Callable[[str], str], renderer_for: Callable[[str], Renderer]
) -> None:
    from relayrl.chat.conversation import Conversation, Message

    renderer = renderer_for(name)
    tokenizer = _tokenizer(model_path, name)
    turns = [Message("system", "Be brief.")]
    for k in range(20):
        turns += [Message("user", f"Question {k}: é? 🙂 <|im_end|> inside"),
                  Message("assistant", f" answer {k}\n\n  with  spaces ")]
    text = renderer.render_text(Conversation((*turns, Message("user", "last"))))
    assert renderer.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids


def _with_added(model_path: Callable[[str], str], token: AddedToken) -> Tokenizer:
    tokenizer = _tokenizer(model_path, MODELS[0])
    tokenizer.add_special_tokens([token])
    return tokenizer


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word", "normalized"])
def test_an_added_token_with_a_matching_rule_turns_the_piece_encoder_off(
    flag: str, model_path: Callable[[str], str]
) -> None:
    tokenizer = _with_added(model_path, AddedToken("<probe>", special=True, **{flag: True}))
    assert PieceEncoder.for_tokenizer(tokenizer) is None


def test_a_truncating_tokenizer_turns_the_piece_encoder_off(
    model_path: Callable[[str], str],
) -> None:
    tokenizer = _tokenizer(model_path, MODELS[0])
    tokenizer.enable_truncation(8)
    assert PieceEncoder.for_tokenizer(tokenizer) is None


def test_a_metaspace_first_piece_tokenizer_turns_the_piece_encoder_off(tmp_path: Path) -> None:
    from tokenizers import models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "▁a": 1, "a": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.add_special_tokens(["<s>"])
    assert PieceEncoder.for_tokenizer(tokenizer) is None
    # and the probe alone would have caught it: a piece after a token is not a text's first
    encoder = PieceEncoder(tokenizer)
    assert encoder.encode("a<s>a") != tokenizer.encode("a<s>a", add_special_tokens=False).ids


def test_the_piece_cache_stays_within_its_character_budget(
    model_path: Callable[[str], str],
) -> None:
    tokenizer = _tokenizer(model_path, MODELS[0])
    encoder = PieceEncoder(tokenizer, max_chars=500)
    for k in range(200):
        text = f"<|im_start|>user\nmessage number {k} " + json.dumps({"k": k}) + "<|im_end|>\n"
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        assert encoder.cached_chars <= 500
    assert encoder.cached_chars > 0
