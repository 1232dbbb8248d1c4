"""LoRA (`train.lora_rank`): only the adapters move, what leaves the actor is a plain model with
the adapters folded in (the engine's weights, checkpoints), and a run resumes onto its base."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.errors import ConfigError
from relayrl.train import lora
from relayrl.train.actor import Actor
from relayrl.train.checkpoint import latest_checkpoint
from relayrl.train.config import TrainConfig

from .test_actor import signed_batch

LORA = dict(lora_rank=4, lora_alpha=8.0, lr=1e-2, bf16=False)


def logprobs_of(model: torch.nn.Module, actor: Actor, batch: object) -> torch.Tensor:
    return actor.compute_logprobs(batch, model)  # type: ignore[arg-type]


def test_only_the_adapters_train_and_the_engine_gets_them_folded_in(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(**LORA))
    plain = Actor(tiny_llama_dir, TrainConfig(bf16=False))
    # 2 layers x 7 linear modules x rank 4 x (in + out)
    assert actor.lora_params == 2 * 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"]) == \
        actor.lora_params
    before = actor.state_dict_for_engine(copy=True)
    assert before.keys() == plain.model.state_dict().keys()
    for key, value in plain.model.state_dict().items():  # B starts at 0: the model as loaded
        assert torch.equal(before[key], value), key
    batch, adv = signed_batch(actor)
    metrics = actor.update(batch, adv)
    assert metrics["grad_norm"] > 0 and actor.version == 1
    after = actor.state_dict_for_engine()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and all(k.endswith("_proj.weight") for k in moved)
    assert "model.embed_tokens.weight" not in moved and "model.norm.weight" not in moved
    # the folded weights are the function the actor trains: a plain model loaded with them
    # scores the batch as the actor (with its adapters) does
    as_loaded = plain.compute_logprobs(batch)
    plain.model.load_state_dict(after)
    ours = actor.compute_logprobs(batch)
    assert (ours - as_loaded).abs().max() > 1e-3  # the step changed what the model says
    torch.testing.assert_close(plain.compute_logprobs(batch), ours, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_is_a_plain_model_and_the_run_resumes_on_its_adapter(
        tiny_llama_dir: str, tmp_path: object) -> None:
    cfg = TrainConfig(**LORA)
    actor = Actor(tiny_llama_dir, cfg)
    batch, adv = signed_batch(actor)
    actor.update(batch, adv)
    path = actor.save_checkpoint(tmp_path)  # type: ignore[arg-type]
    assert latest_checkpoint(tmp_path) == path  # type: ignore[arg-type]
    # the weights load as an ordinary model, which scores as the actor does
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.testing.assert_close(logprobs_of(loaded, actor, batch), actor.compute_logprobs(batch),
                               rtol=1e-5, atol=1e-5)
    adapter = json.loads((path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["base_model_name_or_path"] == tiny_llama_dir
    assert sorted(adapter["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # resumed: same adapters on the same base, same moments: the next step matches
    resumed = Actor.resume(path, cfg)
    assert (resumed.step, resumed.version) == (1, 1)
    assert resumed.model_path == tiny_llama_dir
    batch2, adv2 = signed_batch(actor, seed=3)
    a, b = actor.update(batch2, adv2), resumed.update(batch2, adv2)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    theirs = resumed.state_dict_for_engine()
    for key, value in actor.state_dict_for_engine().items():
        torch.testing.assert_close(theirs[key], value, rtol=0, atol=1e-6)


def test_resuming_with_the_other_kind_of_config_is_refused(tiny_llama_dir: str,
                                                           tmp_path: object) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(**LORA))
    lora_ckpt = actor.save_checkpoint(tmp_path / "a")  # type: ignore[operator]
    with pytest.raises(ConfigError, match="trained with LoRA"):
        Actor.resume(lora_ckpt, TrainConfig(bf16=False))
    full = Actor(tiny_llama_dir, TrainConfig(bf16=False)).save_checkpoint(tmp_path / "b")  # type: ignore[operator]
    with pytest.raises(ConfigError, match="not trained with LoRA"):
        Actor.resume(full, TrainConfig(**LORA))


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft, then our error
def test_lora_settings_are_checked(tiny_llama_dir: str) -> None:
    with pytest.raises(ConfigError, match="lora_rank"):
        TrainConfig(lora_rank=-1)
    with pytest.raises(ConfigError, match="compile"):
        TrainConfig(lora_rank=8, compile=True)
    with pytest.raises(ConfigError, match="no_such_proj"):
        Actor(tiny_llama_dir, TrainConfig(lora_rank=2, lora_targets=("no_such_proj",), bf16=False))
    # the output head (scored by its weight directly) and the embedding tied to it
    for target in ("lm_head", "embed_tokens"):
        with pytest.raises(ConfigError, match=f"linear layers only, not on .*{target}"):
            Actor(tiny_llama_dir, TrainConfig(lora_rank=2, lora_targets=("q_proj", target),
                                              bf16=False))


def test_adapters_start_alike_in_every_process(tiny_llama_dir: str) -> None:
    a = Actor(tiny_llama_dir, TrainConfig(**LORA))
    torch.manual_seed(1234)  # the caller's RNG state must not matter, nor be consumed
    state = torch.random.get_rng_state()
    b = Actor(tiny_llama_dir, TrainConfig(**LORA))
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, x), (_, y) in zip(lora.adapter_state_dict(a.model).items(),
                                 lora.adapter_state_dict(b.model).items(), strict=True):
        assert torch.equal(x, y), name


def test_under_a_bf16_copy_the_fp32_adapters_step_and_the_copy_follows(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(**{**LORA, "bf16": True}))
    assert actor.bf16_copy and actor.compute_model is not actor.model
    batch, adv = signed_batch(actor)
    before = {k: v.clone() for k, v in lora.adapter_state_dict(actor.model).items()}
    metrics = actor.update(batch, adv)
    assert metrics["grad_norm"] > 0
    after = lora.adapter_state_dict(actor.model)
    assert all(v.dtype == torch.float32 for v in after.values())  # the masters stay fp32
    assert any(not torch.equal(after[k], before[k]) for k in after)
    # the bf16 copy was refreshed from the stepped masters, and kept no gradient of its own
    twin = lora.adapter_state_dict(actor.compute_model)
    for key, value in after.items():
        assert twin[key].dtype == torch.bfloat16
        torch.testing.assert_close(twin[key].float(), value, rtol=1e-2, atol=1e-3)
    assert all(p.grad is None for p in actor.compute_model.parameters())


def test_the_kl_reference_is_the_base_model_without_a_second_copy(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(**LORA, kl_coef=0.1))
    plain = Actor(tiny_llama_dir, TrainConfig(bf16=False))
    batch, adv = signed_batch(actor)
    first = actor.update(batch, adv)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-7)  # B starts at 0: the policy is the base
    second = actor.update(batch, adv)
    assert second["ref_kl"] > 1e-6  # the adapters moved the policy away from it
    torch.testing.assert_close(actor.reference_logprobs(batch), plain.compute_logprobs(batch),
                               rtol=1e-5, atol=1e-5)
    assert actor._reference is None  # nothing loaded beside the policy
    # the adapters are back on, and trainable, after each reference scoring
    assert (actor.compute_logprobs(batch) - plain.compute_logprobs(batch)).abs().max() > 1e-4
    assert all(p.requires_grad for n, p in actor.model.named_parameters() if ".lora_" in n)


def test_a_checkpoints_adapter_loads_with_peft_onto_its_base(tiny_llama_dir: str,
                                                            tmp_path: object) -> None:
    from peft import PeftModel

    actor = Actor(tiny_llama_dir, TrainConfig(**LORA))
    batch, adv = signed_batch(actor)
    for _ in range(2):  # B moves off 0 at the first step, A at the second
        actor.update(batch, adv)
    path = actor.save_checkpoint(tmp_path)  # type: ignore[arg-type]
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = batch.input_ids_B_T[:1, :12]
    with torch.no_grad():
        theirs, ours = with_adapter(ids).logits, merged(ids).logits
        plain = with_adapter.get_base_model()
        with with_adapter.disable_adapter():
            untouched = plain(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (theirs - untouched).abs().max() > 1e-3  # the adapter is not a no-op


def test_an_untied_head_and_attention_biases_fold_in_under_their_own_names(
        tiny_qwen2_dir: str) -> None:
    actor = Actor(tiny_qwen2_dir, TrainConfig(**LORA))
    assert not actor.model.get_output_embeddings().weight.requires_grad  # the head stays frozen
    batch, adv = signed_batch(actor)
    actor.update(batch, adv)
    actor.update(batch, adv)
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    plain.load_state_dict(actor.state_dict_for_engine(), strict=True)  # every key, no extra
    torch.testing.assert_close(actor.compute_logprobs(batch, plain), actor.compute_logprobs(batch),
                               rtol=1e-5, atol=1e-5)
