"""Load a causal LM and its tokenizer from a local directory or a Hugging Face hub name.

A local directory (a ``save_pretrained`` output, a hub snapshot, or a tiny model from
moplex_core.lm.tiny) always loads directly. A hub name ``owner/name`` loads from its snapshot in the
local Hugging Face cache when there is one, and is downloaded only when the hub is reachable; no
machine of this project reaches the hub, so the error for a model that is not here says so and asks
for a local path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from moplex_core.lm.lean import make_lean

# owner/name as the hub spells it; anything else that does not exist locally is a missing path.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TRUE = {"1", "on", "yes", "true"}
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def resolve_device(device: str) -> str:
    """``auto``: cuda when this machine has one, else cpu; anything else as given, refused (ValueError)
    when torch cannot use it on this machine, before any model work (torch's own error comes later
    and names no setting)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a torch device: give auto, cpu, cuda, cuda:N, mps or mps:N") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this machine has no CUDA device torch can use (give cpu or auto)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: this machine has no MPS device torch can use (give cpu or auto)")
    return device


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that has it (Ampere and later), else float32; anything else the
    torch dtype of that name."""
    if dtype == "auto":
        cuda = str(device).startswith("cuda")
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
    return getattr(torch, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the name configs and manifests use."""
    return str(dtype).removeprefix("torch.")


def identity_on_this_machine(identity: dict[str, Any], device: str) -> dict[str, Any]:
    """A stage's version identity with ``dtype: auto`` replaced by the dtype it means here.

    A bfloat16 and a float32 artifact hold different numbers (and, for sampling, different texts), so
    they are different versions; and a stage resumed on another kind of machine must not add shards
    in another dtype to a version it started.
    """
    if identity.get("dtype") != "auto":
        return identity
    return {**identity, "dtype": dtype_name(resolve_dtype("auto", resolve_device(device)))}


def load_model(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> PreTrainedModel:
    """The causal LM at ``name_or_path`` with weights in ``dtype`` on ``device``, in eval mode; a
    Qwen2/Qwen3 model with its RMSNorm and MLP modules made lean (moplex_core.lm.lean: the same
    results, fewer bytes kept for a backward).

    ``dtype`` is a torch dtype or its name ("bfloat16", "float32", "float64"). ``progress=False``
    silences transformers' "Loading weights" bar for this load (the caller's ``--quiet``).
    """
    with transformers_bars(progress):
        model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=_as_dtype(dtype))
    make_lean(model)
    return model.to(device).eval()


@contextmanager
def transformers_bars(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars (a model's weights loading, a hub download) off inside when not
    ``enabled``: its process-wide switch, restored after, so that a quiet call leaves later ones as they were."""
    from transformers.utils import logging as hf_logging

    silence = not enabled and hf_logging.is_progress_bar_enabled()
    if silence:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if silence:
            hf_logging.enable_progress_bar()


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer at ``name_or_path``; a tokenizer without a pad token pads with its EOS.

    The pad id's value never matters to moplex (attention and response masks exclude pads), but
    batching needs one.
    """
    tokenizer = _from_pretrained(AutoTokenizer, name_or_path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer at {str(name_or_path)!r} has neither a pad nor an eos token; set "
                "pad_token and eos_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(name_or_path: str | Path) -> PretrainedConfig:
    """The config of the model at ``name_or_path`` (found as `load_model` finds the model)."""
    return _from_pretrained(AutoConfig, name_or_path)


class ModelUnavailableError(FileNotFoundError):
    """The model is not here: no such directory, a directory or file that holds no model, or a hub
    name that is not cached while the hub is offline (a rerun fails the same way)."""


def _from_pretrained(auto_class: type, name_or_path: str | Path, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained`` of what ``name_or_path`` names, never running the model's own code:
    a folder whose config.json names Python files of its own (``auto_map``) is refused, where
    transformers, left to decide, would ask on a terminal whether to run them."""
    try:
        return _from_located(auto_class, name_or_path, trust_remote_code=False, **kwargs)
    except ValueError as error:
        if "trust_remote_code" not in str(error):  # transformers' refusal of custom code names the flag
            raise
        raise ValueError(
            f"the model at {str(name_or_path)!r} comes with code of its own (the auto_map of its config.json names "
            "Python files of the folder), and moplex runs no code from a model folder, which may come from an "
            "artifact root or a download you did not write: use a model of an architecture transformers "
            "implements itself (its config.json's model_type, without auto_map)"
        ) from error


def _from_located(auto_class: type, name_or_path: str | Path, **kwargs: Any) -> Any:
    path = Path(name_or_path).expanduser()
    marker = "tokenizer_config.json" if auto_class is AutoTokenizer else "config.json"
    if path.is_dir():
        if not (path / marker).is_file():
            raise ModelUnavailableError(
                f"{str(path)!r} is a directory but has no {marker}, so it holds no Hugging Face "
                f"{'model' if marker == 'config.json' else 'tokenizer'}; pass the directory that "
                "save_pretrained wrote"
            )
        return auto_class.from_pretrained(str(path), **kwargs)
    if path.exists():
        raise ModelUnavailableError(
            f"{str(path)!r} is a file; pass the directory that holds config.json, the weights and "
            "the tokenizer files (a save_pretrained output)"
        )
    name = str(name_or_path)
    if not _HUB_NAME.match(name):
        raise ModelUnavailableError(
            f"model path {name!r} does not exist (resolved to {str(path.resolve())!r}); pass an "
            "existing directory written by save_pretrained, or a hub name such as 'Qwen/Qwen3-0.6B'"
        )
    snapshot = hub_snapshot(name, marker)
    if snapshot is not None and (auto_class is not AutoModelForCausalLM or _has_weights(snapshot)):
        return auto_class.from_pretrained(str(snapshot), **kwargs)
    if _hub_offline():
        raise ModelUnavailableError(_not_found_message(name, path, "HF_HUB_OFFLINE is set"))
    try:  # a snapshot without weights (a tokenizer loaded first) gets them at its own commit
        return auto_class.from_pretrained(name, revision=snapshot.name if snapshot else None, **kwargs)
    except OSError as hub_error:
        message = _not_found_message(name, path, f"downloading it failed ({hub_error})")
        if _refused_by_the_hub(hub_error):  # asking again gets the same answer
            raise ModelUnavailableError(message) from hub_error
        raise OSError(message) from hub_error  # a connection error or a timeout: the pipeline retries it


def _refused_by_the_hub(error: BaseException | None) -> bool:
    """An unknown or gated repository or revision, anywhere in the error's chain of causes
    (transformers wraps huggingface_hub's errors in its own OSError)."""
    while error is not None:
        if isinstance(error, (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError)):
            return True
        error = error.__cause__ or error.__context__
    return False


def hub_snapshot(name: str, file: str = "config.json") -> Path | None:
    """The snapshot folder of the local Hugging Face cache that hub name ``name`` loads from: the
    commit its ``refs/main`` names, which is also the folder's name. None when ``name`` is no hub
    name or its ``file`` is not cached. A pure file-system lookup: from_pretrained(local_files_only=
    True) would still reach for the network (huggingface_hub's user-agent telemetry), which hangs for
    seconds on machines without it."""
    if not _HUB_NAME.match(name) or Path(name).expanduser().is_dir():  # a local folder is never a hub name
        return None
    cached = try_to_load_from_cache(name, file)
    return Path(cached).parent if isinstance(cached, str) else None


def _has_weights(snapshot: Path) -> bool:
    return any((snapshot / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json",
                                                         "pytorch_model.bin", "pytorch_model.bin.index.json"))


def _hub_offline() -> bool:
    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE once, when it is imported.
    from_env = any(os.environ.get(var, "").strip().lower() in _TRUE for var in _OFFLINE_VARIABLES)
    return from_env or hf_constants.HF_HUB_OFFLINE


def _not_found_message(name: str, path: Path, why_not_downloaded: str) -> str:
    return (
        f"model {name!r} was not found locally: there is no directory {str(path.resolve())!r} and "
        f"{name!r} is not in the Hugging Face cache, and it could not be downloaded because "
        f"{why_not_downloaded}. Pass a local path instead: a directory holding config.json, the "
        "weights and the tokenizer files (copy a hub snapshot there from a machine with network "
        "access, or build a tiny offline model with moplex_core.lm.tiny.build_tiny_model)"
    )


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(
            f"dtype {dtype!r} is not a torch floating-point dtype; use e.g. 'bfloat16' or 'float32'"
        )
    return resolved
