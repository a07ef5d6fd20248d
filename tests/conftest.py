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
    """Hugging Face transformers' fp32 greedy continuation of ``n`` tokens, one token at a time on its
    KV cache. An end-of-sequence token is taken like any other argmax and decoding goes on, as plinth's
    ``ignore_eos`` does (``generate`` would stop there, and ``min_new_tokens`` would mask EOS out)."""
    tokens: list[int] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([list(prompt)]), use_cache=True)
        for i in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            if i + 1 < n:
                out = hf_model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
