"""The model options the CPU benchmarks share: the tiny offline Qwen3, or one of Qwen3-0.6B's shape.

    add_model_options(parser)         --threads and --qwen3-0.6b
    bench_model(args, directory, dtype)  build the chosen model under ``directory``: (path, description)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moplex_core.lm.tiny import build_qwen3_0_6b_shape, build_tiny_model, tiny_pairs


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--qwen3-0.6b", dest="qwen", action="store_true",
                        help="a Qwen3-0.6B-shaped model with random weights instead of the tiny model")


def bench_model(args: argparse.Namespace, directory: Path, dtype: torch.dtype = torch.float32) -> tuple[Path, str]:
    """Apply --threads and build the model --qwen3-0.6b chooses: the Qwen3-0.6B shape with seeded random
    weights in ``dtype`` (no download), or the tiny Qwen3 (2 layers, hidden 64) pre-trained 40 steps
    on `tiny_pairs`. Returns its directory and a description for the table's header."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.qwen:
        texts = [text for pair in tiny_pairs() for text in pair]
        return (build_qwen3_0_6b_shape(directory / "qwen3-0.6b-shape", texts, dtype),
                f"Qwen3-0.6B shape, random weights, {str(dtype).removeprefix('torch.')}")
    return build_tiny_model(directory / "tiny", tiny_pairs(), pretrain_steps=40), \
        "tiny Qwen3 (2 layers, hidden 64), pre-trained 40 steps"
