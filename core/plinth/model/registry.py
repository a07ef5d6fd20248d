"""Which Hugging Face architecture names plinth can run, and the class that runs each.

Entries name their class as ``module:Class`` strings so that reading a config (which needs the list
of supported names for its error message) never imports the model code.
"""

from __future__ import annotations

import importlib
from typing import Any

_ARCHITECTURES: dict[str, str] = {
    "Gemma3ForCausalLM": "plinth.model.llama:LlamaForCausalLM",
    "LlamaForCausalLM": "plinth.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "plinth.model.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "plinth.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "plinth.model.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "plinth.model.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "plinth.model.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "plinth.model.llama:LlamaForCausalLM",
}


# What each architecture brings, for the generated tables in README.md and docs/models.md
# (tests/core/model/test_registry_docs.py keeps them equal to markdown_table()).
_NOTES: dict[str, str] = {
    "Gemma3ForCausalLM": "Gemma 3 text: 5 sliding-window layers per global one, two rotary bases, q/k norm, "
    "GELU-tanh MLP, (1 + w) RMSNorm before and after attention and MLP, sqrt(hidden) embedding scale",
    "LlamaForCausalLM": "Llama 2/3 (llama3 and linear RoPE scaling), SmolLM2; GQA, tied embeddings, biases",
    "MistralForCausalLM": "sliding-window attention",
    "MixtralForCausalLM": "mixture of experts: top-2 of 8, softmax over the chosen",
    "Qwen2ForCausalLM": "q/k/v bias; sliding window from max_window_layers when enabled",
    "Qwen2MoeForCausalLM": "mixture of experts (top-k, no renormalisation) plus a gated shared expert",
    "Qwen3ForCausalLM": "q/k RMSNorm per head before the rotary, no bias",
    "Qwen3MoeForCausalLM": "Qwen3 attention with mixture-of-experts MLPs (norm_topk_prob)",
}
# The GGUF general.architecture each one is read from (Mixtral: llama with an expert count)
_GGUF_NAMES: dict[str, str] = {
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "-",
    "MixtralForCausalLM": "llama (+ expert_count)",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}


def markdown_table() -> str:
    """The supported architectures as a Markdown table (the README's and docs/models.md's)."""
    rows = ["| Hugging Face architecture | GGUF `general.architecture` | what it adds |", "|---|---|---|"]
    for name in supported_architectures():
        rows.append(f"| `{name}` | {_GGUF_NAMES.get(name, '-')} | {_NOTES.get(name, '')} |")
    return "\n".join(rows)


class UnsupportedArchitecture(ValueError):
    """A checkpoint names an architecture plinth has no model class for."""

    def __init__(self, architecture: str, source: str = "", supported: list[str] | None = None) -> None:
        self.architecture = architecture
        where = f" (from {source})" if source else ""
        names = supported if supported is not None else supported_architectures()
        super().__init__(f"unsupported model architecture {architecture!r}{where}; supported: {', '.join(names)}")


def supported_architectures() -> list[str]:
    """The Hugging Face architecture names plinth can load, sorted."""
    return sorted(_ARCHITECTURES)


def is_supported(architecture: str) -> bool:
    """True when ``architecture`` has a model class."""
    return architecture in _ARCHITECTURES


def model_class(architecture: str) -> Any:
    """The model class for a Hugging Face architecture name; raises :class:`UnsupportedArchitecture`."""
    try:
        target = _ARCHITECTURES[architecture]
    except KeyError:
        raise UnsupportedArchitecture(architecture) from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
