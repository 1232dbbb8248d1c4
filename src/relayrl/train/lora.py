"""LoRA: train low-rank adapters on the policy's linear layers instead of all its weights (peft).

`add_adapters` freezes the model and puts peft's LoRA layers in its linear modules, in place (the
model stays the transformers model the actor scores with: no `PeftModel` wrapper). What leaves
the trainer is always a plain model: `merged_state_dict` folds each adapter into its base weight
(`W + scale * B @ A`, computed afresh, so the base is never rounded by merging and unmerging),
which is what the engine loads and what a checkpoint's weights hold. A checkpoint also keeps the
adapter in peft's own layout in `adapter/` (`PeftModel.from_pretrained` and vLLM's LoRA loading
read it), which a resumed run loads onto the base model it names.

Why: a backward pass without gradients for the frozen weights skips a third of the update's
matrix products, AdamW's moments shrink from two copies of the model to two of the adapters, and
RL is known to learn as well with low-rank adapters as with all weights at a higher learning rate
(benchmarks/RESULTS.md measures what it buys here).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from relayrl.errors import ConfigError

ADAPTER_DIR = "adapter"
"""A checkpoint's subfolder with the adapter (peft's `adapter_config.json` and weights)."""
_PEFT_PREFIX = "base_model.model."  # how a PeftModel names the wrapped model's keys


def _lora_config(rank: int, alpha: float, targets: str | tuple[str, ...],
                 base: str | None = None) -> Any:
    from peft import LoraConfig

    # peft annotates lora_alpha as int; it only ever divides it by r, so a float scales as asked
    return LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]
                      lora_dropout=0.0, bias="none",
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      base_model_name_or_path=base, task_type="CAUSAL_LM")


def add_adapters(model: Any, rank: int, alpha: float, targets: str | tuple[str, ...],
                 seed: int = 0) -> int:
    """Freeze `model` and add rank-`rank` LoRA adapters to `targets`; returns their parameter count.

    The adapters start as peft starts them (A random, B zero: the model's outputs are unchanged),
    from a fixed seed so that every rank and every run start alike.
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear

    head = model.get_output_embeddings()  # before peft may wrap it
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(_lora_config(rank, alpha, targets), model)
        except ValueError as e:  # peft's "target modules not found", among others
            raise ConfigError(f"lora_targets {targets!r}: {e}") from None
    trainable = [p for n, p in model.named_parameters() if ".lora_" in n]
    if not trainable:
        raise ConfigError(f"lora_targets {targets!r} matched no layer of the model")
    # The actor scores with the head's weight directly (train/head.py), and a tied embedding
    # is that weight: an adapter on either would train one model and serve another.
    unsupported = [name for name, layer in _lora_layers(model).items()
                   if not isinstance(layer, Linear) or layer.get_base_layer() is head]
    if unsupported:
        raise ConfigError(f"lora_targets {targets!r}: adapters go on the decoder's linear layers "
                          f"only, not on {', '.join(unsupported[:3])}")
    for p in trainable:
        p.requires_grad_(True)
    return sum(p.numel() for p in trainable)


def _lora_layers(model: Any) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def adapters_off(*models: Any) -> Iterator[None]:
    """Run `models` as their base weights alone (peft's adapters bypassed), then restore them."""
    layers = [layer for model in models for layer in _lora_layers(model).values()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # trainable again, as add_adapters left them


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The plain model's state dict (its own key names) with every adapter folded into its weight.

    Tensors of layers without an adapter are the model's own (shared, not copied).
    """
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".")
        if owner.endswith(".base_layer"):
            name = owner[: -len(".base_layer")]
            if leaf == "weight":
                layer = layers[name]
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
                value = value + delta.to(value.dtype)
            key = f"{name}.{leaf}"
        out[key] = value.detach()
    return out


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' weights, keyed as peft saves them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def save_adapter(model: Any, directory: str | Path, rank: int, alpha: float, base: str) -> Path:
    """Write the adapter to `directory/adapter/` in peft's layout, naming `base` as its model."""
    from safetensors.torch import save_file

    folder = Path(directory) / ADAPTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    # the module names the adapters sit on (what "all-linear" resolved to), as peft saves them
    names = sorted({name.rpartition(".")[2] for name in _lora_layers(model)})
    config = _lora_config(rank, alpha, tuple(names), base).to_dict()
    config["target_modules"] = names
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    state = {_PEFT_PREFIX + k: v.detach().contiguous().cpu()
             for k, v in adapter_state_dict(model).items()}
    save_file(state, str(folder / "adapter_model.safetensors"))
    return folder


def adapter_base(checkpoint: str | Path) -> str | None:
    """The base model a checkpoint's adapter was trained on; None if it holds no adapter."""
    file = Path(checkpoint) / ADAPTER_DIR / "adapter_config.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text()).get("base_model_name_or_path")


def load_adapter(model: Any, checkpoint: str | Path) -> None:
    """Load a checkpoint's adapter weights into `model`'s adapters (added by `add_adapters`)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(checkpoint) / ADAPTER_DIR / "adapter_model.safetensors"))
    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()}
    # torch's (missing_keys, unexpected_keys), which peft annotates as `namedtuple` itself
    result: Any = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise ConfigError(f"{checkpoint}: the adapter does not fit this config's adapters "
                          f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})")
