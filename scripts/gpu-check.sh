#!/usr/bin/env bash
# One prepared check of the cuda backend on a GPU machine (a few minutes; see docs/gpu.md):
#   1. install what is missing (plinth, plinth-triton-kernels, plinth-cuda, plinth-rocm; triton comes
#      with CUDA builds of torch, and is installed only if it does not import);
#   2. the conformance suite, every tier (core + extended + perf), with a report and certificate in
#      docs/certificates/cuda-<gpu>/;
#   3. end to end: greedy tokens of a tiny random Llama on cuda (fp32) == the reference backend's;
#   4. perf: decode attention at long context as a share of the copy bandwidth measured in the same
#      run, and the bf16 GEMM vs torch.matmul on Llama-3-8B's projection shapes -> docs/gpu-perf.md.
# Every step runs even if an earlier one fails; the exit status is non-zero if any failed.
#
# Usage: scripts/gpu-check.sh            (PY=/path/to/python to use another interpreter)
set -uo pipefail

cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
BIN="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
# The interpreter lane's switches must not leak into a hardware run.
unset PLINTH_TRITON_INTERPRET TRITON_INTERPRET PLINTH_INTERPRET PLINTH_BACKEND

step() { printf '\n=== %s ===\n' "$*"; }
failed=()
run() {  # run NAME CMD...: record a failure instead of stopping
    local name=$1
    shift
    if ! "$@"; then
        echo "FAILED: $name"
        failed+=("$name")
    fi
}

step "GPU"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)'; then
    echo "torch sees no CUDA device (torch.version.cuda / torch.cuda.is_available()): nothing to check" >&2
    exit 2
fi
"$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null || true

step "install"
# No --no-deps for plinth itself: its dependencies (pluggy, pydantic, ...) may be missing; torch is
# already satisfied by the CUDA build, so pip leaves it alone.
"$PY" -m pip install -q -e ".[conformance]" -e plugins/triton -e plugins/cuda -e plugins/rocm || exit 2
"$PY" -c 'import triton' 2>/dev/null || "$PY" -m pip install -q triton || exit 2
"$PY" -c 'import triton; print("triton", triton.__version__)'
"$BIN/plinth" backends --verbose

GPU="$("$PY" -c 'import re, torch; print(re.sub("[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')"
REPORT="docs/certificates/cuda-$GPU"
mkdir -p "$REPORT"

step "conformance: core + extended + perf -> $REPORT"
run conformance "$BIN/plinth" conformance --backend cuda --tier all --report "$REPORT"

step "end to end: cuda == reference (greedy, tiny Llama, fp32)"
run e2e "$PY" -m plinth_cuda.perfcheck e2e --backend cuda

step "perf: decode attention bandwidth, GEMM vs torch.matmul -> docs/gpu-perf.md"
run perf "$PY" -m plinth_cuda.perfcheck perf --backend cuda --out docs/gpu-perf.md

step "summary"
echo "certificate: $REPORT/certificate.json (copy to docs/certificates/cuda.json, then: plinth conformance --matrix)"
echo "perf numbers: docs/gpu-perf.md"
if ((${#failed[@]})); then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all checks passed"
