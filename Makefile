# Two commands on a fresh machine:
#   make demo   -- the MoE layer demo (GPUs when present, else the CUDA simulator, 2 emulated ranks)
#   make test   -- lint, then the CPU suite: references, schedule, kernels under the simulator, sm_90 typing
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mok-installed

.PHONY: demo test lint test-sim test-sim-a test-sim-b test-ptx test-gpu bench-schedule clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 CPU build first (the test extra's range then installs nothing more)
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.10" --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo

# Seconds, no GPU: every config field is read somewhere in the library, no dead code
# (vulture; false positives listed in tools/vulture_allow.py), README's tables match
# benchmarks/results/*.json and Layer.nbytes.
LIBRARY := mok_core mok_comm mok_torch mok_jax_adapter mok_testing
lint: $(STAMP)
	$(PY) tools/check_config_fields.py
	$(PY) -m vulture $(LIBRARY) tools/vulture_allow.py --min-confidence 80
	$(PY) benchmarks/report.py --check
	$(PY) tools/memory_table.py --check

# lint first (cheap), then the simulator suite in two halves (one Python process is one core:
# the simulator's block threads share its GIL) beside the PTX compiles, niced; each one's
# output is printed whole when it ends. SIM_A holds about half the simulator time (balanced
# on a CI run's two halves: the other half is every file not listed, new ones included).
SIM_A := tests/test_grouped_gemm.py tests/test_gemm_non_finite.py \
         tests/test_gemm_wgrad.py tests/test_layer_step.py tests/test_torch_module.py \
         tests/test_gemm_dgrad.py tests/test_intrinsics.py tests/test_gemm_fp8.py \
         tests/test_torch_adapter.py
SIM_PYTEST := NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -q -p no:cacheprovider --durations=5

test: $(STAMP)
	$(MAKE) lint
	$(MAKE) -j3 --output-sync=target test-sim-a test-sim-b test-ptx PTX_NICE="nice -n 15"

test-sim: test-sim-a test-sim-b

test-sim-a: $(STAMP)
	$(SIM_PYTEST) $(SIM_A)

test-sim-b: $(STAMP)
	$(SIM_PYTEST) tests --ignore=tests/gpu --ignore=tests/ptx $(addprefix --ignore=,$(SIM_A))

test-ptx: $(STAMP)
	NUMBA_ENABLE_CUDASIM=0 $(PTX_NICE) $(PY) -m pytest -q -p no:cacheprovider tests/ptx

# On a GPU host (see README): the multi-process GPU suite.
test-gpu:
	torchrun --standalone --nproc-per-node=$${NPROC:-2} -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
