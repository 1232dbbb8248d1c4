"""Checkpoints: Hugging Face directories under `{run_dir}/checkpoints/step_N`.

Each is loadable by `from_pretrained` and servable by vLLM as it stands (weights, config,
generation config, the tokenizer files copied from the source model), plus `relayrl_state.json`
(step, version) and, for exact resume, `optimizer.pt`. A checkpoint is written into a hidden
temporary folder and renamed into place, so a crash never leaves a half-written `step_N` that
`latest_checkpoint` would pick. Only the newest `keep` are kept.

Tradeoff: the optimizer state is as large as two copies of the weights (AdamW moments in fp32);
`save_optimizer=False` halves the disk cost but resumes with fresh moments.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.errors import NotFound

STATE_FILE = "relayrl_state.json"
OPTIMIZER_FILE = "optimizer.pt"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
"""Files copied from the source model so that the checkpoint is a complete model directory."""
_STEP_RE = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint records beyond the weights."""

    step: int
    """Optimizer steps taken."""
    version: int
    """Weight version (what the engine serves after loading these weights)."""


def checkpoint_path(root: str | Path, step: int) -> Path:
    """`root/step_N`."""
    return Path(root) / f"step_{step}"


def save_checkpoint(
    model: Any,
    root: str | Path,
    state: TrainingState,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    tokenizer_source: str | Path | None = None,
    keep: int = 0,
    save_kwargs: dict[str, Any] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write `root/step_N` atomically (model, tokenizer files, state, optimizer); prune to `keep`."""
    final = checkpoint_path(root, state.step)
    tmp = Path(root) / f".step_{state.step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, **(save_kwargs or {}))
    if extra is not None:  # more files, written before the rename like the rest
        extra(tmp)
    if tokenizer_source is not None:
        copy_tokenizer_files(tokenizer_source, tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    (tmp / STATE_FILE).write_text(json.dumps({"step": state.step, "version": state.version}))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep > 0:
        prune_checkpoints(root, keep)
    return final


def copy_tokenizer_files(source: str | Path, dest: str | Path) -> list[str]:
    """Copy the tokenizer files a model directory holds; names copied (none for a hub id)."""
    source = Path(source)
    if not source.is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, Path(dest) / name)
            copied.append(name)
    return copied


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.fullmatch(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint with the highest step under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; return those deleted."""
    found = list_checkpoints(root)
    doomed = found[: max(0, len(found) - keep)]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def read_training_state(path: str | Path) -> TrainingState:
    """The step and version recorded in checkpoint `path`."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise NotFound(f"{path} is not a relayrl checkpoint (no {STATE_FILE})")
    data = json.loads(file.read_text())
    return TrainingState(step=int(data["step"]), version=int(data["version"]))


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: str | Path) -> bool:
    """Restore the optimizer from checkpoint `path`; False when it saved none."""
    file = Path(path) / OPTIMIZER_FILE
    if not file.is_file():
        return False
    optimizer.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
    return True
