"""The cases the suite runs, generated from a backend's declared capabilities.

The definitions live by concern: :mod:`.case_base` (the mandatory profile, seeds, declared axes),
:mod:`.attention_cases` (paged attention, KV writes), :mod:`.gemm_cases` (dense and quantized GEMM,
SmallOps) and :mod:`.engine_cases` (undeclared values, whole-engine runs, perf); the shapes past
the kernels' path switches are in :mod:`.coverage`. This module re-exports them under one name.

Every case has an id (its pytest parameter id) and a seed derived from the suite version and that
id, so a failing case is reproduced exactly by running it alone. The mandatory core profile is
generated whatever the backend declares: declaring nothing cannot pass.
"""

from __future__ import annotations

from plinth_conformance.attention_cases import AttentionCase, KVWriteCase, attention_cases, kv_write_cases
from plinth_conformance.case_base import (
    _SHORT,
    GROUP_SIZES,
    KINDS,
    KNOWN_DTYPES,
    LONG_KINDS,
    MANDATORY_BLOCK_SIZE,
    MANDATORY_DTYPE,
    MANDATORY_GQA_RATIO,
    MANDATORY_HEAD_SIZES,
    MAX_TESTED_BLOCK_SIZE,
    MODEL_HEAD_SIZES,
    _block_sizes,
    _dedupe,
    _dtypes,
    _group_ok,
    _home_block,
    case_seed,
)
from plinth_conformance.engine_cases import (
    ENGINE_MODELS,
    EngineCase,
    PerfCase,
    UndeclaredCase,
    engine_cases,
    perf_cases,
    undeclared_cases,
)
from plinth_conformance.gemm_cases import (
    QUANT_SHAPES,
    SMALL_OPS,
    SMOLLM2_SHAPES,
    SMOLLM2_VOCAB,
    GemmCase,
    OpsCase,
    QuantCase,
    gemm_cases,
    ops_cases,
    quant_cases,
)

__all__ = [
    "_SHORT",
    "ENGINE_MODELS",
    "GROUP_SIZES",
    "KINDS",
    "KNOWN_DTYPES",
    "LONG_KINDS",
    "MANDATORY_BLOCK_SIZE",
    "MANDATORY_DTYPE",
    "MANDATORY_GQA_RATIO",
    "MANDATORY_HEAD_SIZES",
    "MAX_TESTED_BLOCK_SIZE",
    "MODEL_HEAD_SIZES",
    "QUANT_SHAPES",
    "SMALL_OPS",
    "SMOLLM2_SHAPES",
    "SMOLLM2_VOCAB",
    "AttentionCase",
    "EngineCase",
    "GemmCase",
    "KVWriteCase",
    "OpsCase",
    "PerfCase",
    "QuantCase",
    "UndeclaredCase",
    "_block_sizes",
    "_dedupe",
    "_dtypes",
    "_group_ok",
    "_home_block",
    "attention_cases",
    "case_seed",
    "engine_cases",
    "gemm_cases",
    "kv_write_cases",
    "ops_cases",
    "perf_cases",
    "quant_cases",
    "undeclared_cases",
]
