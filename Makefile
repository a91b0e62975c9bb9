# flashdecode: every target sets up what it needs on a fresh machine.
#   make test       CPU suite (Triton kernels in the interpreter) in .venv
#   make demo       the same set-up, then `flashdecode demo`
#   make test-compat  the kernels' interpreter tests and sm_90 compile checks under Triton 3.9 in .venv-compat
#                   (or an existing Triton 3.9 venv: COMPAT_VENV=/path/to/venv)
#   make gpu-check  on the GPU machine: GPU tests, fuzz, memcheck + quick benchmarks, JSON/PNG to $OUT (never
#                   reinstalls torch); one part per command fits 10 minutes: GPU_CHECK_ARGS="--only tests-kernels"
#   make peer-wheels  here: FlashInfer's wheels into .whl/ (ignored by git); carried to the GPU machine, gpu-check
#                   installs them there (--no-deps) so FlashInfer joins the benchmarks as a peer
#   make serve-wheels  here: FastAPI / uvicorn / openai wheels into .whl/ for the GPU machine's serve tests

VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
# CPU-only machines get the CPU build of torch from local disk; an unpinned torch would pull a multi-GB CUDA build.
CPU_PINS  := torch==2.13.0 triton==3.6.0 "numpy<2.3"
PYTEST_WORKERS ?= 2
HAS_GPU   := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

ifeq ($(HAS_GPU),1)
# GPU machine: torch is already there and must not be reinstalled; run from the source tree.
RUN       := PYTHONPATH=$(CURDIR) python3
SETUP     :=
else
RUN       := TRITON_INTERPRET=1 $(PY)
SETUP     := $(STAMP)
endif

# Triton 3.9 (what the newest torch pins) in a second venv: the interpreter tests of every kernel family and the sm_90
# compile checks (not part of `make test` / CI; one worker on a shared 2-core machine: 5 minutes with Triton's compile
# cache warm, 38 with it cold under load, most of it the sm_90 compile scripts). A venv that already has Triton 3.9
# and the test tools is used as it is (`make test-compat COMPAT_VENV=/path/to/venv`); otherwise the pins and the dev
# extras are installed into $(COMPAT_VENV). The tests import this source tree (PYTHONPATH), never an installed copy.
COMPAT_VENV  ?= .venv-compat
COMPAT_PY    := $(COMPAT_VENV)/bin/python
COMPAT_READY := import torch, triton, pytest, xdist, hypothesis; assert triton.__version__.startswith("3.9.")
COMPAT_PINS  := torch==2.13.0 triton==3.9.0 "numpy<2.3"
COMPAT_TESTS := tests/test_merge.py tests/test_append_kv.py tests/test_flash_attn_interface.py tests/test_bf16.py \
	tests/test_sinks.py tests/test_bad_inputs.py tests/test_kernel_args.py tests/test_alibi.py \
	tests/test_decode.py::test_kernels_compile_for_hopper_without_a_gpu \
	tests/test_attention.py::test_kernels_compile_for_hopper_without_a_gpu tests/test_gluon_compile.py \
	tests/test_gluon_bwd_compile.py

.PHONY: test test-compat demo gpu-check peer-wheels serve-wheels clean

# -qq: pip's errors only (its warnings about configured index folders a machine lacks would fill the screen)
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -qq $(CPU_PINS)
	$(PY) -m pip install -qq -e ".[dev]"
	touch $(STAMP)

# One screen of output: nothing per passed or skipped test (--compact, tests/conftest.py), warnings counted in the
# last line, each failure's short traceback and a one-line list of failures and errors (-rfE, pyproject.toml).
PYTEST_COMPACT := -q --compact --tb=short --disable-warnings

# --dist worksteal: an idle worker takes queued tests from the busy one, so the suite's long tests do not leave one
# core idle at the end. The CPU suite has no xdist_group (the GPU's gpu_bigmem group is gpu_check's, which passes its
# own --dist).
test: $(SETUP)
	$(RUN) -m pytest $(PYTEST_COMPACT) -n $(PYTEST_WORKERS) --dist worksteal tests

$(COMPAT_VENV)/.installed: pyproject.toml
	test -x $(COMPAT_PY) || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -qq $(COMPAT_PINS)
	$(COMPAT_PY) -m pip install -qq -e ".[dev]"
	touch $@

test-compat:
	$(COMPAT_PY) -c '$(COMPAT_READY)' 2>/dev/null || $(MAKE) $(COMPAT_VENV)/.installed
	TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR) $(COMPAT_PY) -m pytest $(PYTEST_COMPACT) -n $(PYTEST_WORKERS) --dist loadgroup \
		$(COMPAT_TESTS)

demo: $(SETUP)
	$(RUN) -m flashdecode demo

# The GPU machine has torch/triton/transformers installed: run from the source tree with its python3.
gpu-check:
	PYTHONPATH=$(CURDIR) python3 scripts/gpu_check.py $(GPU_CHECK_ARGS)

# FlashInfer 0.5.3 (the paged-decode peer) for the GPU machine's Python 3.12: ~12 MB, never committed.
PEER_WHEELS := "flashinfer-python==0.5.3" "apache-tvm-ffi<0.2" "nvidia-cudnn-frontend==1.13.0" tabulate
peer-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl $(PEER_WHEELS)

# The server's stack (FastAPI, uvicorn) and the openai client for the GPU machine, which has neither: the serve
# tests and `bench serve` there. Versions as this machine's dev install resolved them.
SERVE_WHEELS := fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
	annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0 \
	anyio==4.16.0 sniffio==1.3.1 idna==3.20 certifi openai==3.57.0 jiter==0.19.0 httpx==0.28.1 httpcore==1.0.9 \
	httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 opentelemetry-api==1.45.2 uvloop==0.23.0 httptools==0.9.0 \
	prometheus_client==0.26.0
serve-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform any -d .whl $(SERVE_WHEELS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) *.egg-info .pytest_cache
