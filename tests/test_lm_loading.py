"""Loading says plainly what is missing: a local path that is not there, or a hub model while offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import run_probe
from lm_fixtures import HUB_NAME, as_cached_hub_model, tiny_model_dir  # noqa: F401 (session fixture)
from transformers import Qwen3ForCausalLM

from moplex_core.hashing import model_fingerprint
from moplex_core.lm.loading import ModelUnavailableError, load_model, load_tokenizer, resolve_device


def test_a_local_directory_loads_in_the_requested_dtype_ready_for_scoring(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="bfloat16", device="cpu")
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.dtype == torch.bfloat16 and not model.training
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert tokenizer.pad_token_id is not None and tokenizer.chat_template


def test_the_loading_bar_shows_unless_progress_is_off_and_the_switch_is_left_as_found(tiny_model_dir: Path,
                                                                                      capfd) -> None:
    from transformers.utils import logging as hf_logging

    load_model(tiny_model_dir, progress=False)
    assert "Loading weights" not in capfd.readouterr().err and hf_logging.is_progress_bar_enabled()
    load_model(tiny_model_dir)
    assert "Loading weights" in capfd.readouterr().err


def test_a_quiet_command_leaves_transformers_bars_on_for_what_the_process_does_next(tmp_path: Path) -> None:
    # Tests and notebooks call `main` in their process: its --quiet was transformers' global switch turned
    # off for good, and a later load_model(progress=True) showed no bar.
    from transformers.utils import logging as hf_logging

    from moplex_core.cli import main

    assert main(["cache", "--rankings", str(tmp_path / "none"), "--model", "x", "--quiet"]) == 1
    assert hf_logging.is_progress_bar_enabled()


def test_a_tokenizer_without_pad_token_pads_with_eos(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    assert reloaded.pad_token == reloaded.eos_token == "<|im_end|>"


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused_naming_both(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.pad_token = tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has neither a pad nor an eos token; set pad_token and eos_token in its "
                                         "tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_a_models_weights_file_given_for_its_folder_is_refused_naming_the_folder(tiny_model_dir: Path) -> None:
    weights = next(tiny_model_dir.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"model.safetensors' is a file; pass the directory that holds "
                                                "config.json"):
        load_model(weights)
    with pytest.raises(FileNotFoundError, match="is a file; pass the directory"):
        load_tokenizer(tiny_model_dir / "tokenizer_config.json")


def test_a_missing_path_is_named_in_the_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist"):
        load_tokenizer(f"./{missing.name}/")


def test_a_directory_without_config_files_is_not_taken_for_a_model(tiny_model_dir, tmp_path: Path) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "partial")
    (tmp_path / "partial" / "config.json").unlink()
    (tmp_path / "partial" / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path / "partial")
    with pytest.raises(FileNotFoundError, match="has no tokenizer_config.json"):
        load_tokenizer(tmp_path / "partial")


def test_an_uncached_hub_model_while_offline_asks_for_a_local_path(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # so that no local directory of that name can exist
    for load in (load_model, load_tokenizer):
        with pytest.raises(OSError, match="'moplex-tests/not-a-model' was not found locally") as error:
            load("moplex-tests/not-a-model")
        assert "HF_HUB_OFFLINE is set" in str(error.value) and "Pass a local path" in str(error.value)


MODEL_PROBE = """
import json, sys
import fake_hub

status = {"now": 404}  # what the hub answers: an unknown (or gated) repository, or a server error
fake_hub.use(fake_hub.serve(lambda path: fake_hub.NOT_FOUND if status["now"] == 404 else fake_hub.BUSY), sys.argv[1])
from moplex_core.lm.loading import ModelUnavailableError, load_model  # transformers and huggingface_hub, online

for status["now"] in (404, 503):
    try:
        load_model("nobody/nothing")
    except Exception as err:
        print(json.dumps([status["now"], type(err).__name__, isinstance(err, ModelUnavailableError), str(err)]))
"""


@pytest.mark.slow  # ~10 s: huggingface_hub retries a server error 5 times (Retry-After 0) before it gives up
def test_a_download_the_hub_refuses_is_not_worth_retrying_and_one_it_does_not_serve_is(tmp_path: Path) -> None:
    """The real transformers and huggingface_hub against a local hub: a 404 (unknown or gated) is
    ModelUnavailableError, never retried; a server error that outlasts huggingface_hub's own retries
    is not, and the pipeline retries it."""
    answers = {status: (kind, unavailable, message) for status, kind, unavailable, message
               in run_probe(MODEL_PROBE, str(tmp_path / "hf"))}
    assert answers[404][1] and "downloading it failed" in answers[404][2]
    assert not answers[503][1], answers[503]


def test_a_hub_name_loads_offline_from_its_snapshot_in_the_local_cache(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_cached_hub_model(tiny_model_dir, tmp_path / "hub", "0" * 40, monkeypatch)
    monkeypatch.chdir(tmp_path)

    model = load_model(HUB_NAME)
    tokenizer = load_tokenizer(HUB_NAME)
    assert isinstance(model, Qwen3ForCausalLM) and tokenizer.eos_token == "<|im_end|>"


def test_a_cached_snapshot_without_weights_is_not_taken_for_the_model(tiny_model_dir: Path, tmp_path: Path,  # noqa: F811
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    as_cached_hub_model(tiny_model_dir, tmp_path / "hub", "d" * 40, monkeypatch)
    snapshot = tmp_path / "hub" / "models--moplex-tests--tiny-qwen3" / "snapshots" / ("d" * 40)
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()  # what loading the tokenizer first leaves: config and tokenizer files only
    assert load_tokenizer(HUB_NAME).eos_token == "<|im_end|>"
    with pytest.raises(ModelUnavailableError, match="HF_HUB_OFFLINE is set"):  # online: downloaded at that commit
        load_model(HUB_NAME)


def test_a_hub_name_is_pinned_to_the_commit_it_loads_at(tiny_model_dir: Path, tmp_path: Path,  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    as_cached_hub_model(tiny_model_dir, tmp_path / "hub", "a" * 40, monkeypatch)
    assert model_fingerprint(HUB_NAME) == f"hub:{HUB_NAME}@{'a' * 40}"
    as_cached_hub_model(tiny_model_dir, tmp_path / "hub", "b" * 40, monkeypatch)  # updated on the hub, downloaded
    assert model_fingerprint(HUB_NAME) == f"hub:{HUB_NAME}@{'b' * 40}"
    assert model_fingerprint("moplex-tests/not-cached") == "hub:moplex-tests/not-cached"  # downloaded as it loads


def test_an_unknown_dtype_name_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="'float33' is not a torch floating-point dtype"):
        load_model(tiny_model_dir, dtype="float33")


def test_dtypes_and_weights_are_recognised_as_the_hub_lays_them_out(tmp_path, monkeypatch):
    from moplex_core.lm.loading import _as_dtype, _has_weights, resolve_dtype

    with pytest.raises(ValueError, match="not a torch floating-point dtype"):
        _as_dtype("int8")
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # a sharded snapshot
    assert _has_weights(tmp_path)
    # a V100 or a T4: torch says bf16 is supported there unless asked without emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype("auto", "cuda") == torch.float32 and resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16


def test_a_hidden_folder_of_a_model_folder_is_not_part_of_its_fingerprint(tmp_path):
    # `hf download --local-dir` keeps .cache/huggingface/*.metadata there, rewritten on every download
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")
    before = model_fingerprint(str(model))
    (model / ".cache" / "huggingface").mkdir(parents=True)
    (model / ".cache" / "huggingface" / "model.safetensors.metadata").write_text("etag 1700000000")
    assert model_fingerprint(str(model)) == before


def test_a_device_torch_cannot_use_here_is_refused_naming_it(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device 'gpu' is not a torch device: give auto, cpu, cuda, cuda:N, mps or mps:N"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="device 'cuda': this machine has no CUDA device torch can use"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"device 'cuda:2': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


LOAD_AND_SAY_YES = """
import sys
from moplex_core.generate.vllm_backend import VLLMGenerator
from moplex_core.lm.loading import load_model, load_tokenizer
load = {"model": load_model, "tokenizer": load_tokenizer,
        "vllm": lambda path: VLLMGenerator(path, python=sys.executable)}[sys.argv[1]]
try:
    print("loaded", type(load(sys.argv[2])).__name__)
except ValueError as refused:
    print("refused:", refused)
"""


@pytest.mark.parametrize("part", ["model", "tokenizer", "vllm"])
def test_a_model_folders_own_code_is_never_run_even_when_a_terminal_would_say_yes(
        tiny_model_dir: Path, tmp_path: Path, part: str) -> None:
    # A model folder from elsewhere (an artifact root's model/, a download) whose config names its own
    # code (auto_map): unless told no, transformers asks "run the custom code? [y/N]" on stdin, the
    # tokenizer's loading too (it reads the config). The model is refused (and so is the vllm backend, which
    # reads the config in this process); the tokenizer loads from its own files (tokenizer.json), no code.
    folder, ran = tmp_path / "model", tmp_path / "custom-code-ran"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "custom.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="moplex-custom",
                  auto_map={"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"})
    (folder / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": str(Path.cwd())}
    done = subprocess.run([sys.executable, "-c", LOAD_AND_SAY_YES, part, str(folder)], input="y\n" * 5, text=True,
                          capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not ran.exists(), f"the folder's custom.py ran: {done.stdout}"
    if part != "tokenizer":
        assert "refused:" in done.stdout and "comes with code of its own" in done.stdout and str(folder) in done.stdout
    else:
        assert done.stdout.startswith("loaded")
