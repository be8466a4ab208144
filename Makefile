# Quickstart: `make train` (sets everything up, then trains the embedded default), `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel of torch is pinned for machines without CUDA; on a GPU node pip's default build is used.
TORCH_CPU ?= torch==2.13.0
STAMP  := $(VENV)/.setup-done

.PHONY: setup train lint test test-equivalence-again test-matrix test-slurm test-slurm-ci test-all bench clean gpu-trace-env gpu-trace gpu-wheels gpu-check

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

# The default job as a real 2-stage PipeDream-2BW pipeline: two processes, one stage each (gloo on CPU). Through
# launch.local (torchrun underneath): a config error is one line before anything starts, Ctrl-C checkpoints.
NPROC ?= 2
train: setup
	$(VENV)/bin/python -m launch.local --nproc-per-node $(NPROC) -- parallel.pp=$(NPROC) schedule=2bw

# Lint first: it takes a second and fails before twenty minutes of tests do.
lint: setup
	$(VENV)/bin/ruff check .

# Then the equivalence tier (pytest -m equivalence) a second time on other CPU kernels: ATen's scalar kernels
# instead of the vectorized ones its run-time dispatch picks (their reductions sum in another order) and
# MKL's SSE2 code path (another sgemm blocking). Any x86-64 CPU runs both, so a comparison that holds for
# one kernel choice only fails here, not first on someone else's machine. The whole tier would add more
# than the ~4 minutes CI can spare; EQUIVALENCE_AGAIN keeps one test of each kind of comparison (simulator
# vs hand-written rules, bitwise pipeline vs simulator in fp32 and bf16, DP, TP, EP, sharded Muon, the
# Megatron loop, the non-finite skip, resume, the head split's row blocks) and leaves out those that repeat
# a kind on more schedules (test_pipeline_equivalence's other cases, test_checkpoint_resume,
# test_preemption, the other resume cases). `make test-equivalence-again EQUIVALENCE_AGAIN=tests` runs all of it.
OTHER_KERNELS ?= ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
EQUIVALENCE_AGAIN ?= tests/unit/test_simulator.py tests/unit/test_staleness_corrections.py \
	tests/unit/test_router_balancing.py tests/unit/test_tp_plan.py \
	'tests/unit/test_resume.py::test_resumed_run_equals_uninterrupted_bitwise[2bw-extra0]' \
	tests/unit/test_mixed_precision.py::test_fp32_precision_is_bit_identical_to_no_precision_option \
	tests/unit/test_mixed_precision.py::test_bf16_two_stage_pipeline_equals_the_bf16_simulator \
	tests/dist/test_tensor_parallel.py tests/dist/test_expert_parallel.py \
	tests/dist/test_muon_distributed.py tests/dist/test_megatron_api.py tests/dist/test_faults.py \
	tests/dist/test_pipeline_equivalence.py::test_four_stage_2bw_hybrid_moe_with_sync_start_and_eval \
	tests/dist/test_pipeline_equivalence.py::test_data_parallel_two_replicas_equal_one_with_twice_the_microbatches \
	tests/dist/test_vocab_parallel_pipeline.py
test: lint
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory test-equivalence-again

test-equivalence-again: setup
	$(OTHER_KERNELS) $(PY) -m pytest -q -m "equivalence and not slow and not gpu" $(EQUIVALENCE_AGAIN)

# The real-slurm tier (tests/slurm, docs/launch.md): launch.slurm jobs on a two-node slurm cluster that the tests
# start on this machine (root and network namespaces; launch/testing/cluster.py installs slurm-wlm and munge when
# they are missing) and stop again; the cluster is taken down after pytest whatever happened to it.
test-slurm: setup
	$(PY) -m pytest -q -m slurm tests/slurm; rc=$$?; $(PY) -m launch.testing.cluster down; exit $$rc

# CI's share of the slurm tier (.ci/run; the whole tier takes longer than CI can spare): one two-node job against
# torchrun --standalone, and the preemption with its requeue and resume. On a cluster without accounting (slurmdbd
# and MariaDB: packages and start-up these two do not need; the preemption test reads slurmctld's job completion
# log). `up` installs the packages when they are missing and fails if it cannot; the cluster is stopped whatever
# happened, and the exit code is the first failure's.
SLURM_CI_TESTS ?= tests/slurm/test_jobs.py::test_two_node_job_equals_torchrun_standalone \
	tests/slurm/test_jobs.py::test_preemption_checkpoints_requeues_under_the_same_id_and_resumes_exactly
test-slurm-ci: setup
	$(PY) -m launch.testing.cluster up --no-accounting && $(PY) -m pytest -q -m slurm --durations=0 $(SLURM_CI_TESTS); \
	rc=$$?; $(PY) -m launch.testing.cluster down || rc=$$((rc ? rc : 1)); exit $$rc

# Everything but the GPU tests and the slurm tier (which starts a cluster of its own: make test-slurm).
test-all: setup
	$(PY) -m pytest -q -m "not gpu and not slurm"

# The covering matrix (issue 30): every accepted case of the pairwise cover as a real pipeline against the
# simulator, every pair no accepted case holds checked for its refusal (tests/matrix/).
test-matrix: setup
	$(PY) -m pytest -q -m "not gpu" tests/matrix

# The pipeline's measured throughput and bubble, 1F1B against 2BW side by side (bench/pipeline.py: table and JSON).
bench: setup
	$(PY) bench/pipeline.py --out bench_results/pipeline.json

# The fake-CUDA trace (issue 33, docs/gpu.md "Before the first GPU"): PyTorch's CUDA build in a side environment,
# never in .venv (whose CPU wheel the whole suite runs on). FakeTensorMode makes cuda:0 tensors with it on a machine
# without a GPU. About 5 GB with the nvidia-* wheels. The project itself is not installed there: the trace runs
# with PYTHONPATH pointing at the checkout, and only the packages its imports need come along.
CUDA_VENV  := .venv-cuda
TORCH_CUDA ?= torch==2.14.1
CUDA_STAMP := $(CUDA_VENV)/.setup-done
gpu-trace-env: $(CUDA_STAMP)

$(CUDA_STAMP):
	@test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install -q --upgrade pip
	$(CUDA_VENV)/bin/python -m pip install -q $(TORCH_CUDA) numpy omegaconf hydra-core tqdm pytest
	@touch $(CUDA_STAMP)
	@echo "[gpu-trace-env] done: $(CUDA_VENV)"

# The fake-CUDA forward of every stage of the paper layouts (bench/fake_cuda_forward.py): kernels run, device
# mixes and host reads (none expected); and the meta trace of their training steps (bench/trace_layouts.py).
gpu-trace: $(CUDA_STAMP) setup
	PYTHONPATH=$(CURDIR) $(CUDA_VENV)/bin/python bench/fake_cuda_forward.py --out bench_results
	$(PY) bench/trace_layouts.py --out bench_results

# A lent GPU (issue 45, docs/gpu.md "make gpu-check"): `make gpu-wheels` here (network) fetches what the device lacks
# into .gpu/wheels (ignored; megatron-core, FLA, hydra/omegaconf for its python 3.12, ~4 MiB); on the device
# `make gpu-check` installs them without network and writes ONE JSON (bench, profile, pytest -m gpu, the model's
# prediction) within ~9 minutes. GPU_PY: the device's python3 (it holds torch 2.11.0+cu130); not the CPU .venv.
GPU_WHEELS ?= .gpu/wheels
GPU_PY     ?= python3
OUT        ?= bench_results
GPU_PINS   := megatron-core==0.16.1 flash-linear-attention==0.6.0 fla-core==0.6.0 hydra-core==1.3.2 omegaconf==2.3.0
gpu-wheels: setup
	mkdir -p $(GPU_WHEELS)
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) $(GPU_PINS)
	$(PIP) wheel -q --no-deps -w $(GPU_WHEELS) antlr4-python3-runtime==4.9.3  # an sdist only: built here, pure Python
	@size=$$(du -sm $(GPU_WHEELS) | cut -f1); ls -l $(GPU_WHEELS); echo "[gpu-wheels] $$size MiB in $(GPU_WHEELS)"; \
		test $$size -le 60 || { echo "[gpu-wheels] over the 60 MiB a device call may carry"; exit 1; }

gpu-check:
	$(GPU_PY) bench/gpu_check.py --wheels $(GPU_WHEELS) --out $(OUT)/gpu_check.json

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
