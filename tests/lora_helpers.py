"""PEFT LoRA adapters for the tests: random non-zero A and B on a tiny HF model, saved as a folder.

(A uniquely named module rather than conftest.py, so ``from lora_helpers import ...`` never picks up
another directory's conftest.)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: Every module plinth adapts.
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_peft_adapter(
    base: Any,
    folder: Path,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = ALL_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    magnitude: float = 0.3,
) -> Any:
    """Wrap a copy of HF model ``base`` with a PEFT LoRA of random A and B (std ``magnitude``),
    save the adapter into ``folder``, and return the HF model with the adapter merged."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero A and B, large enough to change greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * magnitude)
    peft_model.save_pretrained(str(folder))
    return peft_model.merge_and_unload().eval()
