"""Shared helpers for the model tests: reference kernels, hand-built varlen batches, tiny HF models.

(A uniquely named module rather than conftest.py, so ``from model_helpers import ...`` can never
pick up another directory's conftest.)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from plinth.model.context import ForwardContext, ModelKernels
from plinth.platform.backend import AttentionMetadata
from plinth.platform.reference import ReferenceBackend

BLOCK_SIZE = 4
MAX_BLOCKS_PER_SEQ = 16


def reference_kernels(dtype: str = "float32") -> ModelKernels:
    """ModelKernels of the plain-torch reference backend."""
    backend = ReferenceBackend()
    return ModelKernels(gemm=backend.gemm_kernels(dtype), ops=backend.small_ops(), attention=backend.attention_kernels)


def make_metadata(computed: Sequence[int], new: Sequence[int], block_size: int = BLOCK_SIZE) -> AttentionMetadata:
    """A varlen batch: sequence i has ``computed[i]`` tokens cached and ``new[i]`` in this step.

    Sequence i owns the contiguous blocks ``i * MAX_BLOCKS_PER_SEQ ...``.
    """
    seq_lens = [c + n for c, n in zip(computed, new, strict=True)]
    tables = [[i * MAX_BLOCKS_PER_SEQ + b for b in range(MAX_BLOCKS_PER_SEQ)] for i in range(len(new))]
    return AttentionMetadata.from_lengths(list(new), seq_lens, tables, block_size=block_size)


def allocate_caches(model: Any, num_seqs: int) -> list[torch.Tensor]:
    """KV caches for ``model`` big enough for ``num_seqs`` sequences of MAX_BLOCKS_PER_SEQ blocks."""
    backend = ReferenceBackend()
    return [backend.allocate_kv_cache(spec, num_seqs * MAX_BLOCKS_PER_SEQ) for spec in model.attention_specs()]


def run_step(
    model: Any, caches: list[torch.Tensor], chunks: Sequence[Sequence[int]], computed: Sequence[int]
) -> torch.Tensor:
    """One forward over ``chunks`` (sequence i's new tokens after ``computed[i]``); logits [T, V]."""
    meta = make_metadata(computed, [len(c) for c in chunks])
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
    positions = torch.tensor([p for c, n in zip(computed, chunks, strict=True) for p in range(c, c + len(n))])
    hidden = model(ids, positions, ForwardContext(meta, caches))
    return model.compute_logits(hidden)


def hf_logits(hf_model: Any, ids: Sequence[int]) -> torch.Tensor:
    """HF's fp32 logits [T, V] for one sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([list(ids)])).logits[0].float()


def save_tiny(config: Any, folder: Path, safe: bool = True, **save_kwargs: Any) -> Any:
    """Build a tiny random HF model from ``config``, save it into ``folder``; return the HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases and norm weights: HF initialises them to 0 / 1
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=safe, **save_kwargs)
    return model
