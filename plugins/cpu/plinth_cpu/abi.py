"""The native library's C interface, written once: every exported function's C signature, and which
of them a step graph can record.

Everything on both sides of the ctypes boundary comes from :data:`FUNCTIONS`: ``native.py`` sets each
function's ``restype``/``argtypes`` from it and records graph calls by it; ``csrc/abi.h`` is generated
from it (``python -m plinth_cpu.abi``) and holds the prototypes (so the compiler rejects a definition
in ``kernels.c`` that disagrees), the op kinds, the recorded-op struct, where each op keeps its row
count, and the switch that replays a recorded op. ``tests/plugins/cpu/test_abi.py`` fails when the
committed header is not what this module generates, or when ``kernels.c`` exports a function this
table does not list.

Before this table the interface lived in four hand-synced places (the ctypes signatures, the
graph-op numbers, the C enum and the C replay switch with its row-count table).
"""

from __future__ import annotations

import ctypes
import sys
from ctypes import c_float, c_int, c_int64, c_void_p
from dataclasses import dataclass
from pathlib import Path

#: Bumped on any change to the table; the library reports it and a stale build is refused.
ABI_VERSION = 21

HEADER = Path(__file__).with_name("csrc") / "abi.h"

#: C scalar types the interface uses -> the ctypes type passed for them (any pointer: c_void_p).
_SCALARS: dict[str, type] = {"int": c_int, "int64_t": c_int64, "float": c_float}


@dataclass(frozen=True, slots=True)
class CFunction:
    """One exported C function.

    ``params`` is the C parameter list as written in ``kernels.c`` (``"const float *x, int64_t M"``).
    ``graph_op`` is its kind in a recorded step graph (None: it cannot be recorded); ``rows`` names
    the parameter holding the call's row count, which a replay over fewer rows than were captured
    shrinks (None: the call has none, e.g. a weight's dequantization).
    """

    returns: str
    params: str
    graph_op: int | None = None
    rows: str | None = None

    def parameters(self) -> list[tuple[str, str]]:
        """``[(C type, name), ...]`` in order."""
        if self.params.strip() in ("", "void"):
            return []
        out = []
        for param in self.params.split(","):
            ctype, _, name = param.strip().rpartition(" ")
            stars = len(name) - len(name.lstrip("*"))
            out.append(((ctype + " " + "*" * stars).strip() if stars else ctype, name.lstrip("*")))
        return out

    def argtypes(self) -> list[type]:
        """The ctypes types of the parameters."""
        return [c_void_p if "*" in ctype else _SCALARS[ctype] for ctype, _ in self.parameters()]

    def restype(self) -> type | None:
        """The ctypes return type (None for void)."""
        return None if self.returns == "void" else _SCALARS[self.returns]


#: The library's exported functions (csrc/kernels.c), in the order they are defined there.
FUNCTIONS: dict[str, CFunction] = {
    "plinth_abi_version": CFunction("int", "void"),
    "plinth_isa": CFunction("int", "void"),  # 2: built for AVX2/FMA/F16C, 3: AVX-512 (F/BW/VL/DQ/VNNI), 103: 3 emulated
    "plinth_set_num_threads": CFunction("void", "int n"),
    "plinth_get_num_threads": CFunction("int", "void"),
    "plinth_read_probe": CFunction("void", "const float *x, float *out, int64_t n"),
    "plinth_gemm_f32": CFunction(
        "void", "const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K", 1, "M"
    ),
    "plinth_pack_f32_panels": CFunction("void", "const float *w, float *P, int64_t N, int64_t K"),
    "plinth_gemm_f32_panels": CFunction(
        "void", "const float *x, const float *P, const float *bias, float *y, int64_t M, int64_t N, int64_t K", 11, "M"
    ),
    "plinth_gemm_panels16": CFunction(
        "int",
        "int wt, const float *x, const void *P, const float *bias, float *y, int64_t M, int64_t N, int64_t K",
        15,
        "M",
    ),  # wt: 1 bf16, 2 fp16 panels
    "plinth_bf16_dot": CFunction("int", "void"),  # 1: plinth_gemm_bf16_pairs runs here (AVX512-BF16)
    "plinth_amx_bf16": CFunction("int", "int mode"),  # 1: the pair GEMM runs on AMX tiles (mode 1 on, 0 off, -1 ask)
    "plinth_amx_int8": CFunction("int", "int mode"),  # 1: the 16-row quant panels run on AMX-INT8 tiles (as above)
    "plinth_argmax_rows": CFunction(
        "void", "const float *x, int64_t stride, int64_t rows, int64_t width, int64_t *out"
    ),
    "plinth_pack_bf16_pairs": CFunction("void", "const void *w, void *P, int64_t N, int64_t K"),
    "plinth_gemm_bf16_pairs": CFunction(
        "int",
        "const void *x, int64_t sx, const void *P, const float *bias, int yt, void *y, int64_t M, int64_t N, int64_t K",
        18,
        "M",
    ),  # yt: 0 fp32, 1 bf16 output
    "plinth_gemm_rows16": CFunction(
        "int",
        "int wt, const float *x, const void *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K",
        17,
        "M",
    ),
    "plinth_gemm_quant": CFunction(
        "int",
        "int fmt, int act, const float *x, const void *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K",
        2,
        "M",
    ),
    "plinth_q4_1x4_bytes": CFunction("int64_t", "int64_t N, int64_t K"),
    "plinth_pack_q4_1x4": CFunction("void", "const void *w, void *out, int64_t N, int64_t K"),
    "plinth_q4_1p16_bytes": CFunction("int64_t", "int64_t N, int64_t K"),
    "plinth_pack_q4_1p16": CFunction("void", "const void *w, void *out, int64_t N, int64_t K"),
    "plinth_q8_0p16_bytes": CFunction("int64_t", "int64_t N, int64_t K"),
    "plinth_pack_q8_0p16": CFunction("void", "const void *w, void *out, int64_t N, int64_t K"),
    "plinth_round_trip_q8": CFunction("void", "const float *x, float *out, int64_t M, int64_t K", 5, "M"),
    "plinth_gemm_dequant": CFunction(
        "int",
        "int fmt, const float *x, const void *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K",
        3,
        "M",
    ),  # fmt: skip
    "plinth_dequant": CFunction("int", "int fmt, const void *w, void *out, int dt, int64_t N, int64_t K", 4),
    "plinth_dequant_panels": CFunction("int", "int fmt, const void *w, float *P, int64_t N, int64_t K", 12),
    "plinth_rms_norm": CFunction(
        "void",
        "int dt, const void *x, void *residual, const void *w, void *out, int64_t T, int64_t H, float eps",
        6,
        "T",
    ),
    "plinth_rms_norm_heads": CFunction(
        "void",
        "int dt, const void *x, int64_t sx, const void *w, void *out, int64_t T, int64_t Hh, int64_t D, float eps",
        13,
        "T",
    ),
    "plinth_silu_and_mul": CFunction("void", "int dt, const void *x, void *out, int64_t T, int64_t I", 7, "T"),
    "plinth_gelu_tanh_and_mul": CFunction("void", "int dt, const void *x, void *out, int64_t T, int64_t I", 14, "T"),
    "plinth_apply_token_bitmask": CFunction(
        "void", "float *logits, int64_t stride, const int32_t *bitmask, int64_t S, int64_t V, int64_t W"
    ),
    "plinth_rotary": CFunction(
        "void",
        "int dt, const void *x, int64_t sx, void *out, const int64_t *positions, const float *cos_sin, int64_t T, "
        "int64_t H, int64_t D, int64_t rotary_dim",
        8,
        "T",
    ),
    "plinth_write_kv": CFunction(
        "void",
        "int kt, const float *k, int64_t sk, const float *v, int64_t sv, void *cache, const int64_t *slot_mapping, "
        "int64_t T, int64_t Hk, int64_t D, int64_t num_blocks, int64_t bs",
        9,
        "T",
    ),  # kt: the cache's element kind (0 fp32, 1 bf16, 2 fp16), as in the two attention calls
    "plinth_decode_attention": CFunction(
        "int",
        "int kt, const float *q, int64_t sq, const void *cache, const int32_t *block_tables, int64_t max_blocks, "
        "const int32_t *seq_lens, float *out, int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t bs, "
        "int64_t num_blocks, float scale, int64_t window, float soft_cap",
        10,
        "B",
    ),
    "plinth_prefill_attention": CFunction(
        "int",
        "int kt, const float *q, int64_t sq, const void *cache, const int32_t *block_tables, int64_t max_blocks, "
        "const int64_t *q_start, const int32_t *q_lens, const int32_t *seq_lens, float *out, int64_t G, "
        "int64_t H, int64_t Hk, int64_t D, int64_t bs, int64_t num_blocks, float scale, int64_t window, "
        "float soft_cap",
    ),
    "plinth_convert": CFunction(
        "void", "int st, const void *src, int64_t ss, int dt, void *dst, int64_t T, int64_t H", 16, "T"
    ),
    "plinth_graph_run": CFunction("int64_t", "const plinth_op *ops, int64_t n, int64_t captured, int64_t rows"),
}

#: Calls a step graph can record, with their kind in ``plinth_graph_run``.
GRAPH_OPS: dict[str, int] = {name: f.graph_op for name, f in FUNCTIONS.items() if f.graph_op is not None}


def _slots(f: CFunction) -> tuple[list[str], list[str]]:
    """The parameters a recorded op keeps in its integer/pointer slots and in its float slots."""
    params = f.parameters()
    return [n for t, n in params if t != "float"], [n for t, n in params if t == "float"]


#: Integer/pointer and float argument slots of one recorded op: the most any recordable call takes.
INT_SLOTS = max(len(_slots(FUNCTIONS[name])[0]) for name in GRAPH_OPS)
FLOAT_SLOTS = max(1, max(len(_slots(FUNCTIONS[name])[1]) for name in GRAPH_OPS))


class RecordedOp(ctypes.Structure):
    """One recorded call (``plinth_op``): its kind, integer/pointer arguments in order, then float ones."""

    _fields_ = [("kind", c_int64), ("a", c_int64 * INT_SLOTS), ("f", c_float * FLOAT_SLOTS)]


def _op_name(name: str) -> str:
    return "OP_" + name.removeprefix("plinth_").upper()


def header() -> str:
    """The text of ``csrc/abi.h``, generated from :data:`FUNCTIONS`."""
    recordable = sorted(GRAPH_OPS, key=GRAPH_OPS.__getitem__)
    lines = [
        "/* Generated by `python -m plinth_cpu.abi` from plinth_cpu/abi.py: edit that table, not this file. */",
        "#ifndef PLINTH_ABI_H",
        "#define PLINTH_ABI_H",
        "#include <stdint.h>",
        "",
        f"#define PLINTH_ABI_VERSION {ABI_VERSION}",
        "",
        "/* One recorded call: its kind, integer and pointer arguments in order, float arguments in order. */",
        "typedef struct {",
        "    int64_t kind;",
        f"    int64_t a[{INT_SLOTS}];",
        f"    float f[{FLOAT_SLOTS}];",
        "} plinth_op;",
        "",
        "/* The exported functions: a definition in kernels.c that disagrees does not compile. */",
    ]
    lines += [f"{f.returns} {name}({f.params});" for name, f in FUNCTIONS.items()]
    lines += ["", "enum {"]
    lines += [f"    {_op_name(name)} = {GRAPH_OPS[name]}," for name in recordable]
    lines += [
        "};",
        "",
        "/* Where an op of `kind` holds its row count in plinth_op.a; -1: the op has none. */",
        "static int op_rows_arg(int64_t kind) {",
        "    switch (kind) {",
    ]
    for name in recordable:
        ints, _ = _slots(FUNCTIONS[name])
        rows = FUNCTIONS[name].rows
        if rows is not None:
            lines.append(f"    case {_op_name(name)}: return {ints.index(rows)};")
    lines += [
        "    default: return -1;",
        "    }",
        "}",
        "",
        "/* Runs one recorded op: 0 done, 1 it failed (out of memory), -1 a kind this library does not know. */",
        "static int run_op(const plinth_op *op) {",
        "    switch (op->kind) {",
    ]
    for name in recordable:
        f = FUNCTIONS[name]
        args, i, j = [], 0, 0
        for ctype, _ in f.parameters():
            if ctype == "float":
                args.append(f"op->f[{j}]")
                j += 1
            else:
                args.append(f"(void *)(intptr_t)op->a[{i}]" if "*" in ctype else f"({ctype})op->a[{i}]")
                i += 1
        call = f"{name}({', '.join(args)})"
        body = f"return {call} != 0;" if f.returns != "void" else f"{call};\n        return 0;"
        lines += [f"    case {_op_name(name)}:", f"        {body}"]
    lines += ["    default: return -1;", "    }", "}", "#endif", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m plinth_cpu.abi`: regenerate csrc/abi.h after editing the table
    HEADER.write_text(header())
    print(f"wrote {HEADER}")
    sys.exit(0)
