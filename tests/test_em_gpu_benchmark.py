"""benchmarks/em_gpu.py stays runnable: its --tiny CPU path end to end, without the packages the GPU
machine lacks (issue 9; DESIGN 8: no pydantic, prefect, datasets or vllm there); and so does
benchmarks/host_ops.py, which reuses its passes (em_gpu_rig), and benchmarks/activation_memory.py."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/em_gpu.py"
NEVER_IMPORTED = ("pydantic", "prefect", "datasets", "vllm")  # absent on the GPU machine (DESIGN 8)
# Not named on the GPU machine either; peft imports them when they are installed, but works without.
ABSENT_ON_GPU = (*NEVER_IMPORTED, "scipy", "sklearn")
TINY_M_PRIMES = (4, 6)
TINY_METHODS = (("full", "shared"), ("a=2", "shared"), ("full", "per row"), ("a=2", "per row"))
THROUGHPUT_PASSES = ("plain base model, fwd", "plain base model, right-padded rows",
                     "plain base model, the same padded rows under a padding mask",
                     "plain base model, transformers' RMSNorm and MLP",
                     "multi-LoRA, k adapters mixed, fwd + grad",
                     "multi-LoRA, k adapters mixed, fwd + backward into LoRA weights", "PEFT, 1 active adapter",
                     "PEFT mixed adapter_names")

# A missing package is a None entry in sys.modules: importing it raises ImportError, and an optional
# import (importlib.util.find_spec) sees it as not installed, as on the GPU machine.
BLOCK = f"import sys\nfor name in {ABSENT_ON_GPU!r}:\n    sys.modules[name] = None\n"


def _runner(argv: list[str]) -> str:
    """Python code that runs the script as `python3 benchmarks/em_gpu.py ARGV` does (its folder first on
    sys.path, where its em_gpu_* modules are), with the GPU machine's missing packages blocked."""
    return BLOCK + (f"import runpy\nsys.path.insert(0, 'benchmarks')\nsys.argv = {[SCRIPT, *argv]!r}\n"
                    f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")


def _table(stdout: str, header: str) -> list[list[str]]:
    """The cells of the body rows of the markdown table whose header line starts with ``header``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2  # past the |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("em_gpu")
    runner = _runner(["--tiny", "--out", str(out)])
    proc = subprocess.run([sys.executable, "-c", runner], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return out, proc.stdout


def test_table_has_every_configuration_and_pass(tiny_run: tuple[Path, str]) -> None:
    _, stdout = tiny_run
    em_rows = _table(stdout, "| m' | method |")
    assert [tuple(row[:3]) for row in em_rows] == [(str(m), *method) for m in TINY_M_PRIMES for method in TINY_METHODS]
    assert all(len(row) == 14 and "-" not in row[11:] for row in em_rows)  # with the late iteration's columns
    passes = _table(stdout, "| pass | B |")
    assert len(passes) == len(THROUGHPUT_PASSES)
    for row, name in zip(passes, THROUGHPUT_PASSES, strict=True):
        assert row[0].startswith(name) and row[1] == "6"  # B = 2 k: every batch mixes all k adapters
    profiled = _table(stdout, "| pass | wall ms |")
    assert [row[0].split(",")[0] for row in profiled] == ["plain base model"] + ["multi-LoRA"] * 6
    assert [row[0].rsplit(": ", 1)[1] for row in profiled[-2:]] == ["2 rows", "6 rows"]  # a = 2, m' = 6 (tiny)
    ops = _table(stdout, "| aten op |")
    assert len(ops) == 15 and ops[-1][0].endswith("other ops")  # the 14 slowest, then the rest
    assert "OOM" not in stdout
    assert re.search(r"^float32 matmul, 256\^3: [\d.]+ TFLOP/s; device-to-device copy moving [\d.]+ GiB: "
                     r"[\d.]+ TB/s$", stdout, flags=re.MULTILINE)
    assert re.search(r"^The LoRA path's extra memory traffic, .*: [\d.e-]+ GB per pass, [\d.e-]+ ms at the copy rate",
                     stdout, flags=re.MULTILINE)


def test_mixed_multi_lora_pass_agrees_with_peft(tiny_run: tuple[Path, str]) -> None:
    out, stdout = tiny_run
    check = json.loads((out / "em_gpu.json").read_text())["check"]
    assert check["dtype"] == "float32" and check["wide_dtype"] == "float64"
    assert check["adapter_effect"] > 1e-2  # the adapters change log pi, so agreement means something
    for key in ("ours_vs_peft", "ours_vs_wide", "peft_vs_wide", "base_batch_shape", "base_vs_wide", "padding_mask",
                "padding_mask_input_grads", "shared_prompts", "shared_prompts_input_grads",
                "shared_prompts_target_terms"):
        assert check[key] < 1e-3 * check["adapter_effect"] + 1e-4, (key, check)
    assert check["target_terms_vs_wide"] < 1e-4 * check["mean_abs_target_term"] and check["mean_abs_target_term"] > 0.1
    # moplex's lean modules give transformers' results to the bit (and so do two runs on the CPU)
    assert check["lean_vs_stock"] == 0 and check["stock_vs_stock"] == 0
    assert len(_table(stdout, "| ours vs PEFT |")) == 1 and "through the shared-prompt pass" in stdout
    assert "The base model's target terms" in stdout


def test_json_numbers_are_positive_and_finite(tiny_run: tuple[Path, str]) -> None:
    out, _ = tiny_run
    results = json.loads((out / "em_gpu.json").read_text())
    assert [(row["m_prime"], row["method"], row["prompts"]) for row in results["em"]] == \
        [(m, *method) for m in TINY_M_PRIMES for method in TINY_METHODS]
    timed = ("e_step_s_per_example", "m_step_s_per_example", "total_s_per_example", "speedup_vs_full",
             "late_m_step_s_per_example", "late_total_s_per_example", "late_speedup_vs_full")
    for row in results["em"]:
        assert not row["oom"] and row["peak_gib"] is None  # no GPU memory on the CPU
        for key in timed:
            assert math.isfinite(row[key]) and row[key] > 0, (row["method"], key, row[key])
    assert [row["pass"].split(",")[0] for row in results["throughput"]["rows"]] == \
        [name.split(",")[0] for name in THROUGHPUT_PASSES]
    for row in results["throughput"]["rows"]:
        for key in ("ms", "tokens_per_s", "ratio_vs_plain"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["pass"], key, row[key])
    for key in ("matmul_tflops", "copy_tbs"):
        assert math.isfinite(results["ceilings"][key]) and results["ceilings"][key] > 0
    profile = results["profile"]
    for name in ("plain", "multi_lora", "multi_lora_prompt_pass", "multi_lora_m", "multi_lora_m_prompt_pass"):
        row = profile[name]
        assert row["wall_ms"] > 0 and 0 < row["busy_ms"] and row["kernels"] is None  # no kernels on the CPU
        assert sum(op["ms"] for op in row["ops"].values()) == pytest.approx(row["busy_ms"])
        trace = json.loads(gzip.decompress((out / f"profile_{name}.json.gz").read_bytes()))
        assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    # The M-step pass of one pair: a's rows and m''s run the same matmuls, one adapter's plain GEMMs (the
    # decoder's always; here the log-probs too: both passes' response positions fit in one vocabulary chunk).
    # The host's per-row bookkeeping, index tensors made from lists, grows with the rows.
    pairs = profile["m_step_pairs"]
    assert [row["rows"] for row in pairs] == [2, 6] and all(row["wall_ms"] > 0 and row["busy_ms"] > 0 for row in pairs)
    matmuls = [{op: row["ops"].get(op, {"calls": 0})["calls"] for op in ("aten::mm", "aten::addmm_", "aten::bmm")}
               for row in pairs]
    assert matmuls[0] == matmuls[1] and matmuls[0]["aten::addmm_"] >= 2 * 7  # the LoRA B product into the base
    # The LoRA path's ops are in the multi-LoRA pass only. Without gradients into the adapters it
    # reads each layer's stack of all k adapters, kept from the warm-up (MultiLoRALinear.frozen): one
    # gather per matrix and two batched matmuls (A, then B), nothing stacked or cast in the pass
    # (2 layers x 7 projections). The plain pass's own bmm count depends on the transformers version
    # (5.17's rotary embedding runs one).
    calls = {name: {op: profile[name]["ops"].get(op, {"calls": 0})["calls"]
                    for op in ("aten::bmm", "aten::index_select", "aten::stack")}
             for name in ("plain", "multi_lora")}
    assert calls["multi_lora"]["aten::bmm"] == calls["plain"]["aten::bmm"] + 2 * 2 * 7
    assert calls["multi_lora"]["aten::index_select"] == calls["plain"]["aten::index_select"] + 2 * 2 * 7
    assert calls["multi_lora"]["aten::stack"] == calls["plain"]["aten::stack"]
    # Counted by hand for the tiny Qwen3 (2 layers, hidden 64, 4 / 2 heads of 16, MLP 192, r = 16),
    # T (3 d_in + 3 d_out + 4 r) per projection: q and o 64 -> 64, k and v 64 -> 32, gate and up
    # 64 -> 192, down 192 -> 64, so per layer 2*384 + 2*288 + 2*768 + 768 + 7*4*16 = 4096 elements per
    # token; float32, B = 6 rows of 28 tokens.
    assert profile["lora_extra_gb"] == pytest.approx(2 * 4096 * 4 * 28 * 6 / 1e9)


def test_the_cache_section_times_both_prompt_modes_and_they_agree(tiny_run: tuple[Path, str]) -> None:
    out, stdout = tiny_run
    cache = json.loads((out / "em_gpu.json").read_text())["cache"]
    rows = [(row["m_prime"], row["contractions"], row["prompts"]) for row in cache["rows"]]
    assert rows == [(max(TINY_M_PRIMES), c, p) for c in (True, False) for p in ("shared", "per row")]
    for row in cache["rows"]:
        assert not row["oom"] and row["peak_gib"] is None and row["s_per_example"] > 0
        assert row["logp_gap"] < 1e-4  # the same log pi_ref both ways (float32)
        profile = row["profile"]  # one example's call: on the CPU, its aten ops' CPU time; no kernel count
        assert profile["kernels"] is None and profile["busy_ms"] == pytest.approx(
            sum(op["ms"] for op in profile["ops"].values()))
        assert profile["ops"]["aten::mm"]["calls"] > 0 and profile["busy_ms"] > 0
    by_mode = {(row["contractions"], row["prompts"]): row["profile"]["ops"] for row in cache["rows"]}
    for contractions in (True, False):
        # the shared prompt is a second decoder call: each layer runs its projections once more
        assert by_mode[contractions, "shared"]["aten::mm"]["calls"] > by_mode[contractions, "per row"]["aten::mm"]["calls"]
    assert [row["speedup_vs_shared"] for row in cache["rows"] if row["prompts"] == "shared"] == [1.0, 1.0]
    table = _table(stdout, "| m' | contractions |")
    assert [row[:3] for row in table] == \
        [[str(max(TINY_M_PRIMES)), c, p] for c in ("true", "false") for p in ("shared", "per row")]
    assert all(float(row[7]) > 0 and row[9] == "-" for row in table)  # busy s/ex; no kernel count on the CPU
    for contractions in ("with", "without"):
        ops = _table(stdout.split(f"one call {contractions} contractions goes")[1], "| aten op | shared ms |")
        assert ops[0][0].startswith("aten::") and "other ops" in ops[-1][0]


def test_figure_is_written(tiny_run: tuple[Path, str]) -> None:
    out, _ = tiny_run
    assert (out / "em_gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_imports_pull_in_no_package_the_gpu_machine_lacks() -> None:
    """Importing the benchmark loads none of them even where they are installed (here), and the
    moplex_core modules it loads are the pydantic-free ones."""
    check = ("import json, sys\nsys.path.insert(0, 'benchmarks')\nimport em_gpu\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {NEVER_IMPORTED!r})))\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith('moplex_core'))))\n")
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    absent, loaded = (json.loads(line) for line in proc.stdout.splitlines()[-2:])
    assert absent == []
    assert not {"moplex_core.config", "moplex_core.train", "moplex_core.cache"} & set(loaded)


def _em_section(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The script's EM section alone (--tiny) into ``out``: the process and its em_gpu.json."""
    runner = _runner(["--tiny", "--out", str(out), "--sections", "em", *extra])
    proc = subprocess.run([sys.executable, "-c", runner], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc, json.loads((out / "em_gpu.json").read_text())


@pytest.fixture(scope="module")
def first_m_prime_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    """The EM section at the first tiny m' with the default minibatch and pass sizes (read, never changed)."""
    return _em_section(tmp_path_factory.mktemp("em_first_m_prime"), "--m-primes", str(TINY_M_PRIMES[0]))


def test_a_split_run_resumes_where_the_first_part_stopped(tmp_path: Path, first_m_prime_run) -> None:
    """--m-primes runs part of the EM section; --resume keeps an earlier run's rows and runs only the
    configurations it lacks, so one measurement can span several device time limits."""
    stopped, results = _em_section(tmp_path / "stopped", "--deadline", "0")  # nothing starts after 0 s, and it says so
    assert results["em"] == []
    assert "--deadline 0 s reached" in stopped.stderr and "em m'=" not in stopped.stderr
    _, first = first_m_prime_run
    older = {**first, "sizes": {k: v for k, v in first["sizes"].items()
                                if k not in ("pairs_per_step", "gradient_checkpointing")}}
    (tmp_path / "first.json").write_text(json.dumps(older))  # as written before those settings existed
    assert [row["m_prime"] for row in first["em"]] == [TINY_M_PRIMES[0]] * len(TINY_METHODS)
    second, results = _em_section(tmp_path / "second", "--resume", str(tmp_path / "first.json"))
    measured = re.findall(r"^em m'=(\d+) ", second.stderr, flags=re.MULTILINE)
    assert measured == [str(TINY_M_PRIMES[1])] * len(TINY_METHODS)  # the first part's m' is not run again
    assert [(row["m_prime"], row["method"], row["prompts"]) for row in results["em"]] == \
        [(m, *method) for m in TINY_M_PRIMES for method in TINY_METHODS]
    assert results["em"][:len(TINY_METHODS)] == first["em"] and results["resumed_from"] == first["date"]
    assert [row["speedup_vs_full"] for row in results["em"] if row["method"] == "full"] == [1.0] * 4


def test_the_m_step_minibatch_the_e_step_pass_and_checkpointing_are_settable(tmp_path: Path,
                                                                             first_m_prime_run) -> None:
    """--pairs-per-step P fits P (example, cluster) pairs per optimizer step, as the pipeline's
    train.batch_size does, --score-batch-size sets the rows per pass and --gradient-checkpointing
    checkpoints the decoder layers; all are recorded, and the timed M-step's optimizer steps say which
    ran (n = 2 examples x k = 3 clusters = 6 pairs)."""
    runs = [first_m_prime_run, _em_section(tmp_path / "three", "--m-primes", str(TINY_M_PRIMES[0]),
                                           "--pairs-per-step", "3", "--score-batch-size", "8",
                                           "--gradient-checkpointing")]
    for proc, results in runs:
        assert "M-step minibatch: " + results["protocol"]["m_step_minibatch"] in proc.stdout
    (_, one), (_, three) = runs
    assert [row["m_step_optimizer_steps"] for row in one["em"]] == [6] * len(TINY_METHODS)
    assert [row["m_step_optimizer_steps"] for row in three["em"]] == [2] * len(TINY_METHODS)
    assert (one["sizes"]["pairs_per_step"], three["sizes"]["pairs_per_step"]) == (1, 3)
    assert (one["sizes"]["score_batch_size"], three["sizes"]["score_batch_size"]) == (16, 8)
    assert (one["sizes"]["gradient_checkpointing"], three["sizes"]["gradient_checkpointing"]) == (False, True)
    assert ["every decoder layer checkpointed" in proc.stdout for proc, _ in runs] == [False, True]
    assert three["protocol"]["m_step_minibatch"].startswith("3 (example, cluster) pairs per optimizer step")


def test_the_gpu_smoke_run_asks_for_a_gpu_here() -> None:
    """--smoke is the tiny sizes on CUDA in bf16, for a GPU session's first seconds; without CUDA it says
    so instead of running on the CPU."""
    runner = _runner(["--smoke", "--out", "unused"])
    proc = subprocess.run([sys.executable, "-c", runner], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "no CUDA device" in proc.stderr, proc.stderr[-3000:]


def test_the_host_wait_check_names_every_place_once_with_its_callers() -> None:
    # On the card, torch's sync check in "warn" mode warns where a pass waits; waits() turns each warning
    # into the frames that led to it. Here the warnings are raised by hand, from this file.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import warnings

    from em_gpu_passes import waits

    def wait_here() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    def run() -> None:
        for _ in range(3):
            wait_here()  # one place, three times
        warnings.warn("an unrelated warning", FutureWarning)
        wait_here_too()

    def wait_here_too() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    sites = waits(run, where=("test_em_gpu_benchmark",))
    assert len(sites) == 2 and all(site.startswith("test_em_gpu_benchmark.py:") for site in sites)
    assert all(len(site.split(" <- ")) == 3 for site in sites)  # the warning's line, run's line, this test's
    assert waits(lambda: None) == []


def test_host_ops_prints_every_pass_with_its_ops_and_host_time() -> None:
    """benchmarks/host_ops.py stays runnable (a small model: 2 layers, k = 3, 6 rows, one repeat)."""
    proc = subprocess.run([sys.executable, "benchmarks/host_ops.py", "--layers", "2", "--k", "3", "--rows", "6",
                           "--repeats", "1"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    rows = {row[0]: (int(row[1].replace(",", "")), float(row[3])) for row in _table(proc.stdout, "| pass |")}
    computing = {row[0]: int(row[2].replace(",", "")) for row in _table(proc.stdout, "| pass |")}
    assert all(0 < computing[label] < ops for label, (ops, _) in rows.items())  # views are left out
    assert list(rows) == ["plain base model, fwd + input grad",
                          "plain base model, transformers' RMSNorm and MLP (not lean), fwd + input grad",
                          "E-step pass, 3 adapters mixed",
                          "M-step pass, 3 adapters mixed", "M-step pass, one adapter",
                          "M-step pass, 3 adapters mixed, shared prompts",
                          "M-step pass, 3 adapters mixed, checkpointed layers", "M-step minibatch (fit): 1 pair, a = 2",
                          "M-step minibatch (fit): 3 pairs of 3 clusters, a = 2"]
    assert all(ops > 0 and ms > 0 for ops, ms in rows.values())
    # the LoRA layer adds ops to the plain pass; the prompt pass adds a second decoder call
    assert rows["E-step pass, 3 adapters mixed"][0] > rows["plain base model, fwd + input grad"][0]
    assert rows["M-step pass, 3 adapters mixed, shared prompts"][0] > rows["M-step pass, 3 adapters mixed"][0]
    # checkpointed, the layers' forward ops run twice
    assert rows["M-step pass, 3 adapters mixed, checkpointed layers"][0] > rows["M-step pass, 3 adapters mixed"][0]


def test_activation_memory_prints_every_pass_with_less_kept_by_the_lean_modules_in_bf16() -> None:
    """benchmarks/activation_memory.py stays runnable (3 layers, 2 rows of 8 tokens)."""
    proc = subprocess.run([sys.executable, "benchmarks/activation_memory.py", "--layers", "3", "--rows", "2",
                           "--tokens", "8"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    passes = [(kind, dtype) for dtype in ("bfloat16", "float32") for kind in ("plain model", "E-step", "M-step")]
    kept = _table(proc.stdout, "| pass | dtype | transformers'")
    peaks = _table(proc.stdout, "| pass | dtype | as it is")
    for rows in (kept, peaks):
        assert [(row[0].split(":")[0].split(",")[0], row[1]) for row in rows] == passes
    for row in kept:  # less in bf16; in float32 the lean modules run autograd
        stock, lean = float(row[2]), float(row[3])
        assert (0 < lean < stock) if row[1] == "bfloat16" else (lean == stock > 0), row
    for row in peaks:  # checkpointed: each layer's input and one layer's activations at a time
        assert 0 < float(row[3]) < float(row[2]) and float(row[5]) > 0 and float(row[6]) > 0, row


def test_report_redraws_the_cards_figure_from_its_json_without_a_device(tmp_path: Path) -> None:
    runner = _runner(["--report", "docs/em_gpu_h200.json", "--out", str(tmp_path)])
    proc = subprocess.run([sys.executable, "-c", runner], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "677.3 TFLOP/s" in proc.stdout and _table(proc.stdout, "| m' | method |")
    assert (tmp_path / "em_gpu.png").read_bytes() == (ROOT / "docs" / "em_gpu.png").read_bytes()
