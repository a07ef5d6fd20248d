"""The ``plinth`` command line: generate, chat, backends, serve, bench serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from plinth.startup import pause_collector, resume_collector, start_up_done

if TYPE_CHECKING:
    from plinth.sampling_params import SamplingParams

# The interpreter has started: torch and the engine are imported from here on, by the
# functions that need them (`plinth --help` stays quick), and --timings-json times them from here.
_STARTED_AT = time.time()


def _engine_args(p: argparse.ArgumentParser) -> None:
    from plinth.engine_args import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--strict", action="store_true", help="refuse reference-kernel fallbacks")
    p.add_argument("--allow-pickle", action="store_true", help="allow pickle (.bin/.pt) checkpoints")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _params(args: argparse.Namespace) -> SamplingParams:
    from plinth.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _llm(args: argparse.Namespace):  # noqa: ANN202 - imports torch lazily
    from plinth.engine_args import engine_options
    from plinth.llm import LLM

    llm = LLM(**engine_options(args))
    start_up_done()  # main() paused the cyclic GC for start-up
    return llm


def _report(llm, out) -> None:  # noqa: ANN001
    m = out.metrics
    ttft = m.time_to_first_token
    speed = m.decode_tokens_per_s
    engine = llm.engine
    print(
        f"[{engine.backend.name} backend, {m.num_prompt_tokens} prompt + {m.num_generated_tokens} generated tokens, "
        f"time to first token {ttft:.3f} s, decode {speed:.1f} tokens/s, load {engine.load_seconds:.1f} s, "
        f"finish: {out.outputs[0].finish_reason}]"
        if ttft is not None and speed is not None
        else f"[{engine.backend.name} backend, {m.num_generated_tokens} tokens]",
        file=sys.stderr,
    )
    for note in engine.kernels.fallbacks:  # slow ops an operator should know about
        print(f"[reference fallback: {note}]", file=sys.stderr)


class _Timings:
    """Wall-clock marks of one ``generate`` run, written as JSON for ``plinth bench latency``.

    ``time.time()`` rather than a monotonic clock: the benchmark compares them with its own clock
    read before it started this process. Built without a path it records nothing (a null timer).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.marks: dict[str, float] = {"python": _STARTED_AT} if path else {}

    def mark(self, name: str) -> None:
        if self.path and name not in self.marks:
            self.marks[name] = time.time()

    def write(self, engine_phases: dict[str, float]) -> None:
        if self.path:
            with open(self.path, "w") as f:
                json.dump({"marks": self.marks, "engine_phases": engine_phases}, f)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion of a prompt and print it with its speed."""
    timings = _Timings(args.timings_json)
    params = _params(args)
    from plinth.llm import LLM  # noqa: F401 - imported here so that the import phase is timed apart

    timings.mark("imports")
    llm = _llm(args)
    timings.mark("engine")
    streamed = 0

    def stream(out) -> None:  # noqa: ANN001
        nonlocal streamed
        if out.outputs[0].token_ids:
            timings.mark("first_token")
        text = out.outputs[0].text
        sys.stdout.write(text[streamed:])
        sys.stdout.flush()
        streamed = len(text)

    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = llm.tokenizer.encode(prompt, add_special_tokens=False)
    [out] = llm.generate(prompt, params, on_output=stream)
    text = out.outputs[0].text
    sys.stdout.write(text[streamed:] + "\n")
    _report(llm, out)
    timings.write(llm.engine.startup_seconds)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A chat session on the terminal (or one reply to the message given as an argument)."""
    params = _params(args)
    llm = _llm(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = args.message is None
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            if line.strip() in {"/exit", "/quit"}:
                return 0
        else:
            line = args.message
        messages.append({"role": "user", "content": line})
        [out] = llm.chat(messages, params)
        reply = out.outputs[0].text
        print(("assistant> " if interactive else "") + reply)
        messages.append({"role": "assistant", "content": reply})
        if not interactive:
            _report(llm, out)
            return 0


def cmd_backends(args: argparse.Namespace) -> int:
    """Print installed backends ranked by probe score, with reasons (and plugins with --verbose)."""
    from plinth.platform.host import BackendError, default_host

    host = default_host()
    statuses = host.statuses()
    try:
        chosen = host.select(None).name
    except BackendError:
        chosen = None
    rows = [("", "backend", "score", "plugin", "device", "reasons")]
    for s in statuses:
        device = s.probe.device_name if s.probe else "-"
        if s.probe and s.probe.emulation:
            device += " (emulation)"
        rows.append(
            (
                "*" if s.name == chosen else "",
                s.name,
                str(s.score),
                f"{s.plugin.dist_name} {s.plugin.dist_version}",
                device,
                "; ".join(s.reasons),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5])
    env = os.environ.get("PLINTH_BACKEND")
    print(f"\nselected: {chosen or 'none'}" + (f" (PLINTH_BACKEND={env})" if env else " (highest score)"))
    failed = [p for p in host.plugins if p.error]
    for p in failed:
        print(f"plugin {p.name} ({p.dist_name} {p.dist_version}) failed: {p.error}")
    if args.verbose:
        from plinth.hookspecs import PLUGIN_API_VERSION

        print(f"\nplugin API {PLUGIN_API_VERSION[0]}.{PLUGIN_API_VERSION[1]}; plugins:")
        by_name = {s.name: s for s in statuses}
        for p in host.plugins:
            apis = sorted({".".join(map(str, by_name[b].backend.api_version)) for b in p.backends if b in by_name})
            print(
                f"  {p.name}: {p.dist_name} {p.dist_version} ({p.module}); hooks: {', '.join(p.hooks) or '-'}; "
                f"backends: {', '.join(p.backends) or '-'}; API {', '.join(apis) or '-'}"
                + (f"; ERROR {p.error}" if p.error else "")
            )
    return 0 if chosen else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the HTTP server (implementation: plinth.server.launch)."""
    from plinth.server.launch import run_serve

    return run_serve(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Load-test a running server (implementation: plinth.bench.serve)."""
    from plinth.bench.serve import run_bench_serve

    return run_bench_serve(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``plinth`` command."""
    parser = argparse.ArgumentParser(prog="plinth", description="LLM inference on pluggable hardware backends")
    parser.add_argument("-v", "--verbose-log", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt")
    _engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--timings-json", default=None, help=argparse.SUPPRESS)  # for `plinth bench latency`
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive without MESSAGE)")
    _engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("message", nargs="?", default=None)
    chat.set_defaults(func=cmd_chat)

    backends = sub.add_parser("backends", help="list installed backends ranked by probe score")
    backends.add_argument("--verbose", action="store_true", help="also list plugins, hooks and API versions")
    backends.set_defaults(func=cmd_backends)

    from plinth.bench.serve import add_bench_serve_arguments
    from plinth.server.launch import add_serve_arguments

    serve = sub.add_parser("serve", help="serve the OpenAI and Anthropic HTTP APIs")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test a running server (streaming)")
    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)

    from plinth.bench.latency import add_bench_latency_arguments, run_bench_latency
    from plinth.bench.throughput import add_bench_throughput_arguments, run_bench_throughput

    bench_tp = bench_sub.add_parser("throughput", help="offline throughput on a fixed workload")
    add_bench_throughput_arguments(bench_tp)
    bench_tp.set_defaults(func=run_bench_throughput)
    bench_lat = bench_sub.add_parser("latency", help="batch-1 decode speed, time to first token, cold start")
    add_bench_latency_arguments(bench_lat)
    bench_lat.set_defaults(func=run_bench_latency)

    from plinth_conformance.cli import add_subcommands  # ships in this distribution

    add_subcommands(sub)  # conformance, plugin new
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plinth`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.func in (cmd_generate, cmd_chat, cmd_serve):
        pause_collector()  # until the engine is built (_llm, run_serve): start-up allocates what the process keeps
    logging.basicConfig(
        level=logging.INFO if args.verbose_log else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from plinth.platform.backend import NotSupported
    from plinth.platform.host import BackendError
    from plinth.runtime.engine import InvalidRequest
    from plinth.validation import InvalidParameter

    try:
        return int(args.func(args))
    except InvalidParameter as exc:  # before ValueError: it is one
        print(f"plinth: invalid option: {exc}", file=sys.stderr)
        return 2
    except (BackendError, NotSupported, InvalidRequest, FileNotFoundError, ValueError) as exc:
        # user errors (bad path, unsupported architecture, refused pickle, ...): a message, no traceback
        print(f"plinth: error: {exc}", file=sys.stderr)
        return 2
    finally:
        resume_collector()  # only if start-up failed before the engine was built


if __name__ == "__main__":
    sys.exit(main())
