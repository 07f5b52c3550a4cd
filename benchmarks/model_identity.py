"""What the demo's tiny model is under the installed libraries: its weights' hash, its fingerprint
(every file: an input of augment's and cache's versions) and the augment version it leads to.

    PYTHONPATH=. python benchmarks/model_identity.py [--root DIR]

Run it under two library sets (e.g. another transformers in front on PYTHONPATH) to see whether they
build the same weights, and whether the versions after the model stage move anyway (the model's
config.json records the transformers version that saved it). Prints one markdown table row.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

from moplex_core.artifacts import ArtifactStore
from moplex_core.augment import plan_augment
from moplex_core.config import pipeline_preset
from moplex_core.hashing import model_fingerprint, sha256_file
from moplex_core.ingest import run_ingest
from moplex_core.tiny_model import run_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="artifact root to build in (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        store = ArtifactStore(args.root or scratch)
        config = pipeline_preset("synthetic-demo")
        rankings = run_ingest(config.ingest, store).path
        model = run_tiny_model(config.tiny_model, rankings, store)
        augment = plan_augment(config.augment.model_copy(update={"model": str(model)}), rankings, store)
        print("| transformers | torch | model.safetensors sha256 | model fingerprint | augment version |")
        print("|---|---|---|---|---|")
        print(f"| {transformers.__version__} | {torch.__version__} | {sha256_file(model / 'model.safetensors')[:12]} "
              f"| {model_fingerprint(str(model)).removeprefix('sha256:')[:12]} | {augment.ref.version} |")


if __name__ == "__main__":
    main()
