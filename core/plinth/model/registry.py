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
