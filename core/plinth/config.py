"""Engine configuration: what the user types in, checked field by field so errors name the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plinth.platform.values import MAX_LORA_RANK
from plinth.validation import InvalidParameter, check_bool, check_float, check_int, check_str

#: The values of :attr:`EngineConfig.quantization`.
QUANTIZATION_CHOICES = ("auto", "none", "int8")
DISTRIBUTED_EXECUTORS = ("mp", "ray")
#: ``kv_cache_dtype`` spellings other engines use (vLLM's) -> plinth's: ``auto`` is the compute dtype
#: (None), ``fp8`` and ``fp8_e4m3`` are ``float8_e4m3fn``; any other name is passed on for the
#: backend's capabilities to judge.
KV_CACHE_DTYPE_ALIASES: dict[str, str | None] = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def kv_cache_dtype_name(value: str | None) -> str | None:
    """A ``kv_cache_dtype`` as plinth names it (:data:`KV_CACHE_DTYPE_ALIASES`); None stays None."""
    return value if value is None else KV_CACHE_DTYPE_ALIASES.get(value, value)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything that decides how an engine is built. Unset fields are chosen from the model and
    the backend (dtype, block size, context length, KV cache size).

    A value of the wrong type or out of range raises :class:`~plinth.validation.InvalidParameter`
    naming the field; an unknown keyword raises ``TypeError``.

    - ``model``: HF folder or GGUF file; None: the default SmolLM2 model.
    - ``backend``: backend name; None: ``$PLINTH_BACKEND`` or the best probe.
    - ``dtype`` / ``kv_cache_dtype``: compute / KV cache dtype; None: the backend's / the compute dtype.
      ``float8_e4m3fn`` (plugin API 1.16) is a KV-cache dtype only, where the backend declares it;
      vLLM's spellings are taken too (``auto``: the compute dtype, ``fp8``/``fp8_e4m3``: float8_e4m3fn).
    - ``block_size`` (1-1024): tokens per KV block.
    - ``max_model_len`` (>= 2): context length; None: the model's.
    - ``max_num_batched_tokens`` (>= 16): the token budget of one step.
    - ``max_num_seqs`` (>= 1): sequences in one step at most.
    - ``kv_cache_memory_gb`` (> 0): KV cache size; None: from free memory.
    - ``kv_cache_prefault``: ask the backend to back every page of the KV cache at start-up
      (``Backend.allocate_kv_cache(prefault=True)``), so no step pays for the first touch of its pages
      (what a long-running server wants; the cpu backend: 1.2 s for 1 GiB on the dev VM, and the
      64-request throughput workload ran 4% faster); False: a backend that maps its cache lazily has
      pages faulted in as blocks are first written (what a one-shot ``plinth generate`` wants).
    - ``num_kv_blocks`` (>= 2): exact number of KV blocks (overrides memory).
    - ``strict``: refuse reference-kernel fallbacks instead of warning.
    - ``allow_pickle``: allow loading pickle (.bin/.pt) checkpoints.
    - ``num_threads`` (>= 1): host threads for the backend's kernels (``DeviceServices.set_num_threads``).
    - ``enforce_eager``: run every step eagerly; False: replay decode steps from step graphs where
      the backend can, and compile whole steps where it declares step buckets (API 1.5; eager, such
      a backend's steps are still padded to its buckets).
    - ``compile_cache_dir``: where a backend that compiles whole steps (API 1.5) keeps its compiled
      executables across processes; None: ``$PLINTH_COMPILE_CACHE``, else ``~/.cache/plinth/compile``;
      ``""``: no disk cache.
    - ``quantization``: "auto" keeps a checkpoint's quantized weights where the backend multiplies
      them natively; "none" dequantizes everything to dtype; "int8" also quantizes floating-point
      linear weights to q8_0.
    - ``tensor_parallel_size`` (1-64): ranks the model is split over (rank 0 here, the others as
      worker processes on this host over ``torch.distributed``); see docs/scale-out.md.
    - ``pipeline_parallel_size`` (1-64): stages the layers are split into, each over
      ``tensor_parallel_size`` ranks (``world_size`` = the product).
    - ``distributed_timeout_s``: how long a collective waits for a rank before the engine fails
      (a dead worker fails it at once; a hung one at this timeout).
    - ``distributed_executor``: "mp" starts the workers as processes on this host; "ray" as Ray actors
      on an existing Ray cluster, placed by a placement group (``pip install ray``).
    - ``num_speculative_tokens`` (0-16): n-gram (prompt-lookup) speculative decoding: each decoding
      sequence gets up to this many draft tokens per step, looked up in its own prompt + output, and
      verified in the same forward (distribution-preserving; greedy outputs are unchanged); 0: off.
      Single-process engines only, not with static-shape (step-bucket) backends. See docs/serving.md.
    - ``ngram_prompt_lookup_max`` / ``ngram_prompt_lookup_min`` (1-16, min <= max): the longest and
      shortest suffix of a sequence looked up for drafts (the longest that occurs wins; then the
      most recent occurrence). Defaults 6 and 3: replaying the greedy answers of ``plinth bench
      speculative`` through the lookup, a minimum of 2 drafts at 9% of the tokens of the
      non-repetitive answers with 18% of drafts accepted (mostly wasted verification), 3 at 3% with 34%
      accepted; the repetitive answers' acceptance rises from 82% to 94% (k = 4).
    - ``enable_lora``: serve LoRA adapters (PEFT folders, loaded with ``LLMEngine.add_lora`` or at
      start-up); requests with different adapters (and none) batch together. Single-process engines
      without step buckets only. See docs/serving.md.
    - ``max_loras`` (1-64): adapters resident at once (slots allocated at start-up).
    - ``max_lora_rank`` (1-64): the largest adapter rank ``r`` accepted; every slot holds this rank.
    """

    model: str | None = None
    backend: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    kv_cache_memory_gb: float | None = None
    kv_cache_prefault: bool = False
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    strict: bool = False
    allow_pickle: bool = False
    num_threads: int | None = None
    enforce_eager: bool = False
    compile_cache_dir: str | None = None
    quantization: Literal["auto", "none", "int8"] = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_timeout_s: float = 60.0
    distributed_executor: Literal["mp", "ray"] = "mp"
    num_speculative_tokens: int = 0
    ngram_prompt_lookup_max: int = 6
    ngram_prompt_lookup_min: int = 3
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        owner = type(self).__name__
        checked = {
            "model": check_str(owner, "model", self.model, optional=True),
            "backend": check_str(owner, "backend", self.backend, optional=True),
            "dtype": check_str(owner, "dtype", self.dtype, optional=True),
            "kv_cache_dtype": kv_cache_dtype_name(
                check_str(owner, "kv_cache_dtype", self.kv_cache_dtype, optional=True)
            ),
            "block_size": check_int(owner, "block_size", self.block_size, optional=True, ge=1, le=1024),
            "max_model_len": check_int(owner, "max_model_len", self.max_model_len, optional=True, ge=2),
            "max_num_batched_tokens": check_int(owner, "max_num_batched_tokens", self.max_num_batched_tokens, ge=16),
            "max_num_seqs": check_int(owner, "max_num_seqs", self.max_num_seqs, ge=1),
            "kv_cache_memory_gb": check_float(
                owner, "kv_cache_memory_gb", self.kv_cache_memory_gb, optional=True, gt=0
            ),
            "kv_cache_prefault": check_bool(owner, "kv_cache_prefault", self.kv_cache_prefault),
            "num_kv_blocks": check_int(owner, "num_kv_blocks", self.num_kv_blocks, optional=True, ge=2),
            "enable_prefix_caching": check_bool(owner, "enable_prefix_caching", self.enable_prefix_caching),
            "strict": check_bool(owner, "strict", self.strict),
            "allow_pickle": check_bool(owner, "allow_pickle", self.allow_pickle),
            "num_threads": check_int(owner, "num_threads", self.num_threads, optional=True, ge=1),
            "enforce_eager": check_bool(owner, "enforce_eager", self.enforce_eager),
            "compile_cache_dir": check_str(owner, "compile_cache_dir", self.compile_cache_dir, optional=True),
            "quantization": check_str(owner, "quantization", self.quantization, choices=QUANTIZATION_CHOICES),
            "tensor_parallel_size": check_int(owner, "tensor_parallel_size", self.tensor_parallel_size, ge=1, le=64),
            "pipeline_parallel_size": check_int(
                owner, "pipeline_parallel_size", self.pipeline_parallel_size, ge=1, le=64
            ),
            "distributed_timeout_s": check_float(owner, "distributed_timeout_s", self.distributed_timeout_s, gt=0),
            "distributed_executor": check_str(
                owner, "distributed_executor", self.distributed_executor, choices=DISTRIBUTED_EXECUTORS
            ),
            "num_speculative_tokens": check_int(
                owner, "num_speculative_tokens", self.num_speculative_tokens, ge=0, le=16
            ),
            "ngram_prompt_lookup_max": check_int(
                owner, "ngram_prompt_lookup_max", self.ngram_prompt_lookup_max, ge=1, le=16
            ),
            "ngram_prompt_lookup_min": check_int(
                owner, "ngram_prompt_lookup_min", self.ngram_prompt_lookup_min, ge=1, le=16
            ),
            "enable_lora": check_bool(owner, "enable_lora", self.enable_lora),
            "max_loras": check_int(owner, "max_loras", self.max_loras, ge=1, le=64),
            "max_lora_rank": check_int(owner, "max_lora_rank", self.max_lora_rank, ge=1, le=MAX_LORA_RANK),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise InvalidParameter(
                owner,
                "ngram_prompt_lookup_min",
                f"must not exceed ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max}), "
                f"got {self.ngram_prompt_lookup_min}",
            )
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ValueError(
                f"{owner}: enable_lora with pipeline_parallel_size {self.pipeline_parallel_size}: LoRA adapters "
                "are served without pipeline parallelism only (tensor parallelism splits them with the model)"
            )
        if self.num_speculative_tokens and self.world_size > 1:
            raise ValueError(
                f"{owner}: num_speculative_tokens with {self.world_size} ranks: speculative decoding runs "
                "in single-process engines only (tensor_parallel_size = pipeline_parallel_size = 1)"
            )

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor-parallel times pipeline-parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def compile_cache_dir(config: EngineConfig) -> str | None:
    """The directory compiled steps are kept in (see ``EngineConfig.compile_cache_dir``); None: none."""
    import os

    chosen = config.compile_cache_dir
    if chosen is None:
        chosen = os.environ.get("PLINTH_COMPILE_CACHE")
    if chosen is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(base, "plinth", "compile")
    return chosen or None
