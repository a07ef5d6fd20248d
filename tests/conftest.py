"""Session-wide fixtures shared by test directories: the default model and tiny HF model folders."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

#: gguf-py readers by (path, mode), shared by every transformers load under :func:`one_gguf_parse`
_GGUF_READERS: dict[tuple[str, str], Any] = {}


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Within this context transformers' GGUF loads share one gguf-py ``GGUFReader`` per file.

    transformers opens a GGUF file afresh for each part it reads (the config, then the weights; the
    tokenizer in a load of its own), and each ``GGUFReader`` parses every metadata field in Python:
    Gemma 3's 262k-token vocabulary took ~10 s a parse on an Intel Xeon and ~30 s on a Zen 1, where CI
    has a time budget. A reader only reads its memory map, so one per file serves every load, for the
    whole session."""
    import gguf

    real = gguf.GGUFReader

    def shared(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = real(path, mode)
        return _GGUF_READERS[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", shared)
        yield


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path of the default model's GGUF file (SmolLM2-135M-Instruct Q4_1)."""
    from plinth.model.loader import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="session")
def hf_smollm2(default_gguf: Path) -> Any:
    """transformers' own fp32 model of the default GGUF (it dequantizes the file itself)."""
    from transformers import AutoModelForCausalLM

    with one_gguf_parse():
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


@pytest.fixture
def bench() -> Callable[[str], ModuleType]:
    """``bench("attention")``: the module of benchmarks/attention.py. The benchmark scripts are not a
    package, so they are imported by name from benchmarks/ (their sibling imports resolved)."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")

    def load(name: str) -> ModuleType:
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(folder)

    return load
