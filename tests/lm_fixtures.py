"""A tiny pre-trained Qwen3 chat model shared by the LM tests (built offline, once per session).

Test modules import the fixtures they use from here (``from lm_fixtures import tiny_model_dir``).
pytest registers an imported fixture separately in each module, so the builds are memoised on the
session's base temporary directory to run once per session, not once per module.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hf_constants
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen3 import modeling_qwen3

from moplex_core.lm.lean import LeanRMSNorm
from moplex_core.lm.tiny import build_tiny_model, build_tiny_tokenizer, tiny_pairs

PRETRAIN_STEPS = 40
HUB_NAME = "moplex-tests/tiny-qwen3"


def as_cached_hub_model(model_dir: Path, hub_cache: Path, commit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put ``model_dir`` into a Hugging Face cache at ``hub_cache`` as HUB_NAME at ``commit`` (the layout
    huggingface_hub writes: models--owner--name/{refs/main, snapshots/<commit>/...}), make ``commit``
    the one HUB_NAME loads at, and point huggingface_hub at that cache, offline."""
    repo = hub_cache / f"models--{HUB_NAME.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@functools.cache
def _tiny_model_in(session_tmp: Path) -> Path:
    return build_tiny_model(session_tmp / "tiny-qwen3", tiny_pairs(), pretrain_steps=PRETRAIN_STEPS, seed=0)


@functools.cache
def _tiny_tokenizer_in(session_tmp: Path) -> PreTrainedTokenizerBase:
    directory = session_tmp / "tiny-tokenizer"
    build_tiny_tokenizer([text for pair in tiny_pairs() for text in pair]).save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_model_in(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The tiny model's kind of tokenizer alone (no model to build), saved and reloaded."""
    return _tiny_tokenizer_in(tmp_path_factory.getbasetemp())


@pytest.fixture
def float64_rmsnorm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's RMSNorm (moplex's lean one, which `load_model` puts in) in the input's dtype. It computes
    in float32 even in a float64 model, as transformers' does, which puts float32 rounding (about 1e-8
    of a gradient's scale) on anything summed in another order; with this, two exact computations
    agree to float64 rounding."""

    def forward(self: LeanRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LeanRMSNorm, "forward", forward)


@pytest.fixture
def prompt_pass_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of prompts of every shared prompt pass (moplex_core.lm.logprobs.prompt_prefix, as
    moplex_core.estimate.anchor_pass calls it) run while the test runs, in order."""
    from moplex_core import estimate

    counts: list[int] = []
    real_prefix = estimate.prompt_prefix

    def counting_prefix(model, prefixes, rows, pad_token_id):
        counts.append(len(prefixes))
        return real_prefix(model, prefixes, rows, pad_token_id)

    monkeypatch.setattr(estimate, "prompt_prefix", counting_prefix)
    return counts


class MetaReadsAsZeros(TorchDispatchMode):
    """The meta device standing in for a GPU where a test needs the host to read results back: a copy
    of a meta tensor to the CPU gives zeros of its shape and dtype, and ``.item()`` 0; ``reads``
    counts them (on a GPU each would make the host wait for the device). Everything else runs as on
    meta (a shape and no values), and an op that mixes meta and CPU tensors still raises, as one that
    mixes CUDA and CPU tensors does on a GPU (which the CPU alone never shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and source.device.type == "meta":
            if func is torch.ops.aten._to_copy.default and torch.device(kwargs.get("device", "meta")).type == "cpu":
                self.reads += 1
                return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
            if func is torch.ops.aten._local_scalar_dense.default:
                self.reads += 1
                return 0
        return func(*args, **kwargs)


@pytest.fixture
def layer_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a Qwen3 decoder layer's forward ran (a checkpointed layer runs again in the backward)."""
    runs = [0]
    forward = modeling_qwen3.Qwen3DecoderLayer.forward

    def counted(self, *args, **kwargs):
        runs[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen3.Qwen3DecoderLayer, "forward", counted)
    return runs
