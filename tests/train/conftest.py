"""Tiny randomly initialized models (fast stand-ins for the real one) and batch builders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from relayrl.train.checkpoint import copy_tokenizer_files
from relayrl.train.packing import TrainBatch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256,
            # Large init so attention matters: a leak across rows must show in the logprobs.
            initializer_range=0.3)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> str:
    """A 2-layer Llama with the default model's vocabulary and tokenizer files."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **TINY)).save_pretrained(path)
    copy_tokenizer_files(model_dir, path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> str:
    """A 2-layer Qwen2 (untied head, attention bias) with a small vocabulary."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=512, tie_word_embeddings=False, **TINY)).save_pretrained(path)
    copy_tokenizer_files(model_dir, path)
    return str(path)


def random_batch(lengths: list[int], vocab: int, seed: int = 0, prompt: int = 2) -> TrainBatch:
    """Right-padded rows of random tokens; tokens after the first `prompt` ones are trained,
    except a few at random (agent rows interleave sampled and tool tokens)."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.zeros(b, t, dtype=torch.long)
    attention = torch.zeros(b, t, dtype=torch.bool)
    loss = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        attention[i, :n] = True
        loss[i, prompt:n] = torch.rand(n - prompt, generator=g) > 0.25
    return TrainBatch(
        input_ids_B_T=ids,
        attention_mask_B_T=attention,
        loss_mask_B_T=loss,
        behav_logprobs_B_T=torch.zeros(b, t),
        versions_B_T=torch.zeros(b, t, dtype=torch.long),
        rewards_B=torch.arange(b, dtype=torch.float32),
        episode_ids=tuple(f"e{i}" for i in range(b)),
        group_ids=("g",) * b,
    )


def reference_logprobs(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """One row at a time, plain forward: logits at t - 1 score token t (0 off the loss mask)."""
    out = torch.zeros(batch.loss_mask_B_T.shape)
    with torch.no_grad():
        for b, n in enumerate(batch.lengths_B.tolist()):
            ids = batch.input_ids_B_T[b, :n]
            logp = model(ids[None], use_cache=False).logits[0].float().log_softmax(-1)
            out[b, 1:n] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
    return out * batch.loss_mask_B_T


def tokenizer_files(path: str | Path) -> set[str]:
    """Tokenizer file names present in a model directory."""
    return {p.name for p in Path(path).iterdir() if p.name.startswith(("tokenizer", "chat_template"))}
