"""The one-pass RMSNorm, SwiGLU and rotary embedding (`relayrl.train.fused`) against the modules
and function they replace.

Tolerances. The kernels round where the modules' bf16 ops round, so forward outputs equal the
modules' own but where an exp or a sum lands a hair apart and a rounding goes the other way: at
most one bf16 step (2^-7 relative) and on under 1% of the elements (measured: bit-equal on
1M-2.6M random elements of the main job's shapes).
Gradients are compared in relative L2 against float64 modules, and must be at least as close as
the bf16 modules' own autograd (the weight's gradient closer: its sums stay fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from relayrl.kernels import TrainKernels, train_kernels
from relayrl.train import fused
from relayrl.train.actor import Actor
from relayrl.train.checkpoint import copy_tokenizer_files
from relayrl.train.config import TrainConfig

from .conftest import TINY, random_batch


@pytest.fixture
def kernels() -> TrainKernels:
    built = train_kernels()
    if built is None:
        pytest.skip("no C compiler, OpenMP or AVX512-BF16 here: the modules keep their own ops")
    return built


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of `a` from `b`, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_rounds_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare one-step roundings the other way."""
    differ = got != want
    assert differ.float().mean() < 0.01
    step = want.float().abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool(((got.float() - want.float()).abs() <= step * 1.01).all())


def three_ways(module: torch.nn.Module, twin: torch.nn.Module, x64: torch.Tensor,
               weight_grads: Callable[[torch.nn.Module], tuple[torch.Tensor, ...]],
               ) -> dict[str, tuple[torch.Tensor, ...]]:
    """(output, input gradient, *weight_grads) of `module` in float64 and bf16 and of its fused
    `twin` in bf16, on `x64` and one random output gradient; the modules end in bf16."""
    g64 = torch.randn(x64.shape, dtype=torch.float64)
    outs = {}
    for name, mod, dtype in (("f64", module, torch.float64), ("bf16", module, torch.bfloat16),
                             ("fused", twin, torch.bfloat16)):
        mod = mod.to(dtype)
        x = x64.detach().to(dtype).requires_grad_()
        y = mod(x)
        y.backward(g64.to(dtype))
        outs[name] = (y.detach(), x.grad, *weight_grads(mod))
        mod.zero_grad(set_to_none=True)
    return outs


def norm_pair(cls: type, hidden: int, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    module = cls(hidden, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.5 * torch.randn(hidden))
    twin = cls(hidden, eps=1e-5)
    twin.load_state_dict(module.state_dict())
    fused.fuse(twin)
    return module, twin


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize("shape", [(37, 576), (2, 9, 64), (1, 16)])
def test_rms_norm_matches_the_module_forward_and_backward(
        kernels: TrainKernels, cls: type, shape: tuple[int, ...]) -> None:
    module, twin = norm_pair(cls, shape[-1], seed=len(shape))
    assert fused.fuse(torch.nn.Sequential(cls(shape[-1]))) == 1
    outs = three_ways(module, twin, 3.0 * torch.randn(*shape, dtype=torch.float64),
                      lambda mod: (mod.weight.grad,))
    assert_rounds_alike(outs["fused"][0], outs["bf16"][0])
    _, dx64, dw64 = outs["f64"]
    assert rel(outs["fused"][1], dx64) <= 1.1 * rel(outs["bf16"][1], dx64) + 1e-3
    assert rel(outs["fused"][2], dw64) <= 1.1 * rel(outs["bf16"][2], dw64) + 1e-3
    assert rel(outs["fused"][1], dx64) < 1e-2


def mlp_pair(cls: type, config_cls: type, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    config = config_cls(hidden_size=64, intermediate_size=176, hidden_act="silu")
    module = cls(config)
    twin = cls(config)
    twin.load_state_dict(module.state_dict())
    assert fused.fuse(twin) == 1
    return module, twin


@pytest.mark.parametrize(("cls", "config_cls"), [(LlamaMLP, LlamaConfig), (Qwen2MLP, Qwen2Config)])
def test_swiglu_matches_the_module_forward_and_backward(
        kernels: TrainKernels, cls: type, config_cls: type) -> None:
    module, twin = mlp_pair(cls, config_cls, seed=3)
    # 5 x 7 rows of 176: elements past the last whole 16 take the kernels' masked tails
    grads = three_ways(module, twin, 2.0 * torch.randn(5, 7, 64, dtype=torch.float64),
                       lambda mod: (mod.gate_proj.weight.grad, mod.up_proj.weight.grad))
    want = grads["f64"]
    for i in range(4):
        # the products around the kernel round too: held to the bf16 module's own distance
        assert rel(grads["fused"][i], want[i]) <= 1.2 * rel(grads["bf16"][i], want[i]) + 1e-3
        assert rel(grads["fused"][i], grads["bf16"][i]) < 2e-2


def test_the_swiglu_kernel_rounds_as_torchs_two_ops(kernels: TrainKernels) -> None:
    torch.manual_seed(5)
    gate = (4.0 * torch.randn(3001)).to(torch.bfloat16)  # an odd count: a masked tail
    up = torch.randn(3001).to(torch.bfloat16)
    assert_rounds_alike(kernels.swiglu(gate, up), torch.nn.functional.silu(gate) * up)
    # large magnitudes: silu's exp must not overflow either way
    big = torch.tensor([-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0], dtype=torch.bfloat16)
    out = kernels.swiglu(big, torch.ones_like(big))
    assert torch.equal(out, torch.nn.functional.silu(big))
    d_gate, d_up = kernels.swiglu_grad(torch.ones_like(big), big, torch.ones_like(big))
    assert bool(torch.isfinite(d_gate).all()) and torch.equal(d_up, out)


HF_ROTARY = getattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__",
                    modeling_llama.apply_rotary_pos_emb)
"""transformers' own function (an actor made earlier in the session has wrapped it)."""


def rotary_case(batch: int, length: int, dim: int, token_major: bool, rows_of_positions: int,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """q `[batch, 6, length, dim]` and k (2 heads) with grad, laid out token by token as
    projections' outputs are or head by head; Llama's cos and sin for `rows_of_positions` rows."""
    def heads(count: int) -> torch.Tensor:
        shape = (batch, length, count, dim) if token_major else (batch, count, length, dim)
        x = torch.randn(shape).to(dtype)
        return (x.transpose(1, 2) if token_major else x).requires_grad_()

    positions = torch.arange(length)[None] + 7 * torch.arange(rows_of_positions)[:, None]
    freqs = positions[..., None].float() / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.cat([freqs, freqs], -1)
    return heads(6), heads(2), angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_outputs(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                   k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   **kwargs: object) -> tuple[torch.Tensor, ...]:
    """`fn`'s rotated q and k, and the gradients of q and k from fixed random ones."""
    q.grad = k.grad = None
    q_out, k_out = fn(q, k, cos, sin, **kwargs)
    g = torch.Generator().manual_seed(9)
    loss = sum((out.float() * torch.randn(out.shape, generator=g)).sum() for out in (q_out, k_out))
    loss.backward()
    return q_out.detach(), k_out.detach(), q.grad, k.grad


@pytest.mark.parametrize("token_major", [True, False], ids=["token-major", "head-major"])
@pytest.mark.parametrize(("batch", "rows_of_positions", "dim"),
                         [(1, 1, 64), (3, 3, 64), (2, 1, 32)])
def test_rotary_equals_transformers_bit_for_bit_forward_and_backward(
        kernels: TrainKernels, token_major: bool, batch: int, rows_of_positions: int,
        dim: int) -> None:
    torch.manual_seed(6)
    q, k, cos, sin = rotary_case(batch, 37, dim, token_major, rows_of_positions)
    want = rotary_outputs(HF_ROTARY, q, k, cos, sin)
    got = rotary_outputs(fused.rotary(HF_ROTARY), q, k, cos, sin)
    for mine, theirs in zip(got, want, strict=True):
        assert torch.equal(mine, theirs)
        assert mine.stride() == theirs.stride()  # laid out alike: no copy downstream
    assert type(fused.rotary(HF_ROTARY)(q, k, cos, sin)[0].grad_fn).__name__ == "_RotaryBackward"


def test_rotary_hands_what_the_kernel_does_not_take_to_transformers(
        kernels: TrainKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapped = fused.rotary(HF_ROTARY)
    assert fused.rotary(wrapped) is wrapped  # wrapped once, however many actors fuse
    cases = {"fp32": (rotary_case(1, 9, 64, True, 1, torch.float32), {}),
             "head_dim 16": (rotary_case(1, 9, 16, True, 1), {}),
             "unsqueeze_dim 2": (rotary_case(1, 9, 64, False, 1), {"unsqueeze_dim": 2})}
    for tensors, kwargs in cases.values():
        if "unsqueeze_dim" in kwargs:  # q, k as [batch, length, heads, dim]
            tensors = tuple(t.detach().transpose(1, 2).contiguous().requires_grad_()
                            if t.dim() == 4 else t for t in tensors)
        got, want = (rotary_outputs(fn, *tensors, **kwargs) for fn in (wrapped, HF_ROTARY))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert type(wrapped(*tensors, **kwargs)[0].grad_fn).__name__ != "_RotaryBackward"
    q, k, cos, sin = rotary_case(1, 9, 64, True, 1)
    monkeypatch.setattr(fused, "train_kernels", lambda: None)
    assert type(wrapped(q, k, cos, sin)[0].grad_fn).__name__ != "_RotaryBackward"


def test_anything_the_kernels_do_not_take_runs_the_modules_own_forward(
        kernels: TrainKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    module, twin = norm_pair(LlamaRMSNorm, 24, seed=0)  # 24: not a multiple of 16
    x = torch.randn(4, 24).to(torch.bfloat16)
    assert torch.equal(twin.to(torch.bfloat16)(x), module.to(torch.bfloat16)(x))
    module, twin = norm_pair(LlamaRMSNorm, 32, seed=0)  # fp32: the kernels are bf16 only
    x = torch.randn(4, 32)
    assert torch.equal(twin(x), module(x))
    mlp, mlp_twin = mlp_pair(LlamaMLP, LlamaConfig, seed=0)
    mlp, mlp_twin = mlp.to(torch.bfloat16), mlp_twin.to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    monkeypatch.setattr(fused, "train_kernels", lambda: None)
    assert torch.equal(mlp_twin(x), mlp(x))


def test_other_norms_and_activations_are_left_alone() -> None:
    class GemmaRMSNorm(torch.nn.Module):  # y = x * (1 + weight): a different module
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(16))
            self.variance_epsilon = 1e-6

    gelu = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                  num_key_value_heads=2, hidden_act="gelu"))
    model = torch.nn.Sequential(GemmaRMSNorm(), gelu)
    assert fused.fuse(model) == 0
    assert "forward" not in vars(gelu)


def step_gradient(path: str, config: TrainConfig, batch: object) -> torch.Tensor:
    """The flat fp32 gradient the optimizer's first step on `batch` sees."""
    actor = Actor(path, config)
    seen: list[torch.Tensor] = []
    step = actor.optimizer.step

    def capture(*args: object, **kwargs: object) -> None:
        seen.append(torch.cat([p.grad.reshape(-1) for p in actor.model.parameters()]))
        step(*args, **kwargs)

    actor.optimizer.step = capture  # type: ignore[method-assign]
    actor.update(batch, batch.loss_mask_B_T.float())  # type: ignore[attr-defined]
    return seen[0]


def test_the_actors_bf16_copy_is_fused_and_its_update_matches_the_unfused_one(
        kernels: TrainKernels, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = TrainConfig(bf16=True, grad_clip=0.0)
    actor = Actor(tiny_llama_dir, config)
    layers = actor.compute_model.get_decoder().layers
    assert all("forward" in vars(layer.mlp) and "forward" in vars(layer.input_layernorm)
               for layer in layers)
    assert not any("forward" in vars(m) for m in actor.model.modules())  # the master is as loaded
    assert getattr(modeling_llama.apply_rotary_pos_emb, "relayrl_fused", False)
    batch = random_batch([30, 21, 12], vocab=actor.model.config.vocab_size, seed=4)
    with_kernels = step_gradient(tiny_llama_dir, config, batch)
    monkeypatch.setattr(fused, "train_kernels", lambda: None)
    without = step_gradient(tiny_llama_dir, config, batch)
    # the same step but for bf16 roundings (measured 0.07% apart)
    assert rel(with_kernels, without) < 0.01


def test_an_actor_with_32_wide_heads_rotates_with_the_kernel_and_the_same_numbers(
        kernels: TrainKernels, model_dir: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny test models' 16-wide heads take transformers' own rotary; 2 heads of 32 take ours.
    torch.manual_seed(0)
    path = str(tmp_path)
    modeling_llama.LlamaForCausalLM(LlamaConfig(
        vocab_size=512, tie_word_embeddings=True,
        **{**TINY, "num_attention_heads": 2, "num_key_value_heads": 1})).save_pretrained(path)
    copy_tokenizer_files(model_dir, path)
    config = TrainConfig(bf16=True, grad_clip=0.0)
    batch = random_batch([30, 21, 12], vocab=512, seed=4)
    calls = []
    rotate = fused._Rotary.apply
    monkeypatch.setattr(fused._Rotary, "apply", lambda *a: calls.append(1) or rotate(*a))
    with_kernel = step_gradient(path, config, batch)
    assert calls  # the wrapper took the kernel during the update
    assert getattr(modeling_llama.apply_rotary_pos_emb, "relayrl_fused", False)
    # transformers' own function in its place: the same gradient, bit for bit
    monkeypatch.setattr(fused, "rotary", lambda original: HF_ROTARY)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", HF_ROTARY)
    calls.clear()
    without = step_gradient(path, config, batch)
    assert not calls and torch.equal(with_kernel, without)
