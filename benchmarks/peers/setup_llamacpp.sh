#!/usr/bin/env bash
# Build the llama.cpp venv used by benchmarks/peers/run.py: llama-cpp-python compiled from source for
# this host (minutes: the whole of ggml and llama.cpp on the machine's cores).
#
# GGML_NATIVE=ON compiles ggml with -march=native, so it uses AVX-512 (VNNI, BF16) and AMX exactly
# where the CPU has them. clang is used when present: gcc 12 miscompiles ggml's AMX tile configuration
# (see llama.cpp's issue tracker, e.g. ggml-org/llama.cpp#26954 on the tile config optimized away). On a
# host with amx_int8 the AMX code is switched on explicitly as well (-D__AMX_INT8__ and ggml's
# GGML_AMX_* options, which take effect when GGML_NATIVE is off).
#
# ggml must find OpenMP, as it does in llama.cpp's usual gcc builds: without it ggml runs its own
# spinning thread pool, whose 2-thread decode of SmolLM2-135M Q4_1 fell from ~140 to ~2 tok/s here while
# another process held one of the 2 cores (OpenMP: ~38 tok/s). clang needs libomp for that
# (Debian: apt-get install libomp-dev); the script stops if clang cannot link -fopenmp.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${LLAMACPP_VENV:-$here/.venv-llamacpp}"
python="${PYTHON:-python3}"
version="0.3.36"

# LLAVA_BUILD=OFF: the multimodal library is not needed for text and would double the build time
cmake_args="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
if command -v clang >/dev/null && command -v clang++ >/dev/null; then
    export CC=clang CXX=clang++
    if ! echo 'int main(void) { return 0; }' | clang -fopenmp -x c - -o /dev/null 2>/dev/null; then
        echo "clang cannot link OpenMP (-fopenmp): install libomp-dev (apt-get install libomp-dev)" >&2
        exit 1
    fi
fi
if grep -qw amx_int8 /proc/cpuinfo; then
    cmake_args+=" -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON"
    grep -qw amx_bf16 /proc/cpuinfo && cmake_args+=" -DGGML_AMX_BF16=ON"
    cmake_args+=" -DCMAKE_C_FLAGS=-D__AMX_INT8__ -DCMAKE_CXX_FLAGS=-D__AMX_INT8__"
fi
echo "building llama-cpp-python $version with ${CC:-cc} ($("${CC:-cc}" --version | head -1)), CMAKE_ARGS=$cmake_args"

"$python" -m venv "$venv"
"$venv/bin/pip" install --upgrade pip
CMAKE_ARGS="$cmake_args" "$venv/bin/pip" install --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$version"

"$venv/bin/python" - <<'EOF'
import llama_cpp

info = llama_cpp.llama_print_system_info().decode().strip()
print("llama_cpp", llama_cpp.__version__)
print("system_info", info)
if "OPENMP = 1" not in info:
    raise SystemExit("ggml was built without OpenMP (see the top of setup_llamacpp.sh)")
EOF
