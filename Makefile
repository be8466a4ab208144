# Quickstart: `make train` (sets everything up, then trains the embedded default), `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel of torch is pinned for machines without CUDA; on a GPU node pip's default build is used.
TORCH_CPU ?= torch==2.13.0
STAMP  := $(VENV)/.setup-done

.PHONY: setup train lint test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "[setup] CUDA device found: installing the default torch build"; $(PIP) install -q torch; \
	else \
	    echo "[setup] no CUDA device: installing the CPU torch ($(TORCH_CPU))"; $(PIP) install -q $(TORCH_CPU); \
	fi
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)
	@echo "[setup] done: $(VENV)"

# The default job as a real 2-stage PipeDream-2BW pipeline: two processes, one stage each (gloo on CPU).
NPROC ?= 2
train: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) pretrain.py parallel.pp=$(NPROC) schedule=2bw

# Lint first: it takes a second and fails before twenty minutes of tests do.
lint: setup
	$(VENV)/bin/ruff check .

# Then the equivalence tier (pytest -m equivalence) a second time on other CPU kernels: ATen's scalar kernels
# instead of the vectorized ones its run-time dispatch picks (their reductions sum in another order) and
# MKL's SSE2 code path (another sgemm blocking). Any x86-64 CPU runs both, so a comparison that holds for
# one kernel choice only fails here, not first on someone else's machine.
OTHER_KERNELS ?= ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
test: lint
	$(PY) -m pytest -q
	$(OTHER_KERNELS) $(PY) -m pytest -q -m "equivalence and not slow and not gpu"

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

bench: setup
	$(PY) bench/step.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
