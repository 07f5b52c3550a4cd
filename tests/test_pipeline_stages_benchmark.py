"""benchmarks/pipeline_stages.py runs the pipeline's stages without Prefect (moplex_core.pipeline), as
on the GPU machine, which has no Prefect, datasets or vLLM: every stage built, then every stage found,
then on the root moved elsewhere, the evaluation redone on the moved root's own tiny model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_GPU = ("prefect", "datasets", "vllm")  # pydantic travels there as wheels (docs/gpu-efficiency.md)
# A missing package is a None entry in sys.modules: importing it raises ImportError.
RUN = (f"import runpy, sys\nfor name in {ABSENT_ON_GPU!r}:\n    sys.modules[name] = None\n"
       "sys.argv[0] = 'benchmarks/pipeline_stages.py'\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
SMALL = ("ingest.synthetic.n=60", "tiny_model.pretrain_steps=10", "train.em_iterations=1", "train.first_epochs=1")


def _run(root: Path) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = ["--root", str(root), "--threads", "1", *(arg for kv in SMALL for arg in ("--set", kv))]
    out = subprocess.run([sys.executable, "-c", RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    start = lines.index("| stage | version | rows | reused | s | peak GPU GiB |") + 2
    end = lines.index("", start)
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end]]


@pytest.mark.slow
def test_the_stages_run_in_order_without_prefect_and_a_rerun_finds_every_one(tmp_path: Path) -> None:
    first = _run(tmp_path / "root")
    stages = ["ingest", "model", "augment", "cache", "train", "evaluate"]
    assert [row[0] for row in first] == [*stages, "all"]
    for name, version, _, reused, _, peak in first[:-1]:
        assert reused == "" and peak == "-"  # built here; no GPU memory on the CPU
        assert (tmp_path / "root" / name / version / "manifest.json").is_file()
    assert (tmp_path / "root" / "evaluate" / first[5][1] / "metrics.parquet").is_file()
    second = _run(tmp_path / "root")
    assert [row[:3] for row in second] == [row[:3] for row in first]  # the same versions and rows
    assert all(row[3] == "yes" for row in second[:-1])

    (tmp_path / "root").rename(tmp_path / "moved")  # the cache recorded the tiny model's old path
    shutil.rmtree(tmp_path / "moved" / "evaluate")
    third = _run(tmp_path / "moved")
    assert [row[:3] for row in third] == [row[:3] for row in first]
    assert [row[3] for row in third[:-1]] == ["yes"] * 5 + [""]
