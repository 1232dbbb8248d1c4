"""A random-weight stand-in of a model directory: same config, tokenizer and shapes, new weights.

Run by hand:  python benchmarks/standin_model.py SRC_DIR DST_DIR [--seed 0]

For timing on a machine the real weights cannot reach (a lent machine with no network, where a
packaged model's GGUF is over the size that travels): copy SRC_DIR's small files (config,
tokenizer, chat template) here, carry them, and run this there with SRC_DIR = DST_DIR to add the
weights. Throughput depends on shapes, not on values, so `bench_train.py --model DST_DIR` times
the same work as on the real model; nothing that judges outputs may use a stand-in.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json")


def make_standin(src: Path, dst: Path, seed: int = 0) -> Path:
    """Copy `src`'s config and tokenizer files into `dst` and write fresh weights from the config."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (src / name).is_file() and src.resolve() != dst.resolve():
            shutil.copy2(src / name, dst / name)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(dst)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dst)
    return dst


def main() -> None:
    """Command line: SRC_DIR DST_DIR."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make_standin(args.src, args.dst, args.seed))


if __name__ == "__main__":
    main()
