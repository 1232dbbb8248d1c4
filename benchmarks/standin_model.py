"""A random-weight stand-in of a model directory: same config, tokenizer and shapes, new weights.

Run by hand:  python -m benchmarks standin-model SRC_DIR DST_DIR [--seed 0] [--layers N]

For timing on a machine the real weights cannot reach (a lent machine with no network, where a
packaged model's GGUF is over the size that travels): copy SRC_DIR's small files (config,
tokenizer, chat template) here, carry them, and run this there with SRC_DIR = DST_DIR to add the
weights. Throughput depends on shapes, not on values, so `bench_train.py --model DST_DIR` times
the same work as on the real model; nothing that judges outputs may use a stand-in. `--layers N`
keeps only N decoder layers. The smoke runs' model (`harness.smoke_model`) is a narrower one still,
to check code, never for a figure.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks import harness

NAME = "standin-model"

SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json")


def make_standin(src: Path, dst: Path, seed: int = 0, layers: int | None = None,
                 overrides: dict[str, int] | None = None) -> Path:
    """Copy `src`'s config and tokenizer files into `dst` and write fresh weights from the config
    (with `layers` decoder layers and the config's `overrides`, if given)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (src / name).is_file() and src.resolve() != dst.resolve():
            shutil.copy2(src / name, dst / name)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(dst)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dst)
    return dst


def main(argv: list[str] | None = None) -> None:
    """Command line: SRC_DIR DST_DIR (`--smoke`: the smoke runs' model, made if missing)."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("src", type=Path, nargs="?")
    ap.add_argument("dst", type=Path, nargs="?")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="keep only N decoder layers")
    args = ap.parse_args(argv)
    if not args.smoke and (args.src is None or args.dst is None):
        ap.error("SRC_DIR and DST_DIR are required")
    run = harness.Run.start(NAME, args, argv)
    if args.smoke:
        made = Path(harness.smoke_model())
    else:
        made = make_standin(args.src, args.dst, args.seed, args.layers)
    print(made)
    config = AutoConfig.from_pretrained(made)
    run.finish(f"A stand-in of `{made.name}`: {config.num_hidden_layers} layers, random weights.",
               {"path": str(made), "layers": config.num_hidden_layers})


if __name__ == "__main__":
    main()
