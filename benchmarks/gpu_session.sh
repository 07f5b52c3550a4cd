#!/usr/bin/env bash
# The measurements a session with the H200 takes (issue 9; docs/gpu-efficiency.md), one device call
# per step, each under the machine's 10-minute limit: `bash benchmarks/gpu_session.sh STEP`, run from
# the repository root on the GPU machine (its torch, transformers and peft; nothing carried but
# `.whl` for step 2). Everything lands under $OUT, which the device tool returns.
#
#   1  the tiny model through every CUDA path (seconds; its tables print, its files stay on the card),
#      then the card's ceilings, the anchor-pass table, the checks, the profile (the 12-row mixed
#      pass against 0.9x of the plain model, host waits, kernels; the M-step pass of one pair at a = 6
#      and at m' = 26 rows, whether the small one waits on its host) and the cache stage's passes with
#      shared prompts and per row, timed and profiled (what cache.share_prompts auto chooses on a GPU)
#   2  the pipeline's own stages on the card (benchmarks/pipeline_stages.py, about two minutes): first
#      `make gpu-wheels` here, then carry `.whl`
#   3  the EM section at m' = 26 at the pipeline's minibatch (16 pairs a step) in 16-row passes
#   4  the EM section at m' = 26 and 32 (Figure 5's rows that carry the targets), one pair a step
#   5  step 4's m' = 26 with every decoder layer checkpointed (train.gradient_checkpointing): its time
#      and memory against step 4's; only if the session's time allows after the four above
#
# The session's 30 minutes of device time count from the first call's start (a minute or more) to the
# machine's return, idle time included, and a machine idle for 30 s goes back (the next call starts a
# fresh one): make the four calls back to back, in this order, with a timeout_s of at most the time
# left. The deadlines start nothing new after that many seconds (a configuration already started runs
# on, up to a minute at m' = 32), so the four fit in the 30 minutes; the device tool returns at most 8
# files a call (step 1 writes 7: five traces, em_gpu.json, em_gpu.png). A step cut by its deadline
# writes what it measured; to measure only what is missing, copy the returned em_gpu.json into the
# checkout (a path git does not ignore, so that it travels) and rerun the step with RESUME=that/path.
set -euo pipefail
step=${1:?"which step: 1 to 5 (see the top of this file)"}
out=${OUT:?"set OUT to the folder the results go to (the device tool sets it)"}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
resume=(${RESUME:+--resume "$RESUME"})

case "$step" in
  1)
    python3 benchmarks/em_gpu.py --smoke --out "$(mktemp -d)"
    python3 benchmarks/em_gpu.py --out "$out/passes" --sections ceilings,check,throughput,profile,cache --deadline 380 \
      "${resume[@]}"
    ;;
  2)
    ls .whl/*.whl > /dev/null || { echo "no .whl/: run 'make gpu-wheels' here and carry .whl" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/pipeline_stages.py --root /tmp/root | tee "$out/pipeline_stages.txt"
    ;;
  3)
    python3 benchmarks/em_gpu.py --out "$out/minibatch" --sections em --m-primes 26 --pairs-per-step 16 \
      --score-batch-size 16 --deadline 420 "${resume[@]}"
    ;;
  4)
    python3 benchmarks/em_gpu.py --out "$out/em" --sections em --m-primes 26,32 --deadline 400 "${resume[@]}"
    ;;
  5)
    python3 benchmarks/em_gpu.py --out "$out/checkpointed" --sections em --m-primes 26 --gradient-checkpointing \
      --deadline 400 "${resume[@]}"
    ;;
  *)
    echo "unknown step $step: 1 to 5" >&2
    exit 2
    ;;
esac
