"""Session-wide fixtures shared by test directories: the default model and tiny HF model folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct Q4_1)."""
    from plinth.model.loader import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="session")
def hf_smollm2(default_gguf: Path) -> Any:
    """transformers' own fp32 model of the default GGUF (it dequantizes the file itself)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """Hugging Face transformers' fp32 greedy continuation of ``n`` tokens (its KV-cached ``generate``,
    never stopping early: every kind of tiny model reaches EOS by chance)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]
