# make test / make demo work on a fresh clone: they create .venv and install the project with its pins.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test test-fast demo study compare chaos mutants bench gpu-wheels lock clean

# constraints.txt pins every package: the same versions on every clone give the same artifacts on
# the same CPU (the tiny model's files record the transformers version that saved them, so even a
# transformers release that computes the same floats gives other versions from augment on).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# pip (not uv/poetry) sees the local torch 2.13.0 CPU wheel; the grep drops pip's index noise.
	$(BIN)/pip install -q -c constraints.txt -e '.[test,bench]' 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
	touch $(STAMP)

# After upgrading a package in .venv (and running the tests): pin what .venv now holds. Local version
# labels (torch's +cpu) are dropped: torch==2.13.0 takes the CPU wheel where pip's find-links has it
# (a local label sorts above the plain release) and PyPI's build elsewhere, where 2.13.0+cpu is not.
lock: $(STAMP)
	{ sed -n '1,3p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v '^-e' | sed 's/+[^+]*$$//'; } \
		> constraints.txt.new
	mv constraints.txt.new constraints.txt

# One pytest worker per core, at most 4 (pytest-xdist): most tests use one core (one torch thread, or
# a subprocess the test waits on). Whole files per worker (loadfile), so module fixtures (a tiny model,
# a cache, a trained mixture) are built once: on 2 cores the suite took 5:43 against 10:16 on one
# worker and 6:46 spreading single tests (2026-11-23).
XDIST := -n auto --maxprocesses 4 --dist loadfile

test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow"

# The whole pipeline on the synthetic-demo preset with a tiny offline model, on Prefect's local server.
demo: $(STAMP)
	$(BIN)/moplex run synthetic-demo --threads 1

# The identifiability study (paper figure 4) at a size that finishes in a few minutes.
study: $(STAMP)
	$(BIN)/moplex experiment identifiability --out data/artifacts/experiments/identifiability \
		--n 1000 --seeds 2 --max-iter 40 --restarts 1

# Every baseline and ablation x 3 seeds on the synthetic-compare preset (paper Tables 3 and 4 shape).
compare: $(STAMP)
	$(BIN)/moplex experiment compare --seeds 3 --threads 1

# SIGKILL every stage at 13 seeded points, rerun, compare with uninterrupted runs; then the bad-input
# catalogue. Prints both tables and counts; about 4 minutes on 2 cores (tests/test_chaos.py runs the
# short schedule). `python -m chaos --help` for --seed and --short.
chaos: $(STAMP)
	$(BIN)/python -m chaos

# Every bug of chaos/mutant_catalogue.py put into a copy of the checkout, one at a time, against the test
# modules that must catch it; about 70 minutes on 2 cores (`python -m chaos.mutants --only ID,ID` for some).
mutants: $(STAMP)
	$(BIN)/python -m chaos.mutants

bench: $(STAMP)
	$(BIN)/python benchmarks/pl_core.py

# pydantic's wheels for the lent GPU machine (Python 3.12; it has torch, transformers and peft but no
# pydantic), at this venv's versions, into .whl/ (git-ignored), for benchmarks/pipeline_stages.py there:
# the `run` call carries .whl and installs it first (docs/gpu-efficiency.md).
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection typing-extensions
gpu-wheels: $(STAMP)
	rm -rf .whl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(BIN)/python -c 'import importlib.metadata as m, sys; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
		$(GPU_WHEELS)) 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }

clean:
	rm -rf $(VENV) data/artifacts .pytest_cache .whl
