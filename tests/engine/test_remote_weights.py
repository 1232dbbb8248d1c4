"""`save_state_dir`: how a remote engine hands a state dict to a server that loads from disk."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

from relayrl.engine.remote import save_state_dir


def test_a_state_dict_that_cannot_be_written_leaves_no_folder_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def full_disk(tensors: dict, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_state_dir({"w": torch.zeros(4)})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    folder = Path(save_state_dir({"w": torch.ones(4), "tied": torch.ones(4)}))
    try:
        loaded = safetensors.torch.load_file(str(folder / "model.safetensors"))
        assert set(loaded) == {"w", "tied"} and torch.equal(loaded["w"], torch.ones(4))
    finally:
        shutil.rmtree(folder)
