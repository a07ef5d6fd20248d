"""The engine options every command that builds an engine shares, and their mapping to EngineConfig.

Torch-free, so building a parser stays quick (``plinth --help``).
"""

from __future__ import annotations

import argparse
from typing import Any

from plinth.config import kv_cache_dtype_name

QUANTIZATION_HELP = (
    "auto (default): keep a GGUF's q4_1/q8_0 weights where the backend multiplies them natively; "
    "none: dequantize every weight to --dtype; int8: also quantize floating-point weights to q8_0"
)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--model --backend --dtype --kv-cache-dtype --threads --quantization --enforce-eager
    --tensor-parallel-size --distributed-timeout``: what selects the model, its kernels and how many
    ranks run it."""
    p.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default=None, help="backend name (default: $PLINTH_BACKEND or the best probe)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the backend's)")
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        type=kv_cache_dtype_name,
        help="KV cache dtype, e.g. bfloat16 for half the cache memory, fp8 (float8_e4m3fn) for a quarter "
        "where the backend has it (default, or auto: the compute dtype)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="host threads for CPU kernels (default: the backend's choice)"
    )
    p.add_argument("--quantization", choices=("auto", "none", "int8"), default="auto", help=QUANTIZATION_HELP)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no step graphs for decode steps (see docs/architecture.md)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="split the model over N ranks: this process and N-1 workers (--distributed-executor; docs/scale-out.md)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=positive_int,
        default=1,
        help="split the layers into N stages, each over -tp ranks (N x TP ranks in all; docs/scale-out.md)",
    )
    p.add_argument(
        "--distributed-executor",
        choices=("mp", "ray"),
        default="mp",
        help="mp: worker processes on this host (default); ray: Ray actors on an existing Ray cluster ($RAY_ADDRESS)",
    )
    p.add_argument(
        "--distributed-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="how long a collective waits for a rank before the engine fails (default 60)",
    )
    add_speculative_arguments(p)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """``--num-speculative-tokens --ngram-prompt-lookup-max --ngram-prompt-lookup-min`` (vLLM's names)."""
    p.add_argument(
        "--num-speculative-tokens",
        type=int_at_least(0),
        default=None,
        metavar="K",
        help="n-gram (prompt-lookup) speculative decoding: up to K draft tokens per step, looked up in each "
        "sequence's own prompt + output and verified in the same forward (default 0: off; docs/serving.md)",
    )
    p.add_argument(
        "--ngram-prompt-lookup-max",
        type=positive_int,
        default=None,
        metavar="N",
        help="the longest suffix of a sequence looked up for drafts (default 6)",
    )
    p.add_argument(
        "--ngram-prompt-lookup-min",
        type=positive_int,
        default=None,
        metavar="N",
        help="the shortest suffix that counts as a match (default 3)",
    )


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a bad value is a usage error naming the option)."""
    return _at_least(int, text, 1)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (``inf`` included)."""
    value = _number(float, text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text!r}")
    return value


def int_at_least(low: int) -> Any:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        return _at_least(int, text, low)

    parse.__name__ = "int"  # argparse names the type in its message
    return parse


def _number(kind: type[int] | type[float], text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def _at_least(kind: type[int], text: str, low: int) -> int:
    value = _number(kind, text)
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {text!r}")
    return int(value)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from :func:`add_engine_arguments`'s options (and the optional ones a command
    adds: ``--max-model-len``, ``--strict``, ``--allow-pickle``, ``--max-num-seqs``,
    ``--max-num-batched-tokens``, ``--no-kv-cache-prefault``), leaving out what was not given so the
    config's defaults apply."""
    options: dict[str, Any] = {
        "model": args.model,
        "backend": args.backend,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_threads": args.threads,
        "quantization": args.quantization,
        "enforce_eager": args.enforce_eager,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "distributed_timeout_s": args.distributed_timeout,
        "distributed_executor": args.distributed_executor,
    }
    for field in (
        "max_model_len",
        "strict",
        "allow_pickle",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_prefault",
        "num_speculative_tokens",
        "ngram_prompt_lookup_max",
        "ngram_prompt_lookup_min",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
    ):
        value = getattr(args, field, None)
        if value is not None:
            options[field] = value
    return options


def add_kv_cache_prefault_argument(p: argparse.ArgumentParser) -> None:
    """``--no-kv-cache-prefault`` for the long-running and steady-state commands (serve, bench
    throughput), whose engines write their whole KV cache at start-up by default."""
    p.add_argument(
        "--no-kv-cache-prefault",
        dest="kv_cache_prefault",
        action="store_false",
        default=True,
        help="fault KV-cache pages in as blocks are first written, instead of writing the whole cache at start-up",
    )
