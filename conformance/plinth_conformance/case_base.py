"""What every case module shares: the mandatory profile, the case seed, and the helpers that turn a
backend's declared capabilities into the axes a sweep runs over.

Every case has an id (its pytest parameter id) and a seed derived from the suite version and that
id, so a failing case is reproduced exactly by running it alone. The mandatory core profile is
generated whatever the backend declares: declaring nothing cannot pass.
"""

from __future__ import annotations

import hashlib
from typing import Any

from plinth.platform.backend import Capabilities
from plinth_conformance import SEED_VERSION

#: What every backend must declare and pass (the core tier).
MANDATORY_DTYPE = "float32"
MANDATORY_HEAD_SIZES: tuple[int, ...] = (64, 128)
MANDATORY_BLOCK_SIZE = 16
MANDATORY_GQA_RATIO = 8
#: Head sizes real models use; extended runs those the backend declares.
MODEL_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)
#: Query heads per KV head exercised in extended (5: a ratio that is no power of two).
GROUP_SIZES: tuple[int, ...] = (1, 2, 4, 5, 8)
#: Block sizes above this are not exercised (their "long" sequences get too slow for CI).
MAX_TESTED_BLOCK_SIZE = 256
#: Dtypes the suite knows how to generate and compare (fp8 e4m3fn: a KV-cache dtype only, 1.10.0).
KNOWN_DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn")
#: Batch shapes of one attention call (see :func:`plinth_conformance.paged.batch_lengths`).
KINDS: tuple[str, ...] = ("prefill", "decode", "mixed", "chunked", "shared")
#: Batch shapes past the sizes where kernels switch paths (extended tier).
LONG_KINDS: tuple[str, ...] = ("long-decode", "long-prefill", "big-batch")

_SHORT = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16", "float8_e4m3fn": "f8"}


def case_seed(case_id: str) -> int:
    """The seed of a case: a hash of :data:`SEED_VERSION` and the case id (stable across runs/hosts)."""
    digest = hashlib.sha256(f"plinth-conformance {SEED_VERSION} {case_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _dtypes(caps: Capabilities) -> list[str]:
    """Declared dtypes the suite can test, float32 first."""
    return [d for d in KNOWN_DTYPES if d in caps.dtypes]


def _block_sizes(caps: Capabilities) -> list[int]:
    return [b for b in caps.block_sizes if b <= MAX_TESTED_BLOCK_SIZE]


def _home_block(caps: Capabilities) -> int:
    """The block size the head-size / dtype sweeps use: 16 when declared."""
    blocks = _block_sizes(caps)
    return MANDATORY_BLOCK_SIZE if MANDATORY_BLOCK_SIZE in blocks or not blocks else blocks[0]


def _group_ok(caps: Capabilities, group: int) -> bool:
    return caps.max_gqa_ratio is None or group <= caps.max_gqa_ratio


def _dedupe(cases: list, caps: Capabilities | None = None) -> list:
    """Drop repeated ids, and extended cases ``caps`` does not declare (core ones are mandatory)."""
    seen: dict[str, Any] = {}
    for case in cases:
        if caps is not None and case.tier != "core" and caps.unsupported(case.spec):
            continue
        seen.setdefault(case.id, case)
    return list(seen.values())
