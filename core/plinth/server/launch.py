"""``plinth serve``: build the engine, then run the app under uvicorn until SIGTERM / Ctrl-C.

Shutdown is :mod:`plinth.server.drain`'s: new requests get a JSON 503 at once, running ones get
``--drain-timeout`` seconds, the rest end with an in-band error (streams) or a JSON 503; the exit
status is 0 when everything drained, 1 when requests were cut. A second signal cuts at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from plinth.engine_args import add_engine_arguments, add_kv_cache_prefault_argument, engine_options
from plinth.server import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``plinth serve`` (engine options, then HTTP ones)."""
    add_engine_arguments(p)
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one step at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV-cache blocks")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV-cache size (default: from free memory)")
    add_kv_cache_prefault_argument(p)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--strict", action="store_true", help="refuse reference-kernel fallbacks")
    p.add_argument("--allow-pickle", action="store_true", help="allow pickle (.bin/.pt) checkpoints")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $PLINTH_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use (first is main)")
    p.add_argument("--max-waiting", type=int, default=None, help="reject (503) new requests beyond N queued ones")
    p.add_argument(
        "--restart-workers",
        type=int,
        default=0,
        metavar="N",
        help="after a tensor/pipeline-parallel worker dies or hangs, fail the requests it held, start the workers "
        "again and keep serving, up to N times (default 0: exit non-zero)",
    )
    p.add_argument("--max-output-tokens", type=int, default=None, help="clamp every request's max_tokens to N")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGTERM/SIGINT before they end with an error (default: 10)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"refuse (413) request bodies larger than this (default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    p.add_argument(
        "--max-request-sequences",
        type=int,
        default=None,
        help="refuse (400) a request of more than N sequences, prompts x n (default: --max-num-seqs)",
    )
    p.add_argument(
        "--public-metrics", action="store_true", help="serve /metrics without the API key (for Prometheus scrapers)"
    )
    p.add_argument("--enable-docs", action="store_true", help="serve the Swagger UI at /docs (loads it from a CDN)")
    p.add_argument(
        "--no-vllm-metric-names", action="store_true", help="export metrics only as plinth:*, not also as vllm:*"
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument(
        "--lora",
        type=lora_module,
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter in folder PATH as model NAME (repeatable; turns on --enable-lora)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters (loaded with --lora or POST /v1/load_lora_adapter)",
    )
    p.add_argument("--max-loras", type=int, default=None, help="LoRA adapters resident at once (default 4)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest LoRA rank accepted (default 16)")


def lora_module(value: str) -> tuple[str, str]:
    """``--lora NAME=PATH`` -> ``(NAME, PATH)``."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter folder), got {value!r}")
    return name, path


def run_serve(args: argparse.Namespace) -> int:
    """Serve until a signal; the exit status (0 when every request drained, 1 when some were cut)."""
    import uvicorn

    from plinth.config import EngineConfig
    from plinth.model.loader import resolve_model
    from plinth.runtime.engine import LLMEngine
    from plinth.server.app import ServerSettings, build_app
    from plinth.server.async_engine import AsyncEngine
    from plinth.server.drain import CUT_GRACE_S, Drain, DrainingServer
    from plinth.startup import start_up_done

    cache = {"num_kv_blocks": args.num_kv_blocks, "kv_cache_memory_gb": args.kv_cache_memory_gb}
    if args.lora:
        args.enable_lora = True
    config = EngineConfig(
        **engine_options(args),
        enable_prefix_caching=not args.no_prefix_caching,
        **{k: v for k, v in cache.items() if v is not None},
    )
    source = resolve_model(args.model)
    settings = ServerSettings(
        served_model_names=args.served_model_name or [_default_name(source.path)],
        api_key=args.api_key or os.environ.get("PLINTH_API_KEY") or None,
        max_output_tokens=args.max_output_tokens,
        max_request_bytes=args.max_request_bytes,
        max_request_sequences=args.max_request_sequences,
        public_metrics=args.public_metrics,
        enable_docs=args.enable_docs,
        vllm_metric_names=not args.no_vllm_metric_names,
    )
    if args.restart_workers < 0:
        raise SystemExit(f"plinth serve: --restart-workers must be >= 0, got {args.restart_workers}")

    def build_engine() -> LLMEngine:  # at start, and again after a worker failure (--restart-workers)
        built = LLMEngine(config)
        for name, path in args.lora or []:
            if name in settings.served_model_names:
                raise SystemExit(f"plinth serve: --lora {name}={path}: {name!r} is the base model's served name")
            built.add_lora(name, path)  # a refused adapter stops the start-up, naming the field
        return built

    engine = AsyncEngine(
        build_engine(),
        max_waiting=args.max_waiting,
        rebuild=build_engine,  # the same config: same backend, model, workers, KV cache, adapters
        max_restarts=args.restart_workers,
    )
    holder: dict[str, Any] = {}
    app = build_app(engine, settings, on_start=lambda loop: holder["drain"].bind(loop))
    start_up_done()  # `plinth serve` paused the cyclic GC for start-up (plinth.startup)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info" if args.verbose_log else "warning",
            access_log=args.access_log,
            # only a backstop: the drain has ended every request before uvicorn's shutdown starts
            timeout_graceful_shutdown=int(CUT_GRACE_S),
        )
    )
    drain = holder["drain"] = server.drain = Drain(app.state.plinth, args.drain_timeout, server.exit_now)

    def on_fatal(exc: BaseException) -> None:  # on the engine thread: the engine cannot step again
        holder["fatal"] = exc
        server.exit_now()

    engine.on_fatal = on_fatal
    e = engine.engine
    print(
        f"plinth: serving {settings.served_model_names[0]} on http://{args.host}:{args.port} "
        f"({e.backend.name} backend, context {e.max_model_len}, {e.num_blocks} KV blocks of {e.block_size})",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    engine.engine.close()  # the engine serving last (a restart replaces it)
    if "fatal" in holder:
        print(f"plinth: the engine stopped: {holder['fatal']}", file=sys.stderr, flush=True)
        return 1
    if drain.clean is False:
        print(
            f"plinth: server stopped; {drain.num_cut} request(s) did not finish within --drain-timeout "
            f"{args.drain_timeout:g} s and ended with an error",
            file=sys.stderr,
            flush=True,
        )
    else:
        print("plinth: server stopped", file=sys.stderr, flush=True)
    return drain.exit_code


def _default_name(path: Path) -> str:
    """The served name when none is given: the model file's stem or the folder's name, never its path
    (``/v1/models`` shows it to every client)."""
    return path.stem if path.is_file() else path.name
