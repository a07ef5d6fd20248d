"""plinth: an LLM inference engine whose hardware backends are plugins."""

__version__ = "0.1.0"
