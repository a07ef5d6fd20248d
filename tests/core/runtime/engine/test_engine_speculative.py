"""Speculative decoding through the engine: the same outputs with and without it, blocks all returned."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import save_tiny_folder

from plinth import LLM, SamplingParams
from plinth.bench.speculative import SAMPLE_CODE
from plinth.config import EngineConfig
from plinth.runtime.parts import InvalidRequest
from plinth.sampling_params import StructuredOutputs
from plinth.sched.draft import NgramDrafter
from plinth.sched.request import Request
from plinth.validation import InvalidParameter

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2",
    "The quick brown fox",
    "A",
    "Paris is the capital of France, and Berlin is the capital of",
    "SELECT name, age FROM users WHERE age > 30; SELECT name, age FROM users WHERE",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


class NoisyDrafter:
    """The n-gram drafter, each of its tokens replaced by a random one with probability 0.3, and
    random drafts now and then where it has none: every step mixes accepted and rejected drafts."""

    def __init__(self, k: int = 4, seed: int = 0) -> None:
        self.inner: NgramDrafter[Any] = NgramDrafter(k, 3, 1)
        self.rng = random.Random(seed)
        self.k = k

    def propose(self, request: Request[Any], max_tokens: int) -> list[int]:
        drafts = self.inner.propose(request, max_tokens)
        if not drafts and self.rng.random() < 0.3:
            drafts = [self.rng.randrange(49152) for _ in range(min(self.k, max_tokens))]
        return [t if self.rng.random() > 0.3 else self.rng.randrange(49152) for t in drafts]


class EveryThirdStep:
    """Another drafter's drafts at every third output token only (a batch of one then alternates
    steps with and without drafts)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def propose(self, request: Request[Any], max_tokens: int) -> list[int]:
        if len(request.output_token_ids) % 3:
            return []
        drafts: list[int] = self.inner.propose(request, max_tokens)
        return drafts


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_folder("llama", path)
    return path


def _llm(folder: Path, k: int = 0, noisy: bool = False, **kw: Any) -> LLM:
    options: dict[str, Any] = dict(backend="reference", num_kv_blocks=256, block_size=16)
    options.update(kw)
    llm = LLM(model=str(folder), num_speculative_tokens=k, **options)
    if noisy:
        llm.engine.scheduler.drafter = NoisyDrafter(k or 4)
    return llm


def _outputs(llm: LLM, prompts: list[str], params: Any) -> list[tuple[Any, ...]]:
    """Each completion's tokens, text, finish and stop reasons, logprob token ids, and logprob
    values to 3 decimals (a step with drafts computes them in another batch shape: float noise)."""
    free = llm.engine.scheduler.kv_cache_manager.num_free_blocks
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.kv_cache_manager.num_free_blocks == free  # no block leaked
    result = []
    for o in outs:
        for c in o.outputs:
            lp = c.logprobs or []
            ids = [(t.token_id, [i for i, _ in t.top]) for t in lp]
            values = [round(v, 3) for t in lp for v in (t.logprob, *(v for _, v in t.top))]
            result.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, ids, values))
    return result


@pytest.fixture(scope="module")
def plain(folder: Path) -> list[tuple[Any, ...]]:
    return _outputs(_llm(folder), PROMPTS, GREEDY)


@pytest.mark.parametrize("noisy", [False, True], ids=["ngram", "noisy"])
def test_greedy_is_identical_with_drafts(folder: Path, plain: list[tuple[Any, ...]], noisy: bool) -> None:
    llm = _llm(folder, k=4, noisy=noisy)
    assert _outputs(llm, PROMPTS, GREEDY) == plain
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0
    if noisy:
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened


def test_chunked_prefill_preemption_and_the_cpu_backend(folder: Path, plain: list[tuple[Any, ...]]) -> None:
    chunked = _llm(folder, k=3, noisy=True, max_num_batched_tokens=16)
    assert _outputs(chunked, PROMPTS, GREEDY) == plain
    # a tiny cache: requests are preempted and recomputed, lookahead blocks come and go
    tight = _llm(folder, k=5, noisy=True, num_kv_blocks=14, block_size=8, max_model_len=80)
    assert _outputs(tight, PROMPTS, GREEDY) == plain
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert tight.engine.scheduler.spec_stats.num_drafts > 10
    # the cpu backend: steps without drafts replay step graphs, steps with drafts run eagerly
    cpu = _llm(folder, k=4, noisy=True, backend="cpu")
    cpu.engine.scheduler.drafter = EveryThirdStep(cpu.engine.scheduler.drafter)
    assert [o[0] for o in _outputs(cpu, PROMPTS[:1], GREEDY)] == [plain[0][0]]
    graphs = cpu.engine.runner.graphs
    assert graphs is not None and graphs.stats.replays > 0
    assert cpu.engine.scheduler.spec_stats.num_drafts > 5


def test_mixed_batches_forks_seeds_penalties_and_logprobs(folder: Path) -> None:
    """Greedy and seeded random requests, forks (n=2), penalties, logprobs, in one batch: the same
    completions with drafts (seeded ones too: their generators rewind past rejected rows)."""
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=9, n=2, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, logit_bias={34: -5.0}, logprobs=0, max_tokens=30, ignore_eos=True),
    ]
    want = _outputs(_llm(folder), PROMPTS, params)
    llm = _llm(folder, k=4, noisy=True)
    assert _outputs(llm, PROMPTS, params) == want
    assert llm.engine.scheduler.spec_stats.num_drafts > 10


def test_constrained_requests_never_draft_and_keep_their_grammar(folder: Path) -> None:
    """A structured-output request batched with speculating ones: it decodes one token per step
    (``may_speculate``) under its mask, the others' drafts do not disturb it."""
    regex = StructuredOutputs(regex=r"(yes|no)( (yes|no)){5}")
    params = [GREEDY] * 3 + [SamplingParams(temperature=0, max_tokens=40, structured=regex)]
    want = _outputs(_llm(folder), PROMPTS[:4], params)
    llm = _llm(folder, k=4)
    seen: list[tuple[bool, int]] = []  # (constrained, drafts) of each chunk the drafter was asked about
    inner = llm.engine.scheduler.drafter

    class Recording:
        def propose(self, request: Request[Any], max_tokens: int) -> list[int]:
            drafts: list[int] = inner.propose(request, max_tokens)
            seen.append((request.params.structured is not None, len(drafts)))
            return drafts

    llm.engine.scheduler.drafter = Recording()
    got = _outputs(llm, PROMPTS[:4], params)
    assert got == want
    assert re.fullmatch(r"(yes|no)( (yes|no)){5}", got[3][1])
    assert any(c for c, _ in seen) and all(n == 0 for c, n in seen if c)
    assert llm.engine.scheduler.spec_stats.num_drafts > 5


def test_stop_tokens_stop_strings_and_max_tokens(folder: Path, plain: list[tuple[Any, ...]]) -> None:
    """Stops that fall inside a run of accepted drafts: the tokens after them are dropped."""
    llm = _llm(folder)
    params = []
    for tokens, text, *_ in plain:
        stop_token = tokens[len(tokens) // 2]
        word = text[len(text) // 3 : len(text) // 3 + 3]
        params.append(
            SamplingParams(
                temperature=0, max_tokens=33, stop_token_ids=[stop_token], stop=[word] if word.strip() else None
            )
        )
    params[0] = SamplingParams(
        temperature=0, max_tokens=17, ignore_eos=True, min_tokens=5, stop_token_ids=[plain[0][0][2]]
    )
    want = _outputs(llm, PROMPTS, params)
    assert {o[2] for o in want} >= {"stop"}
    for noisy in (False, True):
        assert _outputs(_llm(folder, k=6, noisy=noisy), PROMPTS, params) == want


def test_config_refuses_bad_speculation_settings(folder: Path) -> None:
    with pytest.raises(InvalidParameter, match="ngram_prompt_lookup_min"):
        EngineConfig(num_speculative_tokens=2, ngram_prompt_lookup_max=2, ngram_prompt_lookup_min=3)
    with pytest.raises(InvalidParameter, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="single-process"):
        EngineConfig(num_speculative_tokens=2, tensor_parallel_size=2)
    assert type(_llm(folder).engine.scheduler.drafter).__name__ == "NoDrafter"


def test_static_shape_backends_refuse_speculation(folder: Path) -> None:
    from engine_helpers import host_with
    from test_static_steps import StaticReference

    from plinth.runtime.engine import LLMEngine

    config = EngineConfig(model=str(folder), backend="static-reference", num_kv_blocks=96, num_speculative_tokens=2)
    with pytest.raises(InvalidRequest, match="static-shape"):
        LLMEngine(config, host=host_with("test", StaticReference()))


CODE = SAMPLE_CODE


@pytest.mark.slow
def test_default_model_repetitive_prompt(default_gguf: Path) -> None:
    """SmolLM2-135M (fp32) asked to repeat code, batched with a prompt it does not copy from: the
    same greedy tokens with drafts, most of them accepted."""
    ask = f"Here is a function:\n\n```python\n{CODE}```\n\nRepeat it exactly, in a code block, with no other text."
    plain = LLM(backend="cpu", quantization="none", max_model_len=512)
    text = plain.tokenizer.apply_chat_template([{"role": "user", "content": ask}])
    params = [SamplingParams(temperature=0, max_tokens=80), SamplingParams(temperature=0, max_tokens=24)]
    prompts = [text, "The capital of France is"]
    want = _outputs(plain, prompts, params)
    del plain
    spec = LLM(backend="cpu", quantization="none", max_model_len=512, num_speculative_tokens=4)
    assert _outputs(spec, prompts, params) == want
    stats = spec.engine.scheduler.spec_stats
    assert stats.acceptance_rate > 0.6 and stats.tokens_per_step > 2.5
