"""The scheduler: which requests run each step, with how many tokens, in which blocks.

It exchanges value objects with the rest of the engine (``Request`` in, ``SchedulerOutput`` out,
sampled token ids keyed by ``SequenceId`` back in through ``update``, the engine's own finishes in
one ``EngineFinishes`` through ``finish``) and never imports torch. It alone mints sequence ids.

When ``num_computed_tokens`` advances: optimistically, in ``schedule()``. After ``schedule()`` returns,
a scheduled request's ``num_computed_tokens`` already counts the tokens scheduled for it (the step
about to run writes their K/V). ``update()`` must then be called with that output, before the next
``schedule()``, to append the sampled tokens; it also registers the blocks the step filled in the
prefix cache (only then are they really computed).

Speculative decoding (``plinth.sched.draft``): a decoding request may get draft tokens after its
last token; they advance ``num_computed_tokens`` like any other, and ``update()`` rolls back the
rejected ones (their K/V is overwritten later) and returns the blocks only they used.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Generic

from plinth.sched.draft import Drafter, NoDrafter, SpecDecodeStats
from plinth.sched.kv_cache_manager import KVCacheManager
from plinth.sched.output import EngineFinishes, ScheduledChunk, SchedulerOutput
from plinth.sched.phase import DECODE, AlternatingPhases, MixedBatches, Phase, PhasePolicy, has_decode_work
from plinth.sched.request import P, Pool, Request, RequestStatus, Sample, SequenceId


def _token_slice(request: Request[P], start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without copying the whole sequence."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return output[start - p : end - p]
    return prompt[start:] + output[: end - p]


def _sampled_token(sampled: Mapping[SequenceId, int], seq_id: SequenceId) -> int:
    """The token sampled for ``seq_id``; a missing one is the caller's bug, named."""
    token = sampled.get(seq_id)
    if token is None:
        raise ValueError(f"no sampled token for sequence {seq_id}")
    return token


class Scheduler(Generic[P]):
    """Continuous batching over a paged KV cache: token budget, chunked prefill, prefix hits, preemption.

    :param num_blocks: KV blocks in the pool (block 0 is the reserved null block).
    :param block_size: tokens per block.
    :param max_num_batched_tokens: the token budget of one step.
    :param max_num_seqs: most requests scheduled in one step, and most running at once (a request
        with ``n`` > 1 counts ``n`` seats from admission, so its forks never overflow).
    :param max_model_len: the context length: prompt + output tokens of one request.
    :param enable_prefix_caching: reuse computed full blocks across requests.
    :param enable_chunked_prefill: when False, a waiting request is admitted only if all its
        remaining tokens fit in the step's budget.
    :param long_prefill_token_threshold: when > 0, at most this many tokens per request per step,
        so one long prompt cannot take a whole step from the decodes.
    :param mixed_batches: when False, no step mixes decode work (running requests with exactly 1
        token left) with prefill work (more than 1 left, or admitted from the waiting queue): each
        step is a decode step or a prefill step. When both kinds are ready the phases alternate
        with the previous non-empty step's, so neither starves (decodes run at least every other
        step while prompts keep arriving); see ``plinth.sched.phase``. ``last_phase`` names the
        phase of the last output ("decode" / "prefill"; None when mixed or empty).
    :param block_placement: the block pool's placement, ``"any"`` or ``"contiguous"`` (lowest free
        block ids first); see ``plinth.sched.block_pool``.
    :param drafter: proposes draft tokens for decoding requests (speculative decoding); default
        :class:`~plinth.sched.draft.NoDrafter`, none. ``spec_stats`` counts drafts and acceptances.

    ``P`` is the type of the requests' sampling parameters, passed through to the runner untouched.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        mixed_batches: bool = True,
        block_placement: str = "any",
        drafter: Drafter[P] | None = None,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_model_len < 2:
            raise ValueError(
                f"need max_num_batched_tokens >= 1, max_num_seqs >= 1, max_model_len >= 2; got "
                f"{max_num_batched_tokens}, {max_num_seqs}, {max_model_len}"
            )
        if (num_blocks - 1) * block_size < max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks - 1} usable blocks of {block_size} tokens) cannot hold one "
                f"request of max_model_len={max_model_len} tokens"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({max_num_batched_tokens}) must be "
                f">= max_model_len ({max_model_len})"
            )
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}")
        if long_prefill_token_threshold and not enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold splits prompts: it needs chunked prefill")
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching, block_placement)
        self.mixed_batches = mixed_batches
        self._phases: PhasePolicy = MixedBatches() if mixed_batches else AlternatingPhases()
        self.last_phase: Phase | None = None  # the phase of the last output; None: mixed, or empty
        self.waiting: deque[Request[P]] = deque()
        self.running: list[Request[P]] = []
        self._requests: dict[SequenceId, Request[P]] = {}  # every unfinished sequence
        self._live: dict[str, int] = {}  # request id -> its unfinished sequences: in use while > 0
        self._pending: SchedulerOutput[P] | None = None  # scheduled, not yet passed to update()
        self._pending_requests: list[Request[P]] = []  # the requests behind _pending.scheduled, in order
        self._finished: list[SequenceId] = []  # finished since the last output that scheduled something
        self.num_preemptions_total = 0  # preemptions since start
        self.prefix_cache_query_tokens = 0  # tokens of requests admitted (preempted ones again)
        self.prefix_cache_hit_tokens = 0  # of those, tokens found in the prefix cache
        self.drafter: Drafter[P] = drafter or NoDrafter()
        self.spec_stats = SpecDecodeStats()  # draft tokens proposed and accepted since start

    # -- requests in and out ---------------------------------------------------------------------

    def add_request(self, request: Request[P]) -> None:
        """Queue a new request at the back of the waiting queue.

        Raises ValueError for an empty prompt, a prompt of ``max_model_len`` tokens or more, a
        request id in use (by any unfinished sequence of an earlier request), ``max_tokens`` < 1,
        ``n`` outside ``1..max_num_seqs``, or a ``sample_index`` other than 0 (forks are the
        scheduler's to make). An embedding request generates nothing: its prompt may fill the
        context, its ``max_tokens`` is not read, and its ``n`` must be 1.
        """
        rid = request.request_id
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.pooling is not None:
            if num_prompt > self.max_model_len or request.n != 1:
                raise ValueError(
                    f"embedding request {rid!r}: needs n=1 and at most max_model_len={self.max_model_len} "
                    f"tokens; got n={request.n}, {num_prompt} tokens"
                )
        elif num_prompt >= self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {num_prompt} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        elif request.stop.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.stop.max_tokens}")
        if not 1 <= request.n <= self.max_num_seqs:
            raise ValueError(f"request {rid!r}: n={request.n} must be in 1..max_num_seqs={self.max_num_seqs}")
        if request.sample_index != 0 or request.forked:
            raise ValueError(f"request {rid!r}: only the scheduler forks (sample_index {request.sample_index})")
        if rid in self._live:
            raise ValueError(f"request id {rid!r} already in use")
        request.status = RequestStatus.WAITING
        self._requests[request.seq_id] = request
        self._live[rid] = 1
        self.waiting.append(request)

    def get_request(self, seq_id: SequenceId) -> Request[P] | None:
        """The unfinished sequence with this id, or None."""
        return self._requests.get(seq_id)

    def finish(self, finishes: EngineFinishes) -> list[Request[P]]:
        """Apply the finishes the engine decided (stop strings found in the text, aborts); free
        their blocks at once.

        :return: the sequences finished by this call (ids no longer unfinished are skipped).
        """
        done = [r for sid in finishes.stopped if (r := self.finish_request(sid, RequestStatus.FINISHED_STOPPED))]
        for request_id in finishes.aborted:
            done += self.abort_group(request_id)
        return done

    def finish_request(self, seq_id: SequenceId, status: RequestStatus) -> Request[P] | None:
        """End one sequence from outside (a stop string found in the text, an abort); free its blocks.

        :param status: a ``FINISHED_*`` status.
        :return: the sequence, or None when no unfinished sequence has this id.
        """
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self._requests.get(seq_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def abort_request(self, seq_id: SequenceId) -> Request[P] | None:
        """Abort one sequence (waiting or running); the other samples of its request are untouched."""
        return self.finish_request(seq_id, RequestStatus.FINISHED_ABORTED)

    def abort_group(self, request_id: str) -> list[Request[P]]:
        """Abort every unfinished sequence of request ``request_id`` (the request and its forks)."""
        if request_id not in self._live:
            return []
        ids = [sid for sid in self._requests if sid.request_id == request_id]
        aborted = [self.abort_request(sid) for sid in ids]
        return [r for r in aborted if r is not None]

    def abort_all(self) -> list[Request[P]]:
        """Abort every unfinished sequence and forget a scheduled step that never reached ``update()``
        (the model raised): afterwards the scheduler is empty and ready for new requests."""
        aborted = [self.abort_request(sid) for sid in list(self._requests)]
        # an update() that raised midway finished (and forgot) some sequences without dequeuing them
        self.running = []
        self.waiting.clear()
        self._pending = None
        self._pending_requests = []
        return [r for r in aborted if r is not None]

    def _finish(self, request: Request[P], status: RequestStatus) -> None:
        """Mark finished, free the blocks, forget the sequence (the caller dequeues it)."""
        request.status = status
        self.kv_cache_manager.free(request)
        seq_id = request.seq_id
        del self._requests[seq_id]
        self._finished.append(seq_id)
        rid = seq_id.request_id
        left = self._live[rid] - 1
        if left:
            self._live[rid] = left
        else:
            del self._live[rid]

    # -- state -----------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        """Requests holding blocks and being stepped."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0.0 .. 1.0)."""
        return self.kv_cache_manager.usage

    def kv_slots(self) -> tuple[int, int]:
        """``(slots, stored)``: KV slots in the block tables of the running requests, and the tokens
        stored in them. ``slots - stored`` is the cache the running batch holds but does not use
        (the unfilled tail of each last block, and blocks allocated ahead of their tokens)."""
        bs = self.block_size
        slots = stored = 0
        for r in self.running:
            slots += len(self.kv_cache_manager.block_ids(r.seq_id)) * bs
            stored += r.num_computed_tokens
        return slots, stored

    @property
    def kv_waste(self) -> float:
        """Fraction of the running batch's KV slots that hold no token (0.0 .. 1.0)."""
        slots, stored = self.kv_slots()
        return (slots - stored) / slots if slots else 0.0

    @staticmethod
    def _seats(request: Request[P]) -> int:
        """Running slots a request takes: ``n`` until it forks, then 1 per sequence."""
        return request.n if request.n > 1 and not request.forked else 1

    @staticmethod
    def _samples(request: Request[P], end: int) -> tuple[Sample[P], ...]:
        """Samples to take after computing up to ``end``: none mid-prompt, ``n`` at a fork, else the
        sequence's own (built once: no allocation in the common case)."""
        if end < request.num_tokens or request.pooling is not None:
            return ()
        if request.n > 1 and not request.forked:
            return request.samples + tuple(request.make_sample(k) for k in range(1, request.n))
        return request.samples

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens a request with ``remaining`` tokens to compute may compute this step."""
        if 0 < self.long_prefill_token_threshold < remaining:
            remaining = self.long_prefill_token_threshold
        return min(remaining, budget)

    def _preempt(self, request: Request[P]) -> None:
        """Preemption by recompute: free the blocks, restart from token 0 at the front of the queue.

        The output tokens are kept; the request later recomputes prompt + outputs (hitting its own
        blocks in the prefix cache if they were not evicted meanwhile).
        """
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # -- the step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput[P]:
        """Pick this step's requests and tokens; allocate their blocks.

        Raises RuntimeError when the previous non-empty output was not passed to ``update`` yet.
        """
        # The whole algorithm. There is no prefill phase and no decode phase: every request has
        # num_computed_tokens (K/V in the cache) catching up to num_tokens (prompt + outputs), and a
        # step gives requests tokens out of a budget of max_num_batched_tokens (at most max_num_seqs
        # requests). A request gets min(remaining tokens, remaining budget) tokens (chunked prefill;
        # long_prefill_token_threshold caps it further), so a long prompt spreads over several steps
        # while decodes (1 token each) ride along.
        # 1. Running requests first, in queue order. When the blocks for one run out, preempt the
        #    running request at the tail of the queue (the latest admitted) by recompute: free its
        #    blocks, num_computed_tokens = 0, status PREEMPTED, FRONT of the waiting queue, outputs
        #    kept; retry until the request fits. If the tail is the request itself, preempt it and
        #    stop: everything behind it is already preempted.
        # 2. Then, only if nobody was preempted this step, waiting requests in FIFO order (preempted
        #    ones are at the front): apply prefix-cache hits (num_computed_tokens jumps past the
        #    cached full blocks, always leaving >= 1 token to compute), then allocate. A waiting
        #    request that cannot get blocks (or seats, or, without chunking, its whole prompt in the
        #    budget) stays waiting and blocks the queue behind it: no preemption on its behalf.
        # A chunk that reaches num_tokens samples: 1 token, or n the first time a request with n > 1
        # gets there (update() forks it into the sequences its samples name). num_computed_tokens
        # advances here, optimistically. An embedding request is a prompt that samples nothing:
        # its chunks name a Pool instead, and update() finishes it after its final chunk ran.
        # A running request with 1 token left may also get the drafter's tokens behind it (budget
        # permitting; without them if their blocks do not fit, before anyone is preempted);
        # update() takes back the rejected ones.
        # Without mixed batches, steps 1 and 2 run in one phase (plinth.sched.phase): a decode step
        # takes only running requests with 1 token left and admits nobody; a prefill step takes
        # only running requests with more left, then admits as in 2. Others are skipped, never
        # preempted for it. A preferred phase that neither schedules nor preempts anything hands
        # the step to the other phase (one retry, no loop).
        if self._pending is not None:
            raise RuntimeError("schedule() called before update() got the previous step's output")
        scheduled: list[ScheduledChunk[P]] = []
        requests: list[Request[P]] = []
        preempted: list[SequenceId] = []
        budget = self.max_num_batched_tokens
        phase: Phase | None = None
        for phase in self._phases.order(self.running, bool(self.waiting)):
            budget = self._schedule_running(budget, scheduled, requests, preempted, phase)
            if not preempted and phase != DECODE:  # admitting now would hand the blocks just freed to someone else
                budget = self._schedule_waiting(budget, scheduled, requests)
            if scheduled or preempted:
                break
        self.last_phase = phase if scheduled else None
        if scheduled:
            self._phases.ran(phase)
        finished: list[SequenceId] = []
        if scheduled:  # an empty output reaches no runner: keep the finishes for the next one
            finished, self._finished = self._finished, finished
        output = SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            block_copies=self.kv_cache_manager.take_block_copies(),
            preempted_ids=preempted,
            finished_seq_ids=finished,
        )
        if scheduled:
            self._pending = output
            self._pending_requests = requests
        return output

    def _schedule_running(
        self,
        budget: int,
        scheduled: list[ScheduledChunk[P]],
        requests: list[Request[P]],
        preempted: list[SequenceId],
        phase: Phase | None = None,
    ) -> int:
        """Step 1 of ``schedule()``: running requests, preempting from the tail. Returns the budget left.

        With a ``phase``, requests whose work is of the other kind are skipped.
        """
        kv = self.kv_cache_manager
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self.max_num_seqs:
            request = self.running[i]
            if phase is not None and has_decode_work(request) != (phase == DECODE):
                i += 1
                continue
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._draft(request, num_new, budget)
            block_ids = kv.allocate_slots(request, num_new + len(drafts))
            if block_ids is None and drafts:  # no room for the lookahead: decode without it first
                drafts = []
                block_ids = kv.allocate_slots(request, num_new)
            while block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is request:
                    return budget
                block_ids = kv.allocate_slots(request, num_new)
            scheduled.append(self._advance(request, num_new, block_ids, drafts))
            requests.append(request)
            budget -= num_new + len(drafts)
            i += 1
        return budget

    def _draft(self, request: Request[P], num_new: int, budget: int) -> list[int]:
        """The drafter's tokens for a decode (none for a prefill chunk or the step a request with
        ``n`` > 1 forks), as many as the budget, ``max_tokens`` and the context length leave room for
        behind the token the step samples anyway."""
        if num_new != 1 or request.num_tokens - request.num_computed_tokens != 1 or self._seats(request) > 1:
            return []
        room = min(
            budget - 1,
            request.stop.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return self.drafter.propose(request, room) if room > 0 else []

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledChunk[P]], requests: list[Request[P]]) -> int:
        """Step 2 of ``schedule()``: admit waiting requests in FIFO order. Returns the budget left."""
        kv = self.kv_cache_manager
        seats = sum(self._seats(r) for r in self.running)
        while self.waiting and budget > 0 and len(scheduled) < self.max_num_seqs:
            request = self.waiting[0]
            if seats + self._seats(request) > self.max_num_seqs:
                break
            computed = kv.get_computed_blocks(request)
            remaining = request.num_tokens - computed.num_tokens
            num_new = self._chunk(remaining, budget)
            if not self.enable_chunked_prefill and num_new < remaining:
                break
            block_ids = kv.allocate_slots(request, num_new, computed)
            if block_ids is None:
                break
            self.waiting.popleft()
            self.prefix_cache_query_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += computed.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = computed.num_tokens
            request.num_computed_tokens = computed.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seats += self._seats(request)
            scheduled.append(self._advance(request, num_new, block_ids))
            requests.append(request)
            budget -= num_new
        return budget

    def _advance(
        self, request: Request[P], num_new: int, block_ids: list[int], drafts: list[int] | None = None
    ) -> ScheduledChunk[P]:
        """Describe the request's chunk (its ``drafts`` behind it) and advance ``num_computed_tokens`` past it."""
        start = request.num_computed_tokens
        end = start + num_new
        tokens = _token_slice(request, start, end)
        if drafts:
            tokens += drafts
        request.num_computed_tokens = end + len(drafts or ())
        return ScheduledChunk(
            seq_id=request.seq_id,
            token_ids=tokens,
            start_position=start,
            block_ids=block_ids,
            samples=self._samples(request, end),
            pool=None if request.pooling is None else Pool(request.pooling, end >= request.num_tokens),
            draft_token_ids=drafts or [],
            prompt_targets=request.prompt_targets(start, end),
            lora_id=request.lora_id,
        )

    def update(
        self,
        output: SchedulerOutput[P],
        sampled: Mapping[SequenceId, int],
        accepted: Mapping[SequenceId, Sequence[int]] | None = None,
    ) -> list[Request[P]]:
        """Take the step's sampled tokens: append, fork, check stop conditions, free finished sequences.

        :param output: the output of the last ``schedule()``.
        :param sampled: one token id for every sample of the output, keyed by the sample's
            ``seq_id`` (at a fork, sample ``k`` starts the new sequence ``(request_id, k)``).
            Sequences finished or aborted since ``schedule()`` are skipped.
        :param accepted: for a chunk with draft tokens, the drafts the sampler accepted (a prefix
            of them; missing: none); they come before the sequence's sampled token, the stop
            conditions apply to each in order, and tokens past a stop are dropped.
        :return: the sequences that got a token this step, new forks included, in schedule order;
            those that finished have a finished status (and hold no blocks any more).
        """
        if output is not self._pending and output.scheduled:
            raise RuntimeError("update() needs the output of the last schedule()")
        requests = self._pending_requests if output.scheduled else []
        self._pending = None
        self._pending_requests = []
        kv = self.kv_cache_manager
        changed: list[Request[P]] = []
        any_finished = False
        for s, request in zip(output.scheduled, requests, strict=True):
            if request.is_finished:  # finished or aborted while the step ran
                continue
            if s.draft_token_ids:
                changed.append(request)
                taken = accepted.get(request.seq_id, ()) if accepted else ()
                token = _sampled_token(sampled, request.seq_id)
                any_finished |= self._take_drafts(request, s.draft_token_ids, taken, token)
                continue
            kv.cache_computed_blocks(request)  # the step ran: these blocks are computed now
            samples = s.samples
            if not samples:
                if s.pool is not None and s.pool.final:  # an embedding request's prompt is computed: done
                    changed.append(request)
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    any_finished = True
                continue
            token = _sampled_token(sampled, request.seq_id)
            group = [request]
            if len(samples) > 1:
                group += self._fork(request, [_sampled_token(sampled, x.seq_id) for x in samples[1:]])
            request.output_token_ids.append(token)
            for r in group:
                changed.append(r)
                status = self._stop_status(r)
                if status is not None:
                    self._finish(r, status)
                    any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return changed

    def _take_drafts(self, request: Request[P], drafts: list[int], accepted: Sequence[int], token: int) -> bool:
        """Append a speculating step's accepted drafts and sampled token, each checked for a stop;
        roll ``num_computed_tokens`` back past the rejected drafts and return the blocks only they
        used. True when the request finished."""
        n = len(accepted)
        if list(accepted) != drafts[:n]:
            raise ValueError(f"the tokens accepted for sequence {request.seq_id} are not a prefix of its drafts")
        self.spec_stats.record(len(drafts), n)
        request.num_computed_tokens -= len(drafts) - n  # the rejected drafts' K/V gets overwritten later
        for t in (*accepted, token):
            request.output_token_ids.append(t)
            status = self._stop_status(request)
            if status is not None:
                self._finish(request, status)
                return True
        self.kv_cache_manager.cache_computed_blocks(request)
        self.kv_cache_manager.trim(request)
        return False

    def _fork(self, parent: Request[P], first_tokens: list[int]) -> list[Request[P]]:
        """Fork ``parent`` into ``len(first_tokens)`` more sequences sharing its blocks.

        Child ``i`` (sequence ``(request_id, i)``) starts with the parent's outputs plus
        ``first_tokens[i - 1]`` and runs right behind the parent.
        """
        parent.forked = True
        children: list[Request[P]] = []
        for i, token in enumerate(first_tokens, start=1):
            child = Request(
                request_id=parent.request_id,
                prompt_token_ids=parent.prompt_token_ids,  # never mutated: safe to share
                stop=dataclasses.replace(parent.stop),
                params=parent.params,
                seed=parent.seed,
                n=1,
                sample_index=i,
                output_token_ids=[*parent.output_token_ids, token],
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_prompt_tokens=parent.num_cached_prompt_tokens,
                status=RequestStatus.RUNNING,
                arrival_time=parent.arrival_time,
                forked=True,
                lora_id=parent.lora_id,
            )
            if child.seq_id in self._requests:
                raise RuntimeError(f"fork {child.seq_id} is already in use")
            self.kv_cache_manager.fork(parent, child)
            self._requests[child.seq_id] = child
            self._live[child.request_id] += 1
            children.append(child)
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return children

    def _stop_status(self, request: Request[P]) -> RequestStatus | None:
        """The finished status the last appended token leads to, or None to keep going.

        Stop and eos tokens count only from output index ``min_tokens`` on, and win over the
        length limits when both apply to the same token.
        """
        stop = request.stop
        output = request.output_token_ids
        if len(output) > stop.min_tokens:
            last = output[-1]
            if last in stop.stop_token_ids or (not stop.ignore_eos and last in stop.eos_token_ids):
                return RequestStatus.FINISHED_STOPPED
        if len(output) >= stop.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
