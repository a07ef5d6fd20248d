"""``plinth bench serve``: an asynchronous streaming load generator for an OpenAI-compatible server.

Sends ``--num-prompts`` requests, at most ``--concurrency`` at once and/or arriving as a Poisson
process of ``--request-rate`` requests/s, each streamed (``stream_options.include_usage`` gives the
exact token counts), and reports request throughput, output tokens/s, time to first token (TTFT),
time per output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency.

Prompts: synthetic (``--input-len`` tokens, calibrated with the server's ``/tokenize``; every prompt
starts differently so the prefix cache does not flatter the numbers) or a ShareGPT JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# fmt: off
_WORDS = (
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
    "woman", "place", "work", "week", "case", "point", "government", "company", "number", "group", "problem",
    "fact", "river", "stone", "cloud", "light", "music", "paper", "garden", "window", "table",
)
# fmt: on


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``plinth bench serve``."""
    from plinth.bench import output_path
    from plinth.engine_args import positive_float, positive_int

    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $PLINTH_API_KEY)")
    p.add_argument("--num-prompts", type=positive_int, default=32, help="requests to send")
    p.add_argument("--concurrency", type=positive_int, default=None, help="requests in flight at most (default: all)")
    p.add_argument(
        "--request-rate",
        type=positive_float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic prompts)")
    p.add_argument("--input-len", type=positive_int, default=128, help="synthetic prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="output tokens (ignore_eos is sent)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and arrival times")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request")
    p.add_argument(
        "--json",
        dest="json_out",
        type=output_path,
        default=None,
        help="write the results to this JSON file (default: none)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(slots=True)
class RequestResult:
    """One request's timings (seconds) and token counts."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, p50, p90, p99 of ``values`` (in ms with the default scale)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    xs = sorted(values)

    def pct(q: float) -> float:
        k = (len(xs) - 1) * q
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {
        "mean": scale * sum(xs) / len(xs),
        "p50": scale * pct(0.5),
        "p90": scale * pct(0.9),
        "p99": scale * pct(0.99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Aggregate metrics of a run (latencies in ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "mean_input_tokens": in_tokens / len(ok) if ok else 0.0,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": _percentiles([r.latency for r in ok]),
    }


async def _one(client: Any, url: str, payload: dict[str, Any]) -> RequestResult:
    """Send one streaming request; time its chunks."""
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last: float | None = None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if not text:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = last is not None
    if not result.ok:
        result.error = "no tokens received"
    return result


async def _prompts(client: Any, args: argparse.Namespace) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: synthetic, or from a ShareGPT file."""
    rng = random.Random(args.seed)
    if args.dataset:
        from plinth.bench import BenchError

        with open(args.dataset, encoding="utf-8") as f:
            data = json.load(f)
        pairs = []
        for item in data if isinstance(data, list) else []:
            turns = item.get("conversations") if isinstance(item, dict) else None
            if isinstance(turns, list) and len(turns) >= 2 and isinstance(turns[0], dict):
                value = turns[0].get("value")
                if value and isinstance(value, str):
                    pairs.append((value, args.output_len))
        rng.shuffle(pairs)
        if not pairs:
            raise BenchError(
                f"{args.dataset}: no usable ShareGPT conversations "
                '(expected a list of {"conversations": [{"value": ...}, ...]} with two turns or more)'
            )
        return [pairs[i % len(pairs)] for i in range(args.num_prompts)]

    def text(i: int, n_words: int) -> str:
        return f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(n_words))

    # calibrate words per token with the server's tokenizer
    resp = await client.post(f"{args.url}/tokenize", json={"prompt": text(0, args.input_len)})
    count = _json_field(resp, "count") if resp.status_code == 200 else None
    ratio = args.input_len / max(count, 1) if isinstance(count, int) else 1.0  # no /tokenize: 1 word ~ 1 token
    n_words = max(1, round(args.input_len * ratio) - 2)
    return [(text(i, n_words), args.output_len) for i in range(args.num_prompts)]


def _json_field(resp: Any, key: str) -> Any:
    """``resp.json()[key]``, or None when the body is not a JSON object holding it."""
    try:
        body = resp.json()
    except ValueError:
        return None
    return body.get(key) if isinstance(body, dict) else None


async def _first_model(client: Any, url: str) -> str:
    """The id of the first model ``GET /v1/models`` lists (--model's default)."""
    from plinth.bench import BenchError

    resp = await client.get(f"{url}/v1/models")
    if resp.status_code != 200:
        hint = " (give its key with --api-key or $PLINTH_API_KEY)" if resp.status_code == 401 else ""
        raise BenchError(f"GET {url}/v1/models answered HTTP {resp.status_code}{hint}: {resp.text[:200]}")
    data = _json_field(resp, "data")
    if not (isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str)):
        raise BenchError(
            f"GET {url}/v1/models did not list a model (is {url} an OpenAI-compatible server?); give --model"
        )
    return data[0]["id"]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; the summary."""
    import asyncio  # here, not at the top: the CLI imports this module to build its parser

    import httpx
    from tqdm.asyncio import tqdm

    key = args.api_key or os.environ.get("PLINTH_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limit = args.concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model
        if model is None:
            model = await _first_model(client, args.url)
        prompts = await _prompts(client, args)
        path = "/v1/completions" if args.endpoint == "completions" else "/v1/chat/completions"
        url = f"{args.url}{path}"
        semaphore = asyncio.Semaphore(limit)
        rng = random.Random(args.seed + 1)
        bar = tqdm(total=len(prompts), disable=args.no_progress, desc="requests", file=sys.stderr)

        async def run(prompt: str, max_tokens: int) -> RequestResult:
            payload: dict[str, Any] = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.endpoint == "completions":
                payload["prompt"] = prompt
            else:
                payload["messages"] = [{"role": "user", "content": prompt}]
            async with semaphore:
                result = await _one(client, url, payload)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in prompts:
            tasks.append(asyncio.create_task(run(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    summary = summarize(results, duration)
    summary["config"] = {
        "url": args.url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "dataset": args.dataset,
        "input_len": None if args.dataset else args.input_len,
        "output_len": args.output_len,
    }
    summary["results"] = [asdict(r) | {"itl": None} for r in results]
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """A human-readable table of a summary."""
    lines = [
        f"completed / failed:        {s['completed']} / {s['failed']}",
        f"duration:                  {s['duration_s']:.2f} s",
        f"mean input tokens:         {s['mean_input_tokens']:.1f}",
        f"total output tokens:       {s['total_output_tokens']}",
        f"request throughput:        {s['request_throughput']:.3f} req/s",
        f"output token throughput:   {s['output_throughput']:.2f} tok/s",
        f"total token throughput:    {s['total_token_throughput']:.2f} tok/s",
    ]
    for key, name in [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")]:
        p = s[key]
        lines.append(
            f"{name + ' (ms)':<26} mean {p['mean']:.1f}  p50 {p['p50']:.1f}  p90 {p['p90']:.1f}  p99 {p['p99']:.1f}"
        )
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def run_bench_serve(args: argparse.Namespace) -> int:
    """Entry point of ``plinth bench serve``; 1 when any request failed."""
    import asyncio

    import httpx

    from plinth.bench import BenchError

    try:
        summary = asyncio.run(bench(args))
    except httpx.InvalidURL as exc:
        raise BenchError(f"--url {args.url!r} is not a URL: {exc}") from exc
    except httpx.UnsupportedProtocol as exc:
        raise BenchError(f"--url {args.url!r} must start with http:// or https://") from exc
    except httpx.TransportError as exc:  # only the set-up requests: a failed benchmark request is a result
        raise BenchError(f"cannot reach the server at {args.url}: {type(exc).__name__}: {exc}") from exc
    print(format_summary(summary))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
