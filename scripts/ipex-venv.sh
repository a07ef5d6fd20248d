#!/usr/bin/env bash
# Build (once) the ipex lane's venv and print its path on the last line of stdout.
#
# intel-extension-for-pytorch needs torch 2.8 exactly, so it cannot share the main .venv (torch 2.13).
# Two layers, each built only when its inputs change:
#   1. the heavy one (torch 2.8 with its CUDA wheels, IPEX, the test packages: GBs of download), keyed
#      by the python version and plugins/ipex/requirements-lane.txt: the venv's directory name;
#   2. plinth, plinth-cpu and plinth-ipex installed editable from this checkout (seconds), redone
#      when the checkout's path or one of the three pyproject files changes (a stamp in the venv).
#   PLINTH_VENV_CACHE  where the keyed venvs live (default ~/.cache/plinth/venvs)
#   --check            build nothing: exit 3 when layer 1 is not built yet (layer 2 is still refreshed)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=${PLINTH_VENV_CACHE:-$HOME/.cache/plinth/venvs}
HEAVY_KEY=$( ( $PYTHON -V; cat plugins/ipex/requirements-lane.txt ) | sha256sum | cut -c1-16)
VENV=$CACHE/ipex-$HEAVY_KEY
PY=$VENV/bin/python
if [[ ! -f $VENV/.plinth-ipex-deps ]]; then
    if [[ ${1:-} == --check ]]; then
        echo "ipex lane: no venv built for plugins/ipex/requirements-lane.txt as it is ($VENV)" >&2
        exit 3
    fi
    start=$(date +%s)
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    $PYTHON -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip >&2
    "$PY" -m pip install -q -r plugins/ipex/requirements-lane.txt >&2
    echo "ipex lane: layer 1 (torch 2.8, IPEX) built in $(( $(date +%s) - start )) s at $VENV" >&2
    touch "$VENV/.plinth-ipex-deps"
fi
PROJECT_KEY=$( ( pwd; cat pyproject.toml plugins/cpu/pyproject.toml plugins/ipex/pyproject.toml ) | sha256sum | cut -c1-16)
if [[ $(cat "$VENV/.plinth-ipex-project" 2>/dev/null) != "$PROJECT_KEY" ]]; then
    start=$(date +%s)
    # with their dependencies (plinth's: pydantic, fastapi, ...), none of which moves torch (asserted)
    "$PY" -m pip install -q --no-build-isolation -e ".[conformance]" -e plugins/cpu -e plugins/ipex >&2
    "$PY" -c "import torch, intel_extension_for_pytorch as ipex; assert torch.__version__.startswith('2.8.0'), torch.__version__" >&2
    echo "$PROJECT_KEY" > "$VENV/.plinth-ipex-project"
    echo "ipex lane: layer 2 (plinth, plinth-cpu, plinth-ipex from $(pwd)) installed in $(( $(date +%s) - start )) s" >&2
fi
echo "$VENV"
