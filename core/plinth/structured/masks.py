"""Per-sequence grammar matchers and the token bitmask of each step, computed beside the forward.

The engine owns one :class:`StructuredOutputs` manager (on rank 0, where sampling happens). A
constrained request's grammar is compiled when it is added (a bad schema is refused then); each of
its sequences gets a matcher at its first sample (the ``n`` forks of a request each their own). At
every step :meth:`StructuredOutputs.step_masks` starts filling the bitmask of the step's constrained
samples on a worker thread, llguidance working off the GIL while the model runs; the sampler waits
for it only when it needs it. After the step each sampled token advances its matcher, and a
sequence whose grammar is complete ends there.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plinth.sampling_params import SamplingParams
from plinth.sched.request import Sample, SequenceId
from plinth.structured.grammar import GrammarCompiler

if TYPE_CHECKING:
    import llguidance

    from plinth.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepMasks:
    """The allowed tokens of one step's constrained samples: row ``rows[seq_id]`` of the bitmask.

    The bitmask is ``[R, ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32`` set when token
    ``t`` is allowed (llguidance's and xgrammar's layout); it may still be being filled:
    :meth:`bitmask` waits for it.
    """

    rows: dict[SequenceId, int]
    _future: Future[torch.Tensor]
    _owner: StructuredOutputs

    def bitmask(self) -> torch.Tensor:
        """The filled bitmask (waits for the worker thread)."""
        start = time.perf_counter()
        bitmask = self._future.result()
        self._owner.wait_seconds += time.perf_counter() - start
        return bitmask


class StructuredOutputs:
    """Grammars and matchers of the constrained requests of one engine.

    :param tokenizer: the model's tokenizer.
    :param vocab_size: the logits' width.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None  # built at the first constrained request
        self._compiler_lock = threading.Lock()  # a server checks constraints from its own threads
        self._grammars: dict[str, str] = {}  # request id -> grammar
        self._matchers: dict[SequenceId, llguidance.LLMatcher] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        #: seconds spent filling masks on the worker thread, and how long the sampler waited for them
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler (made on first use: ~0.3 s for a 49k vocabulary)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size)
            return self._compiler

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Compile ``params.structured`` for a new request.

        :raises UnsupportedConstraint: the constraint cannot be enforced (nothing is kept then).
        """
        assert params.structured is not None
        self._grammars[request_id] = self.compiler.compile(params.structured)

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's grammar and its sequences' matchers."""
        if self._grammars.pop(request_id, None) is None:
            return
        for seq_id in [s for s in self._matchers if s.request_id == request_id]:
            del self._matchers[seq_id]

    @property
    def active(self) -> bool:
        """True while any constrained request is in flight."""
        return bool(self._grammars)

    def _matcher(self, seq_id: SequenceId) -> llguidance.LLMatcher:
        matcher = self._matchers.get(seq_id)
        if matcher is None:  # a sequence's first sample, or one of the forks of an n > 1 request
            matcher = self._matchers[seq_id] = self.compiler.matcher(self._grammars[seq_id.request_id])
        return matcher

    def step_masks(self, samples: Sequence[Sample[SamplingParams]]) -> StepMasks | None:
        """Start filling the bitmask of the constrained ``samples`` of a step; None when none is."""
        jobs = [(s.seq_id, self._matcher(s.seq_id)) for s in samples if s.seq_id.request_id in self._grammars]
        if not jobs:
            return None
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="plinth-grammar")
            self._executor = llguidance.LLExecutor()
        rows = {seq_id: i for i, (seq_id, _m) in enumerate(jobs)}
        matchers = [(m, i) for i, (_s, m) in enumerate(jobs)]
        bitmask = torch.zeros(len(jobs), math.ceil(self.vocab_size / 32), dtype=torch.int32)
        return StepMasks(rows, self._pool.submit(self._fill, matchers, bitmask), self)

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor) -> torch.Tensor:
        # llguidance.torch's fill_next_token_bitmask_par does this, but importing that module
        # scripts a TorchScript kernel (a deprecation warning) that plinth does not use
        start = time.perf_counter()
        assert self._executor is not None and bitmask.is_contiguous()
        rows, words = bitmask.shape
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, rows)
        self.fill_seconds += time.perf_counter() - start
        return bitmask

    def accept(self, seq_id: SequenceId, token_id: int) -> bool:
        """Advance ``seq_id``'s matcher by its sampled token; True when the sequence must end now:
        its grammar is complete (nothing but the end may follow). A sequence that is not
        constrained returns False."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        assert self._compiler is not None  # a matcher exists, so its compiler does (no lock per token)
        if token_id in self._compiler.eos_token_ids:
            return False  # the scheduler ends it on its own stop token
        if not matcher.consume_token(token_id):
            # the mask allowed only valid tokens: a matcher error is a resource limit or a bug
            logger.warning("grammar of sequence %s refused token %d: %s", seq_id, token_id, matcher.get_error())
            return True
        return bool(matcher.is_stopped())

    def close(self) -> None:
        """Stop the worker thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
