"""Benchmark workloads: synthetic ShareGPT-like requests with a fixed seed, or a ShareGPT JSON file."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: list[int]
    output_len: int


def _lognormal_lengths(rng: random.Random, n: int, median: int, lo: int, hi: int, sigma: float) -> list[int]:
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def synthetic(
    num_requests: int,
    vocab_size: int,
    seed: int = 0,
    prompt_median: int = 128,
    output_median: int = 96,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (16, 256),
) -> list[BenchRequest]:
    """ShareGPT-like lengths: prompts lognormal around 128 tokens clipped to [16, 512], outputs around
    96 clipped to [16, 256]. Token ids are random (ids 0-255 excluded: they hold special and byte
    tokens in most vocabularies), so no two prompts share a prefix the cache could reuse."""
    rng = random.Random(seed)
    prompt_lens = _lognormal_lengths(rng, num_requests, prompt_median, *prompt_range, sigma=0.6)
    output_lens = _lognormal_lengths(rng, num_requests, output_median, *output_range, sigma=0.5)
    return [
        BenchRequest([rng.randrange(256, vocab_size) for _ in range(p)], o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def with_fresh_ids(requests: list[BenchRequest], vocab_size: int, seed: int | str) -> list[BenchRequest]:
    """``requests`` with the same prompt and output lengths and prompt ids drawn afresh from ``seed``
    (as :func:`synthetic` draws them), for a later pass of a workload in the same engine: the same
    work, none of it found in the prefix cache (a pass over the same prompts would skip their prefill)."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(256, vocab_size) for _ in r.prompt_ids], r.output_len) for r in requests]


def sharegpt(path: str | Path, tokenizer: Any, num_requests: int, max_prompt_len: int = 1024) -> list[BenchRequest]:
    """The first ``num_requests`` usable conversations of a ShareGPT-format JSON file: the first human
    turn is the prompt, the length of the first model turn (in tokens) is the output length."""
    data = json.loads(Path(path).read_text())
    requests: list[BenchRequest] = []
    for item in data if isinstance(data, list) else []:
        turns = (item.get("conversations") or item.get("conversation")) if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
            continue
        prompt_ids = tokenizer.encode(str(turns[0].get("value", "")))
        output_len = len(tokenizer.encode(str(turns[1].get("value", "")), add_special_tokens=False))
        if not 4 <= len(prompt_ids) <= max_prompt_len or output_len < 4:
            continue
        requests.append(BenchRequest(prompt_ids, min(output_len, 1024)))
        if len(requests) == num_requests:
            break
    if not requests:
        raise ValueError(f"{path}: no usable ShareGPT conversations (need 'conversations' with two turns)")
    return requests
