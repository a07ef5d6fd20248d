"""plinth: an LLM inference engine whose hardware backends are plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from plinth.llm import LLM
    from plinth.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]

# the environment backend plugins ask for, before anything imports torch (plugin API 1.15)
from plinth import process_env as _process_env  # noqa: E402

_process_env.apply()


def __getattr__(name: str) -> Any:
    # lazy, so that `import plinth.sched` stays torch-free
    if name == "LLM":
        from plinth.llm import LLM

        return LLM
    if name == "SamplingParams":
        from plinth.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'plinth' has no attribute {name!r}")
