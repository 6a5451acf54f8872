# Two user-facing set-up commands (see README.md):
#   make demo   install into .venv and run the main job on the built-in tiny model
#   make test   install into .venv and run the test suite
# On a GPU machine (docs/gpu_check.md): make gpu-check; make gpu-wheels fetches what a lent GPU machine lacks.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -q

.PHONY: install demo test bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# A GPU machine keeps its CUDA torch; a CPU machine gets the CPU wheel (a looser pin pulls a CUDA build).
	if python3 -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "CUDA torch found on the system: linking it into the venv"; \
		python3 -c "import torch,os; print(os.path.dirname(os.path.dirname(torch.__file__)))" > $$($(PY) -c "import site; print(site.getsitepackages()[0])")/system_torch.pth; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[dev,serve]'
	$(PY) .ci/check_install.py dev serve
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m runner generate --model tiny-qwen3-moe --data-parallel-size 2 --enable-expert-parallel \
		--enable-dbo --dbo-decode-token-threshold 4 --dbo-prefill-token-threshold 16 --dbo-cost-model off \
		--emulate-link latency_us=50,gbps=10 --max-tokens 16 --num-prompts 8

# The DBO, SBO, LL/HT all-to-all and CUDA-graph (CPU stand-in) tests run a second time under the stream-order
# sanitizer (ubatch/testing/stream_sanitizer.py): a missing stream wait fails there, though CPU hides it.
# (The DeepEP/DeepGEMM stand-in and sanitizer tests turn it on themselves.) -rs lists every skip and its reason.
# Not listed: files whose every test runs all its kernels on one CPU stream (the overlap loop's, the wrapper's
# own), where the sanitizer has no pair of streams to order and so cannot fail; they run on a GPU in gpu-check.
SANITIZED_TESTS ?= tests/test_moe_ep.py tests/test_sbo.py tests/test_cudagraph_dispatch.py \
	tests/test_e2e_dbo.py tests/test_moe_padding_and_sizing.py tests/test_graph_memory.py tests/test_graph_head.py

# The suite runs on TEST_WORKERS pytest-xdist processes (0: in this one), a file to a worker (module fixtures such
# as a started server are set up once). Much of it waits on child processes, servers and timeouts, so two
# workers halve the wall time on a 2-core machine. Every test holds its own ports, sockets and temporary files.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -rs $(XDIST) $(PYTEST_ARGS)
	OMP_NUM_THREADS=1 $(PY) -m pytest -rs $(XDIST) --stream-sanitizer $(PYTEST_ARGS) $(SANITIZED_TESTS)

# The Triton tests again on the oldest Triton that setup.cfg allows (triton>=3.6: torch 2.11 pins 3.6.0 on the
# GPU machines), in a venv of their own with the CPU torch wheel; the kernels run in Triton's interpreter and
# are compiled ahead of time for sm_90 (tests/triton_compile_check.py). Not part of `make test`; .ci/run runs it.
TRITON_MIN ?= 3.6.0
TRITON_MIN_VENV ?= build/venv-triton-min
TRITON_MIN_TESTS ?= tests/test_triton_paged_decode.py tests/test_experts.py tests/test_moe_ep.py tests/test_attention_options.py \
	tests/test_triton_tails.py tests/test_fused_draw.py tests/test_graph_head.py

$(TRITON_MIN_VENV)/.installed: setup.cfg pyproject.toml
	test -x $(TRITON_MIN_VENV)/bin/python || python3 -m venv $(TRITON_MIN_VENV)
	$(TRITON_MIN_VENV)/bin/python -m pip install -q torch==2.13.0 triton==$(TRITON_MIN) 'pytest>=8' 'pytest-xdist>=3.5' 'hypothesis>=6.100'
	$(TRITON_MIN_VENV)/bin/python -m pip install -q -e .
	touch $@

.PHONY: test-triton-min
test-triton-min: $(TRITON_MIN_VENV)/.installed
	$(TRITON_MIN_VENV)/bin/python -c "import triton, sys; sys.exit(triton.__version__ != '$(TRITON_MIN)' and 'expected triton $(TRITON_MIN), got ' + triton.__version__)"
	OMP_NUM_THREADS=1 $(TRITON_MIN_VENV)/bin/python -m pytest -rs $(XDIST) $(PYTEST_ARGS) -k triton $(TRITON_MIN_TESTS)

bench: install
	$(PY) benchmarks/report.py

# One prepared command that proves the GPU paths on one NVIDIA GPU in at most 7 minutes (docs/gpu_check.md):
# report.md and results.json in GPU_CHECK_OUT; exits 2 without a GPU. No install step: it runs with the
# venv's Python when there is one, else the system python3 (a lent GPU machine: `make gpu-check PY=python3`).
GPU_CHECK_OUT ?= build/gpu-check
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)

.PHONY: gpu-check gpu-wheels
gpu-check:
	GPU_CHECK_OUT=$(GPU_CHECK_OUT) $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The cp312 wheels a lent GPU machine lacks (greenlet, the server's stack), into .whl/ (ignored by git).
gpu-wheels:
	$(GPU_PY) benchmarks/gpucheck/wheels.py

clean:
	rm -rf $(VENV) *.egg-info
