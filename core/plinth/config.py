"""Engine configuration: what the user types in, validated by pydantic so errors name the field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    """Everything that decides how an engine is built. Unset fields are chosen from the model and
    the backend (dtype, block size, context length, KV cache size)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="HF folder or GGUF file; None: the default SmolLM2 model")
    backend: str | None = Field(None, description="backend name; None: $PLINTH_BACKEND or the best probe")
    dtype: str | None = Field(None, description="compute dtype; None: the backend's default")
    kv_cache_dtype: str | None = Field(None, description="KV cache dtype; None: the compute dtype")
    block_size: int | None = Field(None, ge=1, le=1024, description="tokens per KV block")
    max_model_len: int | None = Field(None, ge=2, description="context length; None: the model's")
    max_num_batched_tokens: int = Field(1024, ge=16, description="token budget of one step")
    max_num_seqs: int = Field(64, ge=1, description="sequences in one step at most")
    kv_cache_memory_gb: float | None = Field(None, gt=0, description="KV cache size; None: from free memory")
    num_kv_blocks: int | None = Field(None, ge=2, description="exact number of KV blocks (overrides memory)")
    enable_prefix_caching: bool = True
    strict: bool = Field(False, description="refuse reference-kernel fallbacks instead of warning")
    allow_pickle: bool = Field(False, description="allow loading pickle (.bin/.pt) checkpoints")
    num_threads: int | None = Field(None, ge=1, description="host threads for CPU kernels")
    enforce_eager: bool = Field(
        False, description="run every step eagerly; False: replay decode steps from step graphs where the backend can"
    )
    quantization: Literal["auto", "none", "int8"] = Field(
        "auto",
        description="auto: keep a checkpoint's quantized weights where the backend multiplies them natively; "
        "none: dequantize everything to dtype; int8: also quantize floating-point linear weights to q8_0",
    )
