"""benchmarks/em_gpu.py's report: its markdown tables, read from em_gpu.json's numbers (so a resumed run
prints every section it holds), and its figure in the layout of the paper's Figure 5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from em_gpu_passes import MULTI_E, MULTI_E_PROMPT_PASS, MULTI_M, MULTI_M_ONE_PAIR, MULTI_M_PROMPT_PASS, PLAIN
from em_gpu_rig import LORA

PROFILE_TOP = 14  # aten ops the profile table lists by time; the rest are one row


def _fmt(value: float | None, spec: str, oom: bool) -> str:
    if oom:
        return "OOM"
    return "-" if value is None else format(value, spec)


def minibatch_note(sizes: dict[str, Any]) -> str:
    """The M-step minibatch as the report and em_gpu.json say it, from em_gpu.json's sizes."""
    pairs = sizes.get("pairs_per_step", 1)  # em_gpu.json written before the setting existed: 1
    if pairs == 1:
        return ("1 (example, cluster) pair = m' rows (full) or a rows (a=...) per backward (a = 2: 2-row passes, "
                "which a GPU runs below its throughput)")
    return (f"{pairs} (example, cluster) pairs per optimizer step, in passes of at most {sizes['score_batch_size']} "
            "rows (a pair's m' or a rows never split: a larger pair is a pass of its own)")


def print_report(results: dict[str, Any]) -> None:
    sizes = results["sizes"]
    attention = results.get("throughput", {}).get("attention")
    print(f"## EM iteration cost and anchor-pass throughput on {results['device']}\n")
    print(f"{results['date']}; {sizes['description']}{f', {attention} attention' if attention else ''}; torch "
          f"{results['versions']['torch']}, transformers {results['versions']['transformers']}, peft "
          f"{results['versions']['peft']}; {results['threads']} CPU thread(s). Rows of {sizes['row_tokens']} "
          f"random tokens ({sizes['prompt_tokens']} prompt + {sizes['response_tokens']} response incl. EOS).\n")
    if "em" in results:
        print(f"### One EM iteration, k = {sizes['k']} LoRA adapters (r = {LORA.r}, alpha {LORA.alpha:g}, "
              f"{len(LORA.target_modules)} projections), n = {results['examples']} examples\n")
        checkpointed = "every decoder layer checkpointed (train.gradient_checkpointing); " * bool(
            sizes.get("gradient_checkpointing"))
        print(f"M-step minibatch: {minibatch_note(sizes)}; {checkpointed}"
              f"E-step: {sizes['score_batch_size']} rows per forward; prompts `shared`: run once per (example, "
              "cluster) and pass (the default), `per row`: with every response; speedup and memory against "
              "full with the same prompts; every pair weighted 1/k (all above "
              "gamma_min, the worst case: an early iteration); late: the M-step of an iteration whose posteriors "
              "sit on one cluster per example (k times fewer pairs), plus the same E-step. Times per example; "
              "peak memory of the tensors (weights included) of each step, and their maximum for the ratio; "
              "reserved: the most the allocator held (what must fit on the card).\n")
        print("| m' | method | prompts | E-step s/ex | M-step s/ex | total s/ex | E-step peak GiB | M-step peak GiB "
              "| reserved GiB | speedup vs full | memory full/this | late M-step s/ex | late total s/ex "
              "| late speedup |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for row in results["em"]:
            oom = row["oom"]
            print(f"| {row['m_prime']} | {row['method']} | {row['prompts']} | "
                  f"{_fmt(row['e_step_s_per_example'], '.3g', oom)} | "
                  f"{_fmt(row['m_step_s_per_example'], '.3g', oom)} | {_fmt(row['total_s_per_example'], '.3g', oom)} | "
                  f"{_fmt(row['e_step_peak_gib'], '.1f', oom)} | {_fmt(row['m_step_peak_gib'], '.1f', oom)} | "
                  f"{_fmt(row.get('peak_reserved_gib'), '.1f', oom)} | {_fmt(row['speedup_vs_full'], '.2f', False)} | "
                  f"{_fmt(row['memory_ratio_full_over_this'], '.2f', False)} | "
                  f"{_fmt(row.get('late_m_step_s_per_example'), '.3g', oom)} | "
                  f"{_fmt(row.get('late_total_s_per_example'), '.3g', oom)} | "
                  f"{_fmt(row.get('late_speedup_vs_full'), '.2f', False)} |")
        print()
    if "throughput" in results:
        print(f"### Anchor pass over B rows, response-only chunked log-probs (k = {sizes['k']}, median of "
              f"{sizes['repeats']} after {sizes['warmups']} warm-up(s))\n")
        print("| pass | B | ms | tokens/s | vs plain | peak GiB |")
        print("|---|---|---|---|---|---|")
        for row in results["throughput"]["rows"]:
            oom = row["oom"]
            print(f"| {row['pass']} | {row['batch']} | {_fmt(row['ms'], '.1f', oom)} | "
                  f"{_fmt(row['tokens_per_s'], ',.0f', oom)} | {_fmt(row['ratio_vs_plain'], '.2f', False)} | "
                  f"{_fmt(row['peak_gib'], '.1f', oom)} |")
        print()
    if "profile" in results:
        _print_profile(results["profile"], results.get("ceilings", {}).get("copy_tbs"))
    if "cache" in results:
        cache = results["cache"]
        print(f"### The cache stage's passes: n = {results['examples']} examples, one call per example "
              f"(`reference_terms_batch`, at most {cache['rows_per_pass']} rows a pass), each example's prompt "
              "run once per pass (shared) or with every response (per row); median of "
              f"{sizes['repeats']} after {sizes['warmups']} warm-up(s)\n")
        print("| m' | contractions | prompts | s/ex | peak GiB | speedup vs shared | log pi_ref gap, nats | "
              "busy s/ex | busy / wall | kernels/ex |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in cache["rows"]:
            oom, profile = row["oom"], row.get("profile") or {}  # no profile: an OOM, or a run before it existed
            busy_s = profile["busy_ms"] / 1000 if profile else None
            print(f"| {row['m_prime']} | {str(row['contractions']).lower()} | {row['prompts']} | "
                  f"{_fmt(row['s_per_example'], '.3g', oom)} | {_fmt(row['peak_gib'], '.1f', oom)} | "
                  f"{_fmt(row['speedup_vs_shared'], '.2f', False)} | {_fmt(row['logp_gap'], '.3g', False)} | "
                  f"{_fmt(busy_s, '.3g', oom)} | "
                  f"{_fmt(busy_s / row['s_per_example'] if profile else None, '.2f', oom)} | "
                  f"{_fmt(profile.get('kernels'), 'd', oom)} |")
        print("\nbusy: the first example's call once under torch.profiler, the device's kernels (on the CPU, the "
              "aten ops' CPU time); wall: the timed s/ex.\n")
        profiles = {(row["contractions"], row["prompts"]): row.get("profile") for row in cache["rows"]}
        for contractions in (True, False):
            shared, per_row = profiles[contractions, "shared"], profiles[contractions, "per row"]
            if shared and per_row:
                print(f"Where the time of one call {'with' if contractions else 'without'} contractions goes, per row "
                      "against shared prompts:\n")
                _print_op_table(("shared", shared), ("per row", per_row))
    if "check" in results:
        check = results["check"]
        print(f"### Agreement: {check['rows']} rows, all k adapters mixed in one pass, against PEFT (one adapter "
              f"at a time) in {check['dtype']} and MultiLoRA in {check['wide_dtype']}; max |difference| of "
              f"log pi(y|x), nats (mean |log pi| {check['mean_abs_logp']:.1f})\n")
        print("| ours vs PEFT | ours vs wide | PEFT vs wide | adapter effect | base: batched vs alone | "
              "base vs wide | base, padded rows: no mask vs padding mask | base, lean modules vs transformers' "
              "(log pi and input gradients) | transformers' run twice |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {check['ours_vs_peft']:.3g} | {check['ours_vs_wide']:.3g} | {check['peft_vs_wide']:.3g} | "
              f"{check['adapter_effect']:.3g} | {check['base_batch_shape']:.3g} | {check['base_vs_wide']:.3g} | "
              f"{_fmt(check.get('padding_mask'), '.3g', False)} | {_fmt(check.get('lean_vs_stock'), '.3g', False)} | "
              f"{_fmt(check.get('stock_vs_stock'), '.3g', False)} |\n")
        if "padding_mask_input_grads" in check:
            print(f"Padded rows' input gradients, no mask against the padding mask: largest gap "
                  f"{check['padding_mask_input_grads']:.3g} of the largest gradient.\n")
        if "shared_prompts" in check:
            print(f"The base model's rows through the shared-prompt pass (each row its own prompt, all of one "
                  f"length: the continuation under a bottom-right causal bias) against the same rows whole: "
                  f"log pi {check['shared_prompts']:.3g} nats, input gradients "
                  f"{check['shared_prompts_input_grads']:.3g} of the largest gradient.\n")
        if "target_terms_vs_wide" in check:
            print(f"The base model's target terms (each row's tokens against the other rows' in its contexts; mean "
                  f"|u| {check['mean_abs_target_term']:.3g} nats): {check['dtype']} against {check['wide_dtype']} "
                  f"{check['target_terms_vs_wide']:.3g}, through the shared-prompt pass against whole rows "
                  f"{check['shared_prompts_target_terms']:.3g}.\n")
        print("Base model's batched-vs-alone and dtype gaps: what every delta starts from when the cache computed "
              "log pi_ref in another pass shape or dtype (the train stage's reference_gap). Padded rows: moplex's "
              "unmasked pass against the padding mask it used before, the same rows.\n")
        if check.get("host_waits"):
            print("Where a pass makes the host wait for the GPU (torch.cuda.set_sync_debug_mode):\n")
            print("| pass | waits |\n|---|---|")
            for name, sites in check["host_waits"].items():
                print(f"| {name} | {'; '.join(sites) or 'none'} |")
            print()
    if "ceilings" in results:
        top = results["ceilings"]
        print(f"{top['dtype']} matmul, {top['n']}^3: {top['matmul_tflops']:.1f} TFLOP/s; device-to-device copy "
              f"moving {top['copy_gib']:.3g} GiB: {top['copy_tbs']:.3g} TB/s")


def _print_profile(profile: dict[str, Any], copy_tbs: float | None) -> None:
    plain, multi = profile["plain"], profile["multi_lora"]
    print(f"### Where the anchor pass's time goes: B = {profile['batch']} rows (the one-pair passes: the rows "
          "they name), wall time as above, then one profiled pass (torch.profiler; self time of each aten op's "
          "kernels, CPU time on the CPU)\n")
    print("| pass | wall ms | busy ms | busy / wall | kernels |")
    print("|---|---|---|---|---|")
    passes = ((PLAIN, plain), (MULTI_E, multi), (MULTI_E_PROMPT_PASS, profile.get("multi_lora_prompt_pass")),
              (MULTI_M, profile.get("multi_lora_m")), (MULTI_M_PROMPT_PASS, profile.get("multi_lora_m_prompt_pass")))
    pairs = [(f"{MULTI_M_ONE_PAIR}: {row['rows']} rows", row) for row in profile.get("m_step_pairs", [])]
    for label, row in (*passes, *pairs):
        if row is not None:  # a run from before the later rows existed (--resume, a report) has fewer
            print(f"| {label} | {row['wall_ms']:.1f} | {row['busy_ms']:.1f} | {row['busy_ms'] / row['wall_ms']:.2f} | "
                  f"{_fmt(row['kernels'], 'd', False)} |")
    print()
    _print_op_table(("plain", plain), ("multi-LoRA", multi))
    at_copy_rate = "" if copy_tbs is None else f", {profile['lora_extra_gb'] / copy_tbs:.3g} ms at the copy rate below"
    print(f"The LoRA path's extra memory traffic, counted (each tensor read or written once per kernel): "
          f"{profile['lora_extra_gb']:.3g} GB per pass{at_copy_rate}; measured wall-time difference "
          f"{multi['wall_ms'] - plain['wall_ms']:.3g} ms.\n")


def _print_op_table(base: tuple[str, dict[str, Any]], other: tuple[str, dict[str, Any]]) -> None:
    """Two profiled passes side by side, per aten op (the PROFILE_TOP longest in either, the rest in
    one row): self time, calls, and the second's time minus the first's."""
    (base_name, base_ops), (other_name, other_ops) = ((name, profile["ops"]) for name, profile in (base, other))
    none = {"ms": 0.0, "calls": 0}
    keys = sorted(base_ops.keys() | other_ops.keys(),
                  key=lambda key: (-max(base_ops.get(key, none)["ms"], other_ops.get(key, none)["ms"]), key))
    print(f"| aten op | {base_name} ms | {base_name} calls | {other_name} ms | {other_name} calls | difference ms |")
    print("|---|---|---|---|---|---|")
    for key in keys[:PROFILE_TOP]:
        theirs, mine = base_ops.get(key, none), other_ops.get(key, none)
        print(f"| {key} | {theirs['ms']:.2f} | {theirs['calls']} | {mine['ms']:.2f} | {mine['calls']} | "
              f"{mine['ms'] - theirs['ms']:+.2f} |")
    rest = [sum(ops[key]["ms"] for key in keys[PROFILE_TOP:] if key in ops) for ops in (base_ops, other_ops)]
    if len(keys) > PROFILE_TOP:
        print(f"| {len(keys) - PROFILE_TOP} other ops | {rest[0]:.2f} | | {rest[1]:.2f} | | {rest[1] - rest[0]:+.2f} |")
    print()


def plot_figure5(results: dict[str, Any], path: Path) -> None:
    """Time per example (left) and peak memory (right) vs m', one line per method; OOM left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # only here: the tables need no matplotlib
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    FigureCanvasAgg(figure)
    time_axes, memory_axes = figure.subplots(1, 2)
    lines = dict.fromkeys((row["method"], row["prompts"]) for row in results.get("em", []))
    for method, prompts in lines:
        points = [r for r in results["em"] if (r["method"], r["prompts"]) == (method, prompts) and not r["oom"]]
        m_primes = [r["m_prime"] for r in points]
        style = {"marker": "o", "linestyle": "-" if prompts == "shared" else "--",
                 "label": method if prompts == "shared" else f"{method}, prompt per row"}
        time_axes.plot(m_primes, [r["total_s_per_example"] for r in points], **style)
        if all(r["peak_gib"] is not None for r in points):
            memory_axes.plot(m_primes, [r["peak_gib"] for r in points], **style)
    m_primes = sorted({row["m_prime"] for row in results.get("em", [])})
    time_axes.set(xlabel="m' (responses per example)", ylabel="runtime per example (s)", xticks=m_primes,
                  title="one EM iteration (E-step + M-step)")
    memory_axes.set(xlabel="m' (responses per example)", ylabel="peak memory (GiB)", xticks=m_primes,
                    title="peak GPU memory")
    if not memory_axes.lines:
        memory_axes.text(0.5, 0.5, "measured on CUDA only", ha="center", va="center", transform=memory_axes.transAxes)
    for axes in (time_axes, memory_axes):
        if axes.lines:
            axes.legend()
    figure.suptitle(f"Full computation vs MoPLEx anchors, k = {results['sizes']['k']}: {results['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
