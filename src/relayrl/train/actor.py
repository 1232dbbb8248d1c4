"""`Actor`: the policy being trained (a Hugging Face causal LM, fp32 master weights) and its
AdamW optimizer; it scores tokens (`compute_logprobs`) and takes optimizer steps (`update`).

Logprobs follow one convention everywhere: the logprob of token t comes from the logits at
position t - 1, at temperature 1 (the engine records its behaviour logprobs at temperature 1 too,
so the two are comparable). Only trained tokens are scored: the decoder runs over every token up
to a row's last trained one, but the output head runs only on the positions before trained
tokens, which in agent rows (long prompts and tool results, short replies) skips most of the
largest matrix product. The head runs in fp32 even under bf16 (`fp32_logits`), on the fp32
master weight: measured on SmolLM2, bf16 logits are off by 0.013 nats on average (max 0.10) from
fp32; an fp32 head halves that.

bf16 is on by default where the hardware has it (AMX / AVX512-BF16 on CPU). The forward and
backward then run on a bf16 copy of the weights: each micro-batch's bf16 gradients are added
into fp32 gradients of the master weights, AdamW steps the fp32 masters, and the copy is
refreshed from them after each step. (Autocast, which casts every fp32 weight at each use and
keeps the residual stream in fp32, was slower: benchmarks/RESULTS.md, "Training throughput".)

With `lora_rank` > 0 only peft LoRA adapters train (`relayrl.train.lora`); the engine, `save`
and checkpoints get them folded into plain weights.

Tradeoff: proximal logprobs default to the detached logprobs of the update's own forward pass
(same weights, same numerics: identical to recomputing them) when one optimizer step is taken
per batch; with several minibatches per batch the caller computes them once up front (the policy
that starts the batch) and passes `advance=False` to all but the last.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.utils.checkpoint

from relayrl.errors import ConfigError, ModelError
from relayrl.models import cache_kwarg, cpu_has_bf16_units
from relayrl.train import attention, fused, lora
from relayrl.train.checkpoint import (
    TrainingState,
    copy_tokenizer_files,
    load_optimizer_state,
    read_training_state,
    save_checkpoint,
)
from relayrl.train.config import TrainConfig
from relayrl.train.head import head_logprobs
from relayrl.train.losses import LossInputs, merge_stats, ppo_loss, token_weights
from relayrl.train.packing import MicroBatch, TrainBatch, micro_batches

_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of models whose logits are not just `lm_head(hidden)`: we refuse those."""


def resolve_bf16(setting: bool | str, device: torch.device) -> bool:
    """Whether to compute in bf16: the setting, or for "auto" whether the hardware has bf16."""
    if isinstance(setting, bool):
        return setting
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_bf16_units()
    return False


def load_policy(model_path: str, device: torch.device, attn_implementation: str = "sdpa") -> Any:
    """A causal LM in fp32 on `device`, in eval mode (no dropout), checked to be supported."""
    from transformers import AutoModelForCausalLM

    from relayrl.models import model_path as resolve_model

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(model_path), dtype=torch.float32,
        attn_implementation=attention.resolve(attn_implementation))
    for name in _LOGIT_POSTPROCESSING:
        value = getattr(model.config, name, None)
        if value not in (None, 1, 1.0):
            raise ModelError(f"{model.config.model_type}: {name}={value} post-processes logits, "
                             "which the actor's scoring does not reproduce")
    # Dropout would make the update's logprobs differ from the proximal ones for the same weights.
    # transformers wraps `to` with functools.wraps(nn.Module.to), which hides its parameters
    return model.to(device).eval()  # type: ignore[arg-type]


def bf16_copy(model: Any) -> Any:
    """A copy of `model` with bf16 parameters; buffers (rotary frequencies) stay as they are."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        # A tied weight is one parameter: converted once, so the copy stays tied. Buffers keep
        # fp32 because bf16 rotary frequencies would be off by up to a radian at position 500.
        for p in twin.parameters():
            p.data = p.data.to(torch.bfloat16)
    return twin


def freeze_lower_layers(model: Any, count: int) -> None:
    """Keep the input embeddings (with a head tied to them) and the first `count` decoder layers
    as loaded: nothing below the first trained layer needs a gradient, so the backward stops there.
    """
    layers = model.get_decoder().layers
    if count >= len(layers):
        raise ConfigError(f"freeze_layers={count} would freeze all {len(layers)} decoder layers")
    # The input embeddings' gradient would need the backward through every layer; a tied output
    # head is the same parameter, so it is frozen with them.
    model.get_input_embeddings().requires_grad_(False)
    for layer in layers[:count]:
        layer.requires_grad_(False)


def checkpoint_layer(layer: torch.nn.Module) -> None:
    """Make `layer` keep only its inputs for the backward and run again there to get the rest
    (gradient checkpointing); without grad it runs as before."""
    forward = layer.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        # A shared prefix's pass fills its cache: run again, it would add its keys twice. It
        # keeps its activations instead: one row of the prompt, a small part of a micro-batch.
        filling = any(isinstance(v, _prefix_cache_class()) and not v.sealed
                      for v in kwargs.values())
        if filling or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # non-reentrant: keyword arguments (the prefix's cache, unpadded pieces) pass through,
        # and the recomputation runs inside the backward on the thread that called it
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed


class _PrefixCache(Protocol):
    """What `_prefix_cache_class` makes, as the actor uses it (a transformers DynamicCache)."""

    sealed: bool

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times (the prefix's one row for every row of a batch)."""


@functools.cache
def _prefix_cache_class() -> type[_PrefixCache]:
    """transformers' DynamicCache, with `update` kept out of `torch.compile` (`train.compile`).

    Traced, its `update` makes the compiled layer's guards depend on the layer's index (how
    many layers the cache holds), so each of the model's layers compiled its own graph until
    dynamo's recompile limit (8) sent the rest back to eager: `train.compile` did nothing with
    shared prefixes. Run eagerly it costs one graph break per layer, and every layer shares the
    two graphs either side of it.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

    class PrefixCache(DynamicCache):
        sealed = False
        """Set once the prefix has run: the rows' keys and values are then returned after the
        prefix's but not kept, so a layer run again (gradient checkpointing recomputes each
        layer in the backward) sees the same past as the first time."""

        @torch.compiler.disable
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   *args: Any, **kwargs: Any) -> Any:
            if not self.sealed:
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            past = self.layers[layer_idx]
            if not isinstance(past, CacheLayerMixin) or past.keys is None or past.values is None:
                raise RuntimeError(f"the prefix cache holds no keys for layer {layer_idx}")
            return (torch.cat([past.keys, key_states], dim=-2),
                    torch.cat([past.values, value_states], dim=-2))

    return PrefixCache


class Actor:
    """Owns the policy model and optimizer; scores batches and updates the weights."""

    def __init__(self, model_path: str, config: TrainConfig, device: str = "cpu",
                 reference_path: str | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.model_path = model_path
        self.reference_path = reference_path or model_path
        """Where the frozen reference model for the KL term is loaded from (lazily)."""
        self.model = load_policy(model_path, self.device, config.attn_implementation)
        """The fp32 master weights: what the optimizer steps, checkpoints and the engine get."""
        if config.packing == "unpad" and self.model.config._attn_implementation != attention.GQA_SDPA:
            # another attention function would ignore where the pieces are: rows would attend
            # to each other
            raise ConfigError(f"packing=unpad needs relayrl's SDPA attention, not "
                              f"{self.model.config._attn_implementation!r}")
        self.lora_params = 0
        """Parameters of the LoRA adapters (`lora_rank` > 0), the only ones trained; 0: all are."""
        if config.lora_rank:
            self.lora_params = lora.add_adapters(self.model, config.lora_rank, config.lora_alpha,
                                                 config.lora_targets)
        if config.freeze_layers:
            freeze_lower_layers(self.model, config.freeze_layers)
        self.bf16 = resolve_bf16(config.bf16, self.device)
        self.bf16_copy = self.bf16
        """Forward and backward run on a bf16 copy of the weights (else on `model`)."""
        self.compute_model = self._compute_copy(self.model) if self.bf16_copy else self.model
        """What forward and backward run on: the bf16 copy, or `model` itself."""
        if config.compile:
            # Layer by layer: the layers share one compiled graph (their weights are its inputs),
            # compiled once (~55 s on 2 busy cores); dynamic shapes, as lengths vary per batch.
            for layer in self.compute_model.get_decoder().layers:
                layer.compile(dynamic=True)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            # One vectorized kernel per tensor instead of ~10 passes over the 135M fp32 values:
            # measured 4.5x faster on this CPU (1.0 vs 4.5 s for SmolLM2, loaded machine).
            fused=self.device.type in ("cpu", "cuda"),
        )
        self.threads_wanted: int | None = None
        """Torch threads the computing thread should use from the next decoder layer on (forward
        or backward); None leaves its count alone. Set from another thread: the trainer lends
        an idle engine's cores to an update this way (`relayrl.train.trainer`)."""
        if config.gradient_checkpointing:
            for layer in self.compute_model.get_decoder().layers:
                checkpoint_layer(layer)
        if not config.compile:  # hooks would break the compiled layers' graphs
            for layer in self.compute_model.get_decoder().layers:
                layer.register_forward_pre_hook(self._follow_threads)
                layer.register_forward_hook(self._follow_threads_in_backward)
        self.step = 0
        """Training steps taken (across resumes): one per rollout batch, however many optimizer
        steps its minibatches took."""
        self.version = 0
        """Weight version: bumped with `step`; what the engine is told it serves."""
        self._moved = False  # weights changed since `step` last advanced (minibatches)
        self._reference: Any = None
        self._reference_compute: Any = None

    def _follow_threads(self, *_: Any) -> None:
        wanted = self.threads_wanted
        # OpenMP's count is the calling thread's own: this is the update's thread (forward, and
        # backward, which torch runs on the thread that called it for CPU tensors)
        if wanted is not None and wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)

    def _follow_threads_in_backward(self, module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda _grad: self._follow_threads())

    @classmethod
    def resume(cls, checkpoint: str | Path, config: TrainConfig, device: str = "cpu",
               reference_path: str | None = None) -> Actor:
        """An actor restored from a checkpoint: weights, optimizer moments, step and version.

        With LoRA the checkpoint's adapter goes back onto the base model it names (the merged
        weights beside it would start a new adapter on rounded weights).
        """
        state = read_training_state(checkpoint)
        base = lora.adapter_base(checkpoint)
        if config.lora_rank and base is not None:
            actor = cls(base, config, device, reference_path)
            lora.load_adapter(actor.model, checkpoint)
            actor.weights_changed()
        elif config.lora_rank or base is not None:
            raise ConfigError(f"{checkpoint} was {'not ' if base is None else ''}trained with LoRA"
                              f" and this config has lora_rank={config.lora_rank}: resume it "
                              "with the config it was trained with")
        else:
            actor = cls(str(checkpoint), config, device, reference_path)
        try:
            load_optimizer_state(actor.optimizer, checkpoint)
        except ValueError as exc:  # torch's words for moments of other parameters
            raise ConfigError(f"{checkpoint}'s optimizer state is for other trained parameters "
                              f"than this config's (freeze_layers={config.freeze_layers}): resume "
                              f"it with the config it was trained with ({exc})") from None
        actor.step, actor.version = state.step, state.version
        return actor

    # -- scoring ------------------------------------------------------------------------------

    def _compute_copy(self, model: Any) -> Any:
        """`model`'s bf16 copy, its RMSNorms and MLPs in one pass each on CPU (`fused`)."""
        twin = bf16_copy(model)
        if self.device.type == "cpu" and not self.config.compile:
            # Dynamo would break its graphs at the kernels' calls.
            fused.fuse(twin)
        return twin

    def _runnable(self, model: Any) -> tuple[Any, Any]:
        """(module whose decoder runs, output head) that score for `model`."""
        if model is self.model:
            compute = self.compute_model
        elif model is self._reference:
            compute = self._reference_compute
        else:
            compute = model
        # The fp32 head is the master's own weight, so its gradient lands in fp32 directly.
        return compute, (model if self.config.fp32_logits else compute).get_output_embeddings()

    def token_logprobs(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """Logprobs `[N]` of the micro-batch's trained tokens under `model` (grad if enabled).

        `model` is the policy's `self.model` (run on its bf16 copy when there is one), the
        reference, or any causal LM (run as it is).
        """
        ids_M_L = mb.input_ids_M_L.to(self.device)
        m_N, l_N = mb.target_m_N.to(self.device), mb.target_l_N.to(self.device)
        compute, head = self._runnable(model)
        hidden_M_L_H = self._hidden(compute.get_decoder(), mb)
        hidden_N_H = hidden_M_L_H[m_N, l_N - 1]  # logits at t - 1 score token t
        if head.bias is not None:
            raise ModelError("an output head with a bias is not supported")
        weight_V_H = head.weight
        if self.bf16 and not self.config.fp32_logits:
            weight_V_H = weight_V_H.to(torch.bfloat16)
        # The fp32 head's bf16 twin (refreshed with the rest of the copy) spares the backward
        # a cast of the whole head.
        twin = compute.get_output_embeddings().weight
        low = twin if (twin is not weight_V_H and twin.dtype == hidden_N_H.dtype
                       and twin.dtype != weight_V_H.dtype) else None
        with torch.autocast(self.device.type, enabled=False):
            return head_logprobs(hidden_N_H, weight_V_H, ids_M_L[m_N, l_N], low)

    def _hidden(self, decoder: Any, mb: MicroBatch) -> torch.Tensor:
        """The decoder's last hidden states `[M, L, H]` of the micro-batch's rows."""
        ids_M_L = mb.input_ids_M_L.to(self.device)
        positions_M_L = mb.position_ids_M_L.to(self.device)
        # An unpadded micro-batch is one row of pieces; attention lays them out as rows.
        unpadded = {} if mb.piece_lengths is None else {attention.UNPADDED: attention.buckets(
            mb.piece_lengths, mb.prefix_len, self.device, mb.piece_stems)}
        if mb.prefix_ids_P is None:
            return decoder(input_ids=ids_M_L, position_ids=positions_M_L, use_cache=False,
                           **unpadded).last_hidden_state
        # The common prefix runs once, with grad; its keys and values (repeated per row when the
        # rows are padded) are the rows' past, so each row's gradient reaches the prefix's
        # weights through that one pass.
        cache = _prefix_cache_class()()
        prefix_1_P = mb.prefix_ids_P.to(self.device)[None]
        # Compiled layers pass their index to the cache: as a static int it would give each
        # layer its own graph again, so dynamo takes module ints as inputs here. Each compiled
        # code object then has up to 8 graphs, dynamo's default limit: the prefix's one row or
        # many rows, with grad or without, called as the layer or as its attention.
        unspec = contextlib.nullcontext() if not self.config.compile else \
            torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=max(
                32, torch._dynamo.config.recompile_limit))
        with unspec:
            decoder(input_ids=prefix_1_P, position_ids=torch.arange(mb.prefix_len,
                    device=self.device)[None], use_cache=True, **{cache_kwarg(decoder): cache})
            if not unpadded:  # unpadded pieces attend to the one prefix row as it is
                cache.batch_repeat_interleave(ids_M_L.shape[0])
            cache.sealed = True
            return decoder(input_ids=ids_M_L, position_ids=positions_M_L, use_cache=True,
                           **{cache_kwarg(decoder): cache}, **unpadded).last_hidden_state

    def micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """The batch split as this actor's config says (budget, packing, buckets, prefixes)."""
        cfg = self.config
        return micro_batches(batch, cfg.micro_batch_tokens, cfg.packing,
                             bucket=cfg.length_bucket, share_prefix=cfg.share_prefix)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: Any = None) -> torch.Tensor:
        """`[B, T]` logprobs of the trained tokens under `model` (default: the policy); 0 elsewhere.

        Used for proximal logprobs (before an update) and reference logprobs (KL term).
        """
        model = self.model if model is None else model
        out_B_T = torch.zeros(batch.loss_mask_B_T.shape, dtype=torch.float32)
        flat = out_B_T.view(-1)
        for mb in self.micro_batches(batch):
            flat[mb.source_N] = self.token_logprobs(model, mb).cpu()
        return out_B_T

    def proximal_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """`[B, T]` logprobs of the batch under the policy as it is, before the batch's
        minibatch steps (decoupled PPO's proximal policy); data-parallel ranks share the work."""
        return self.compute_logprobs(batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """`[B, T]` logprobs under the frozen reference model (loaded on first use).

        Under LoRA with the model as loaded for reference, that model is the policy with its
        adapters bypassed: no second copy is loaded.
        """
        if self.lora_params and self.reference_path == self.model_path:
            with lora.adapters_off(self.model, self.compute_model):
                return self.compute_logprobs(batch)
        if self._reference is None:
            self._reference = load_policy(self.reference_path, self.device,
                                          self.config.attn_implementation)
            self._reference.requires_grad_(False)
            # The same numerics as the policy's, so the KL starts at 0.
            self._reference_compute = (self._compute_copy(self._reference) if self.bf16_copy
                                       else self._reference)
        return self.compute_logprobs(batch, self._reference)

    # -- training -----------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based): linear warm-up, then constant."""
        warmup = self.config.warmup_steps
        return self.config.lr * (min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`, adding its gradients to the fp32 master weights' gradients."""
        loss.backward()
        if not self.bf16_copy:
            return
        # Accumulate in fp32 across micro-batches, as autocast's casts did; the bf16 gradients
        # are dropped so the next micro-batch starts from none.
        with torch.no_grad():
            for master, twin in zip(self.model.parameters(), self.compute_model.parameters(),
                                    strict=True):
                if twin.grad is None:
                    continue
                if master.grad is None:
                    master.grad = twin.grad.to(master.dtype)
                else:
                    master.grad.add_(twin.grad)
                twin.grad = None

    def weights_changed(self) -> None:
        """Refresh the bf16 copy from the master weights (after they changed outside a step)."""
        if not self.bf16_copy:
            return
        with torch.no_grad():
            for master, twin in zip(self.model.parameters(), self.compute_model.parameters(),
                                    strict=True):
                twin.copy_(master)

    def clip_gradients(self) -> float:
        """Scale the master gradients to a global norm of at most `grad_clip`; the norm before."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads)
        grad_norm = float(norm)
        # clip_grad_norm_ multiplies every gradient even by 1: a pass over 540 MB saved when
        # the norm is already within the bound (and when it is not finite: the step is skipped).
        if 0 < self.config.grad_clip < grad_norm < math.inf:
            torch.nn.utils.clip_grads_with_norm_(grads, self.config.grad_clip, norm)
        return grad_norm

    def apply_gradients(self, lr: float) -> None:
        """AdamW step at `lr` on the master gradients, then clear them and refresh the copy."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_changed()

    def update(
        self,
        batch: TrainBatch,
        adv_B_T: torch.Tensor,
        prox_logprobs_B_T: torch.Tensor | None = None,
        ref_logprobs_B_T: torch.Tensor | None = None,
        weights_B_T: torch.Tensor | None = None,
        replay: TrainBatch | None = None,
        replay_tokens: int | None = None,
        advance: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on the batch's trained tokens; returns metrics.

        Gradients of all micro-batches accumulate before the step; each micro-batch's loss is
        its exact share of the batch loss (per-token weights computed over the whole batch).
        `prox_logprobs_B_T=None` uses this step's own detached logprobs (exact for the first
        step on a batch). A batch with no trained token takes no step (`n_tokens` = 0).
        `weights_B_T` (default: `token_weights` of this batch) are the tokens' shares of the loss:
        a data-parallel rank passes its rows' shares of the global batch's loss.
        `replay` (warm-up traces) adds `sft_replay_coef` times their mean token NLL to the same
        step (PPO-ptx), its rows scored in the RL rows' micro-batches (one pass of a common
        prefix); it is skipped with the step when the RL batch has no trained token.
        `replay_tokens` (default: `replay`'s own) is what the mean divides by: a data-parallel
        rank passes the trained tokens of the whole replay, of which it holds a part.
        `advance=False` (every minibatch of a rollout batch but its last) steps the weights but
        leaves `step` and `version` to the batch's last minibatch.
        """
        cfg = self.config
        started = time.perf_counter()
        if cfg.kl_coef > 0 and ref_logprobs_B_T is None:
            ref_logprobs_B_T = self.reference_logprobs(batch)
        if weights_B_T is None:
            weights_B_T = token_weights(batch.loss_mask_B_T, cfg.loss_agg)
        self.optimizer.zero_grad(set_to_none=True)
        self.compute_model.zero_grad(set_to_none=True)
        # The replay's rows run in the RL rows' micro-batches: both start with the agent's
        # system prompt, so its prefix pass (and each pass's fixed costs) are paid once.
        joint = replay if (replay is not None and cfg.sft_replay_coef > 0
                           and batch.num_trained_tokens > 0) else None
        scored = batch if joint is None else batch.extended(joint)
        t_scored, t_batch = scored.input_ids_B_T.shape[1], batch.input_ids_B_T.shape[1]
        if joint is None:
            replay_tokens = 1
        elif replay_tokens is None:
            replay_tokens = max(joint.num_trained_tokens, 1)
        parts, padded_tokens, replay_nll = [], 0, 0.0
        for mb in self.micro_batches(scored):
            logprobs_N = self.token_logprobs(self.model, mb)
            rl_logprobs, source_N, replay_logprobs = logprobs_N, mb.source_N, None
            if joint is not None:
                row_N, col_N = mb.source_N // t_scored, mb.source_N % t_scored
                rl_N = row_N < batch.num_rows
                rl_logprobs, replay_logprobs = logprobs_N[rl_N], logprobs_N[~rl_N]
                source_N = row_N[rl_N] * t_batch + col_N[rl_N]
            out = ppo_loss(rl_logprobs, self._loss_inputs(batch, source_N, rl_logprobs, adv_B_T,
                                                          weights_B_T, prox_logprobs_B_T,
                                                          ref_logprobs_B_T), cfg)
            loss = out.loss
            if replay_logprobs is not None:
                nll = -replay_logprobs.sum() / replay_tokens
                loss = loss + cfg.sft_replay_coef * nll
                replay_nll += float(nll.detach())
            self.backward(loss)
            parts.append(out.stats)
            padded_tokens += mb.num_tokens
        metrics = merge_stats(parts)
        if metrics["n_tokens"]:
            lag_N = (self.version - batch.versions_B_T)[batch.loss_mask_B_T].float()
            metrics.update(staleness_mean=float(lag_N.mean()), staleness_max=float(lag_N.max()))
        if joint is not None:  # a sum: each rank's part of the replay's mean
            metrics["sft_replay_loss"] = replay_nll
        metrics = self._across_ranks(metrics)
        if metrics["n_tokens"] == 0:
            return metrics
        metrics.update(self._optimizer_step(advance))
        elapsed = time.perf_counter() - started
        metrics.update(update_s=elapsed, forward_tokens=float(padded_tokens),
                       tokens_per_s=padded_tokens / max(elapsed, 1e-9))
        return metrics

    def nll_backward(self, batch: TrainBatch, coef: float = 1.0) -> float:
        """Accumulate gradients of `coef` x the mean NLL of `batch`'s trained tokens; returns the NLL."""
        n_tokens = max(batch.num_trained_tokens, 1)
        total = 0.0
        for mb in self.micro_batches(batch):
            nll = -self.token_logprobs(self.model, mb).sum() / n_tokens
            self.backward(coef * nll)
            total += nll.item()
        return total

    def _loss_inputs(
        self,
        batch: TrainBatch,
        source_N: torch.Tensor,
        logprobs_N: torch.Tensor,
        adv_B_T: torch.Tensor,
        weights_B_T: torch.Tensor,
        prox_B_T: torch.Tensor | None,
        ref_B_T: torch.Tensor | None,
    ) -> LossInputs:
        """The loss's per-token inputs at `source_N`, flat indices into `batch`'s `[B, T]`."""
        dev = self.device

        def take(values_B_T: torch.Tensor) -> torch.Tensor:
            return values_B_T.reshape(-1)[source_N].to(dev)

        return LossInputs(
            prox_logprobs=logprobs_N.detach() if prox_B_T is None else take(prox_B_T),
            behav_logprobs=take(batch.behav_logprobs_B_T),
            advantages=take(adv_B_T).float(),
            mask=torch.ones_like(logprobs_N, dtype=torch.bool),
            weights=take(weights_B_T),
            ref_logprobs=None if ref_B_T is None else take(ref_B_T),
        )

    def _across_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """This update's stats over every data-parallel rank (one process: as they are)."""
        return metrics

    def _sync_gradients(self) -> None:
        """Make every rank's gradients the global batch's (one process: nothing to do)."""

    def _optimizer_step(self, advance: bool = True) -> dict[str, float]:
        self._sync_gradients()
        grad_norm = self.clip_gradients()
        lr = self.lr_at(self.step)
        out = {"grad_norm": grad_norm, "lr": lr}
        if math.isfinite(grad_norm):
            self.apply_gradients(lr)
            self._moved = True
        else:
            # One bad batch must not poison the weights: skip it, keep step and version.
            self.optimizer.zero_grad(set_to_none=True)
            out["skipped_nonfinite"] = 1.0
        if advance and self._moved:  # new weights (from this minibatch or an earlier one)
            self.step += 1
            self.version += 1
            self._moved = False
            out["step"] = float(self.step)
        return out

    # -- weights out --------------------------------------------------------------------------

    def state_dict_for_engine(self, copy: bool = False) -> dict[str, torch.Tensor]:
        """The policy's weights for `LocalEngine.update_weights`.

        Shared, not copied, by default (free): the engine copies them into its own model, so
        await its `update_weights` before the next `update`. `copy=True` clones them.
        """
        # under LoRA the adapters are folded in: new tensors there, the model's own elsewhere
        state = lora.merged_state_dict(self.model) if self.lora_params else self.model.state_dict()
        return {k: (v.detach().clone() if copy else v.detach()) for k, v in state.items()}

    def save(self, directory: str | Path) -> Path:
        """Write the policy as a Hugging Face directory (weights, config, tokenizer files)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, **self._plain_weights())
        self._copy_tokenizer(directory)
        return directory

    def _plain_weights(self) -> dict[str, Any]:
        """`save_pretrained` arguments that write a plain model (adapters merged) under LoRA."""
        return {"state_dict": lora.merged_state_dict(self.model)} if self.lora_params else {}

    def save_checkpoint(self, root: str | Path) -> Path:
        """Write `root/step_N` (weights, tokenizer, step/version, optimizer); keep the newest K."""
        path = save_checkpoint(
            self.model,
            root,
            TrainingState(step=self.step, version=self.version),
            optimizer=self.optimizer if self.config.save_optimizer else None,
            tokenizer_source=self.model_dir(),
            keep=self.config.keep_checkpoints,
            save_kwargs=self._plain_weights(),
            extra=self._save_adapter if self.lora_params else None,
        )
        return path

    def _save_adapter(self, directory: Path) -> None:
        cfg = self.config
        lora.save_adapter(self.model, directory, cfg.lora_rank, cfg.lora_alpha, base=self.model_path)

    def model_dir(self) -> str:
        """The local directory (or hub id) the policy was loaded from."""
        from relayrl.models import model_path as resolve_model

        return resolve_model(self.model_path)

    def _copy_tokenizer(self, directory: Path) -> None:
        source = self.model_dir()
        if not copy_tokenizer_files(source, directory):
            # A hub id: let transformers fetch and write the tokenizer the ordinary way.
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(source).save_pretrained(directory)
