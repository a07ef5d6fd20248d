"""The native library's interface has one source of truth, plinth_cpu.abi.FUNCTIONS: the committed
C header is what it generates, and kernels.c defines exactly the functions it lists, as it lists them."""

from __future__ import annotations

import re
from ctypes import c_float, c_int, c_int64, c_void_p

from plinth_cpu import abi
from plinth_cpu.native import SOURCE

#: An exported definition in kernels.c: return type, name, parameter list, then the body's brace.
_DEFINITION = re.compile(r"^(int64_t|int|void)\s+(plinth_\w+)\s*\(([^)]*)\)\s*\{", re.MULTILINE)


def test_committed_header_is_generated_from_the_table() -> None:
    """Edit abi.py, then run `python -m plinth_cpu.abi`: a stale csrc/abi.h fails here."""
    assert abi.HEADER.read_text() == abi.header(), "csrc/abi.h is stale: run `python -m plinth_cpu.abi`"


def test_kernels_c_defines_the_table_exactly() -> None:
    """Every exported (non-static) plinth_* definition is in the table with the same signature, and
    every table entry is defined: a function added on one side only fails here, compiler or not."""
    defined = {
        name: (returns, " ".join(params.split())) for returns, name, params in _DEFINITION.findall(SOURCE.read_text())
    }
    listed = {name: (f.returns, " ".join(f.params.split())) for name, f in abi.FUNCTIONS.items()}
    assert defined == listed


def test_graph_ops_are_unique_and_rows_name_a_parameter() -> None:
    kinds = list(abi.GRAPH_OPS.values())
    assert len(kinds) == len(set(kinds)) and min(kinds) >= 1
    for name, f in abi.FUNCTIONS.items():
        names = [n for _, n in f.parameters()]
        assert f.rows is None or (f.graph_op is not None and f.rows in names), name
        if f.graph_op is not None:
            ints = [n for t, n in f.parameters() if t != "float"]
            assert len(ints) <= abi.INT_SLOTS, name


def test_ctypes_types_follow_the_c_types() -> None:
    f = abi.FUNCTIONS["plinth_decode_attention"]
    assert f.restype() is c_int
    argtypes = f.argtypes()
    assert argtypes[:4] == [c_int, c_void_p, c_int64, c_void_p]  # kt, q, sq, cache
    assert argtypes[-3:] == [c_float, c_int64, c_float]
    assert abi.FUNCTIONS["plinth_abi_version"].argtypes() == []
    assert abi.FUNCTIONS["plinth_set_num_threads"].restype() is None
    assert abi.FUNCTIONS["plinth_graph_run"].restype() is c_int64


def test_generated_replay_passes_arguments_in_recorded_order() -> None:
    """The replay switch reads integer/pointer arguments from a[] and floats from f[], in order, as
    NativeGraph records them, and shrinks the row argument it names."""
    text = abi.header()
    assert "case OP_DECODE_ATTENTION: return 8;" in text  # B is the 9th integer/pointer argument
    call = re.search(r"return plinth_decode_attention\((.*)\) != 0;", text)
    assert call is not None
    args = [a.strip() for a in call.group(1).split(",")]
    assert args[14:] == ["op->f[0]", "(int64_t)op->a[14]", "op->f[1]"]
    assert args[:2] == ["(int)op->a[0]", "(void *)(intptr_t)op->a[1]"]  # kt, q
