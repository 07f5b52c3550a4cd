#!/usr/bin/env bash
# The measurements a session with the H200 takes (issue 9; README, "GPU efficiency"), one device call
# per step, each under the machine's 10-minute limit: `bash benchmarks/gpu_session.sh STEP`, run from
# the repository root on the GPU machine (its torch, transformers and peft; nothing carried but
# `.whl` for step 4). Everything lands under $OUT, which the device tool returns.
#
#   1  the tiny model through every CUDA path (seconds), then the anchor-pass table, the checks and
#      the profile: the 12-row mixed pass against 0.9x of the plain model, host waits, kernels
#   2  the EM section at m' = 26 and 32 (Figure 5's rows that carry the targets), one pair a step
#   3  the EM section at m' = 26 at the pipeline's minibatch (16 pairs a step) in 16-row passes
#   4  the pipeline's own stages on the card (benchmarks/pipeline_stages.py): first `make gpu-wheels`
#      here, then carry `.whl`
#
# A step cut by its deadline writes what it measured; rerun it with RESUME=$OUT/.../em_gpu.json (a
# previous call's file, fetched back) to measure only what is missing.
set -euo pipefail
step=${1:?"which step: 1, 2, 3 or 4 (see the top of this file)"}
out=${OUT:?"set OUT to the folder the results go to (the device tool sets it)"}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
resume=(${RESUME:+--resume "$RESUME"})

case "$step" in
  1)
    python3 benchmarks/em_gpu.py --smoke --out "$out/smoke"
    python3 benchmarks/em_gpu.py --out "$out/passes" --sections check,throughput,profile --deadline 440 "${resume[@]}"
    ;;
  2)
    python3 benchmarks/em_gpu.py --out "$out/em" --sections em --m-primes 26,32 --deadline 470 "${resume[@]}"
    ;;
  3)
    python3 benchmarks/em_gpu.py --out "$out/minibatch" --sections em --m-primes 26 --pairs-per-step 16 \
      --score-batch-size 16 --deadline 470 "${resume[@]}"
    ;;
  4)
    ls .whl/*.whl > /dev/null || { echo "no .whl/: run 'make gpu-wheels' here and carry .whl" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/pipeline_stages.py --root /tmp/root | tee "$out/pipeline_stages.txt"
    ;;
  *)
    echo "unknown step $step: 1, 2, 3 or 4" >&2
    exit 2
    ;;
esac
