"""``plinth serve``: build the engine, then run the app under uvicorn until SIGTERM / Ctrl-C.

Shutdown: uvicorn stops accepting connections, lets running requests finish for ``--drain-timeout``
seconds, then cancels the rest (which aborts their engine requests); the app's lifespan then stops
the engine thread and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from plinth.engine_args import add_engine_arguments, add_kv_cache_prefault_argument, engine_options

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
    p.add_argument("--max-output-tokens", type=int, default=None, help="clamp every request's max_tokens to N")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="seconds running requests get on shutdown")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")


def run_serve(args: argparse.Namespace) -> int:
    """Serve until a signal; the exit status (0 after a graceful shutdown)."""
    import uvicorn

    from plinth.config import EngineConfig
    from plinth.model.loader import resolve_model
    from plinth.runtime.engine import LLMEngine
    from plinth.server.app import ServerSettings, build_app
    from plinth.server.async_engine import AsyncEngine
    from plinth.startup import start_up_done

    cache = {"num_kv_blocks": args.num_kv_blocks, "kv_cache_memory_gb": args.kv_cache_memory_gb}
    config = EngineConfig(
        **engine_options(args),
        enable_prefix_caching=not args.no_prefix_caching,
        **{k: v for k, v in cache.items() if v is not None},
    )
    source = resolve_model(args.model)
    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model or source.path.stem],
        model_root=str(source.path),
        api_key=args.api_key or os.environ.get("PLINTH_API_KEY") or None,
        max_output_tokens=args.max_output_tokens,
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting=args.max_waiting)
    app = build_app(engine, settings)
    start_up_done()  # `plinth serve` paused the cyclic GC for start-up (plinth.startup)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info" if args.verbose_log else "warning",
            access_log=args.access_log,
            timeout_graceful_shutdown=max(args.drain_timeout, 0.0),
        )
    )
    # uvicorn re-raises the signal it caught after its graceful shutdown; with the default SIGTERM
    # disposition that kills the process (-15). A handler of our own makes the re-raise a no-op.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    e = engine.engine
    print(
        f"plinth: serving {settings.served_model_names[0]} on http://{args.host}:{args.port} "
        f"({e.backend.name} backend, context {e.max_model_len}, {e.num_blocks} KV blocks of {e.block_size})",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    print("plinth: server stopped", file=sys.stderr, flush=True)
    return 0
