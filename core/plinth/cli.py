"""The ``plinth`` command line (also ``python -m plinth``): generate, chat, backends, serve, bench,
conformance, plugin new."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the likeliest tokens totalling P; 1 is off")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K likeliest tokens; 0 is off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens under P x the likeliest one's probability")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="penalize tokens of the prompt and output; 1 is off"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


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
        prompt = llm.encode_chat([{"role": "user", "content": prompt}])  # checked as llm.chat checks it
    [out] = llm.generate(prompt, params, on_output=stream)
    text = out.outputs[0].text
    sys.stdout.write(text[streamed:] + "\n")
    _report(llm, out)
    timings.write(llm.engine.startup_seconds)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A chat session on the terminal (or one reply to the message given as an argument), streamed;
    see :mod:`plinth.chat_session`."""
    from plinth.chat_session import ChatSession, run_interactive

    params = _params(args)
    llm = _llm(args)
    session = ChatSession(llm, params, system=args.system)
    if args.message is None:
        llm.encode_chat([*session.messages, {"role": "user", "content": "hi"}])  # no template: say so now
        return run_interactive(session)
    reply = session.send(args.message)
    if reply.output is None:  # Ctrl-C stopped it
        return 130
    _report(llm, reply.output)
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
    if args.verbose_log:
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


class HelpFormatter(argparse.HelpFormatter):
    """Help that ends each option's text with its default, unless the text names it already or there
    is nothing to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is False
            or default == []
            or default is argparse.SUPPRESS
            or isinstance(action, argparse._VersionAction | argparse._HelpAction)
        ):
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class ArgumentParser(argparse.ArgumentParser):
    """The ``plinth`` parsers: every one (subcommands' too, through add_subparsers) shows defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """As argparse's; an option added without help still shows its default (argparse shows no
        line at all for it otherwise)."""
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.help is None and action.default not in (None, False):
            action.help = "default: %(default)s"
        return action


def _verbose_arg(p: argparse.ArgumentParser, top: bool = False) -> None:
    # the subcommands' copies default to SUPPRESS: `plinth -v generate` keeps the top level's count
    p.add_argument(
        "-v",
        "--verbose",
        dest="verbose_log",
        action="count",
        default=0 if top else argparse.SUPPRESS,
        help="log at INFO level (-vv: DEBUG), and print the traceback of an error",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``plinth`` command."""
    from plinth import __version__

    parser = ArgumentParser(prog="plinth", description="LLM inference on pluggable hardware backends")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _verbose_arg(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="complete a prompt",
        description="Complete a prompt; the text streams to stdout, speed to stderr.",
    )
    _engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--timings-json", default=None, help=argparse.SUPPRESS)  # for `plinth bench latency`
    gen.add_argument("prompt", help="the text to complete")
    _verbose_arg(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="chat with the model (interactive without MESSAGE)",
        description="Chat with the model; replies stream as they are generated. Interactive without MESSAGE: "
        "Ctrl-C stops a reply, Ctrl-C twice at the prompt, Ctrl-D or /exit quits; the oldest exchanges are "
        "dropped when the conversation outgrows the context.",
    )
    _engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.add_argument("message", nargs="?", default=None, help="one message to answer, then exit")
    _verbose_arg(chat)
    chat.set_defaults(func=cmd_chat)

    backends = sub.add_parser("backends", help="list installed backends ranked by probe score")
    _verbose_arg(backends)  # also lists plugins, hooks and API versions here
    backends.set_defaults(func=cmd_backends)

    from plinth.bench.serve import add_bench_serve_arguments
    from plinth.server.launch import add_serve_arguments

    serve = sub.add_parser("serve", help="serve the OpenAI and Anthropic HTTP APIs")
    add_serve_arguments(serve)
    _verbose_arg(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_serve = bench_sub.add_parser("serve", help="load-test a running server (streaming)")
    add_bench_serve_arguments(bench_serve)
    _verbose_arg(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)

    from plinth.bench.latency import add_bench_latency_arguments, run_bench_latency
    from plinth.bench.throughput import add_bench_throughput_arguments, run_bench_throughput

    bench_tp = bench_sub.add_parser("throughput", help="offline throughput on a fixed workload")
    add_bench_throughput_arguments(bench_tp)
    _verbose_arg(bench_tp)
    bench_tp.set_defaults(func=run_bench_throughput)
    bench_lat = bench_sub.add_parser("latency", help="batch-1 decode speed, time to first token, cold start")
    add_bench_latency_arguments(bench_lat)
    _verbose_arg(bench_lat)
    bench_lat.set_defaults(func=run_bench_latency)
    from plinth.bench.prefill import add_bench_prefill_arguments, run_bench_prefill

    bench_pre = bench_sub.add_parser("prefill", help="prompt processing tok/s against the GEMM peak")
    add_bench_prefill_arguments(bench_pre)
    _verbose_arg(bench_pre)
    bench_pre.set_defaults(func=run_bench_prefill)
    from plinth.bench.speculative import add_bench_speculative_arguments, run_bench_speculative

    bench_spec = bench_sub.add_parser(
        "speculative", help="batch-1 decode with and without n-gram speculative decoding, side by side"
    )
    add_bench_speculative_arguments(bench_spec)
    _verbose_arg(bench_spec)
    bench_spec.set_defaults(func=run_bench_speculative)

    from plinth_conformance.cli import add_subcommands  # ships in this distribution

    add_subcommands(sub)  # conformance, plugin new
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plinth`` command; returns the exit status.

    A user error (a bad option, path or request, an unreachable server) is one line on stderr and
    status 2, its traceback only with ``-v``; Ctrl-C is status 130 without a traceback.
    """
    args = build_parser().parse_args(argv)
    if args.func in (cmd_generate, cmd_chat, cmd_serve):
        pause_collector()  # until the engine is built (_llm, run_serve): start-up allocates what the process keeps
    verbosity = args.verbose_log
    logging.basicConfig(
        level=logging.DEBUG if verbosity > 1 else logging.INFO if verbosity else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from plinth.bench import BenchError
    from plinth.platform.backend import NotSupported
    from plinth.platform.host import BackendError
    from plinth.runtime.engine import InvalidRequest
    from plinth.validation import InvalidParameter

    try:
        return int(args.func(args))
    except InvalidParameter as exc:  # before ValueError: it is one
        _user_error(f"invalid option: {exc}", verbosity)
        return 2
    except (BackendError, NotSupported, InvalidRequest, BenchError, OSError, ValueError) as exc:
        # user errors (bad path, unsupported architecture, refused pickle, unwritable output, ...)
        _user_error(f"error: {exc}", verbosity)
        return 2
    except KeyboardInterrupt:
        print("\nplinth: interrupted", file=sys.stderr)
        return 130
    finally:
        resume_collector()  # only if start-up failed before the engine was built


def _user_error(message: str, verbosity: int) -> None:
    if verbosity:
        traceback.print_exc()
    print(f"plinth: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
