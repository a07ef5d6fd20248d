"""The engine: one model on one backend, stepping a continuous batch of requests.

``add_request`` (and ``add_embedding_request``) validates and queues; ``step`` runs one scheduled
batch and returns the outputs of the requests that advanced. Hooks were resolved when the engine was
built; the step loop only calls the scheduler, the runner and the detokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from plinth.config import EngineConfig, compile_cache_dir
from plinth.model.loader import load_tokenizer
from plinth.model.tokenizer import IncrementalDetokenizer
from plinth.parallel.comm import CollectiveError
from plinth.parallel.executor import (
    Executor,
    RankMemory,
    WorkerFailure,
    WorkerSetup,
    default_threads,
    make_executor,
)
from plinth.parallel.spmd import spmd_plan
from plinth.platform.backend import DeviceServices, StepBuckets, torch_dtype
from plinth.platform.host import PluginHost, default_host
from plinth.pooling_params import PoolingParams
from plinth.runtime.embeddings import EmbeddingRequests
from plinth.runtime.graphs import DecodeGraphs
from plinth.runtime.lora import LoRAAdapter, LoRAError, LoRAManager, build_lora
from plinth.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from plinth.runtime.parts import InvalidRequest, allocate_kv_caches, kv_blocks, load_parts, rank_memory, uses_spmd
from plinth.runtime.pipeline import PipelineRunner
from plinth.runtime.prompt_logprobs import merge
from plinth.runtime.runner import ModelRunner
from plinth.runtime.sampler import Sampler, SampleResult
from plinth.runtime.speculative import may_speculate
from plinth.runtime.static import ModelStepProgram, StaticSteps
from plinth.sampling_params import SamplingParams
from plinth.sched.draft import NgramDrafter
from plinth.sched.output import EngineFinishes
from plinth.sched.request import Request, RequestStatus, StopCriteria
from plinth.sched.scheduler import Scheduler
from plinth.structured.grammar import UnsupportedConstraint
from plinth.structured.masks import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sequence:
    """Engine-side state of one sequence: detokenizer, logprobs, stop-string scan."""

    index: int
    detok: IncrementalDetokenizer
    num_seen: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stop_scan_from: int = 0  # text before this was already searched for stop strings


@dataclass(slots=True)
class _Group:
    """All sequences of one user request (``n`` of them after a fork), by sample index."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: dict[int, _Sequence] = field(default_factory=dict)
    #: with ``params.prompt_logprobs``: one entry per prompt token, filled chunk by chunk
    prompt_logprobs: list[TokenLogprob | None] | None = None
    lora_id: int = 0  # the LoRA adapter it holds (0: none), released when the group ends


class LLMEngine:
    """A model on a backend with a scheduler, a runner and a detokenizer.

    :param config: how to build it; see :class:`plinth.config.EngineConfig`.
    :param host: the plugin host to select the backend from (default: installed entry points).
    """

    def __init__(self, config: EngineConfig | None = None, host: PluginHost | None = None) -> None:
        self.config = config = config or EngineConfig()
        host = host or default_host()
        world = config.world_size
        #: tensor parallelism by this one process over the backend's device mesh (API 1.12), no workers
        self.spmd = uses_spmd(config, host)
        #: the tensor- or pipeline-parallel workers (ranks 1..N-1), started first so they load alongside rank 0
        self.executor: Executor | None = None
        if world > 1 and not self.spmd:
            self.executor = make_executor(config, world)
            torch.set_num_threads(config.num_threads or default_threads(world))
        try:
            self._start(config, host)
        except BaseException:
            self.close()
            raise

    #: Set when the engine cannot step any more (a tensor-parallel rank died or hung): every later
    #: ``step`` raises it again. A server then fails what is in flight and exits non-zero.
    fatal: WorkerFailure | None = None

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; a single-process engine has none),
        and the structured-output worker thread."""
        if self.executor is not None:
            self.executor.close()
        structured = getattr(self, "structured", None)  # absent when the start failed early
        if structured is not None:
            structured.close()

    def _start(self, config: EngineConfig, host: PluginHost) -> None:
        t0 = time.monotonic()
        world = 1 if self.spmd else config.world_size  # processes
        local_rank = self.executor.local_rank if self.executor is not None else None
        parts = load_parts(config, host, rank=0, world_size=world, spmd=self.spmd, local_rank=local_rank)
        self.backend_status = parts.status
        backend = self.backend = parts.backend
        services = parts.services
        caps = parts.caps
        block_size = parts.block_size
        self.kernels = parts.kernels
        self.model, self.model_config = parts.model, parts.model_config
        dtype, kv_dtype = parts.dtype, parts.kv_dtype
        source = parts.source
        #: seconds per start-up phase ("backend", "weights", "tokenizer", "kv_cache"), for cold-start reports
        self.startup_seconds: dict[str, float] = dict(parts.seconds)
        lap = time.monotonic()
        self.tokenizer = load_tokenizer(source)
        self.startup_seconds["tokenizer"] = time.monotonic() - lap
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        specs = self.model.attention_specs()
        mine = rank_memory(parts, specs)
        if self.spmd:  # a device of the mesh holds 1/N of every block (its KV heads)
            mine = dataclasses.replace(mine, block_bytes=-(-mine.block_bytes // parts.spmd_size))
        ranks = self.executor.gather(mine) if self.executor is not None else [mine]
        num_blocks = self._num_blocks(ranks, block_size)
        fits = (num_blocks - 1) * block_size  # block 0 is the scheduler's null block
        if fits < self.max_model_len:
            if config.max_model_len is not None:
                raise InvalidRequest(
                    f"max_model_len {config.max_model_len} needs {self.max_model_len // block_size + 2} KV "
                    f"blocks of {block_size} tokens; the cache holds {num_blocks}: enlarge it or shorten the context"
                )
            logger.warning("KV cache holds %d tokens: context length lowered to that", fits)
            self.max_model_len = fits
        if self.executor is not None:  # every rank allocates the same number of blocks for its heads
            self.executor.broadcast(WorkerSetup(num_blocks, block_size, dtype, kv_dtype))
        lap = time.monotonic()
        kv_caches = allocate_kv_caches(backend, specs, num_blocks, prefault=config.kv_cache_prefault)
        self.startup_seconds["kv_cache"] = time.monotonic() - lap
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scheduler: Scheduler[SamplingParams] = Scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            mixed_batches=caps.mixed_batches,
            block_placement=caps.block_placement,
            drafter=self._drafter(config),
        )
        graphs = None
        #: the static-shape path (API 1.5), where the backend declares step buckets; else None
        self.static: StaticSteps | None = None
        max_blocks_per_seq = -(-self.max_model_len // block_size)
        buckets = backend.step_buckets(config.max_num_batched_tokens, config.max_num_seqs, max_blocks_per_seq)
        if buckets is not None and config.num_speculative_tokens:
            raise InvalidRequest(
                f"backend {backend.name!r} compiles static-shape steps, which take 1-token decodes only: "
                "speculative decoding (num_speculative_tokens) is not available on it"
            )
        if buckets is not None and world > 1:
            raise InvalidRequest(
                f"backend {backend.name!r} compiles static-shape steps: worker processes do not drive those"
                + (" (its tensor parallelism is SPMD: without pipeline parallelism)" if caps.spmd else "")
            )
        if self.spmd and buckets is None:
            raise InvalidRequest(f"backend {backend.name!r} declares Capabilities.spmd without static-shape steps")
        if buckets is not None:
            self.static = self._static_steps(
                buckets, kv_caches, services, block_size, max_blocks_per_seq, spmd_size=parts.spmd_size
            )
        elif not config.enforce_eager and world == 1:  # step graphs replay one process's kernels only
            graphs = DecodeGraphs(
                self.model,
                services,
                kv_caches,
                block_size=block_size,
                max_blocks_per_seq=-(-self.max_model_len // block_size),
                hidden_size=self.model_config.hidden_size,
                dtype=torch_dtype(dtype),
                max_seq_len=self.max_model_len,
            )
        self.runner: ModelRunner
        if parts.stage is not None:
            self.runner = PipelineRunner(
                self.model,
                kv_caches,
                self.kernels.attention(specs[0]),
                services,
                block_size,
                parts.stage,
                sampler=Sampler(self.kernels.ops),
            )
        else:
            self.runner = ModelRunner(
                self.model,
                kv_caches,
                self.kernels.attention(specs[0]),
                services,
                block_size,
                graphs=graphs,
                sampler=Sampler(self.kernels.ops),
                static=self.static,
            )
        #: the LoRA adapters (``enable_lora``); None: LoRA off, and no step pays anything for it
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            if self.static is not None:
                raise InvalidRequest(
                    f"backend {backend.name!r} compiles static-shape steps: LoRA adapters are not served there yet"
                )
            # under tensor parallelism every decision (load into a slot, free a slot) goes to the
            # workers between two steps, as the steps do
            announce = self.executor.broadcast if self.executor is not None else None
            self.lora = build_lora(
                config, self.model, self.kernels.lora, dtype, services.device, self.model_config, announce
            )
            self.runner.lora = self.lora
        self._groups: dict[str, _Group] = {}
        #: grammars and matchers of the constrained requests (llguidance is loaded at the first one)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self._embeddings = EmbeddingRequests()
        self.load_seconds = time.monotonic() - t0
        logger.info(
            "engine ready on %s in %.1fs: %d KV blocks of %d tokens, dtype %s",
            backend.name,
            self.load_seconds,
            num_blocks,
            block_size,
            dtype,
        )

    @staticmethod
    def _drafter(config: EngineConfig) -> NgramDrafter[SamplingParams] | None:
        """The n-gram drafter when speculative decoding is on (``num_speculative_tokens`` > 0)."""
        if not config.num_speculative_tokens:
            return None
        return NgramDrafter(
            config.num_speculative_tokens,
            config.ngram_prompt_lookup_max,
            config.ngram_prompt_lookup_min,
            allow=may_speculate,
        )

    def _static_steps(
        self,
        buckets: StepBuckets,
        kv_caches: list[torch.Tensor],
        services: DeviceServices,
        block_size: int,
        max_blocks_per_seq: int,
        *,
        spmd_size: int = 1,
    ) -> StaticSteps:
        """The padded, compiled path for a backend that declares ``buckets``; compiles every shape now
        (over a mesh of ``spmd_size`` devices when that is above 1)."""
        config = self.config
        # a step's flat list holds each of its sequences' blocks: at most max_num_seqs full tables
        max_flat = config.max_num_seqs * max_blocks_per_seq
        short = []
        for label, bucket_set, tokens in (("", buckets, config.max_num_batched_tokens), ("decode ", buckets.decode, 0)):
            if bucket_set is None:
                continue
            largest = bucket_set.largest()
            needs = [
                ("tokens", largest.tokens, tokens or min(config.max_num_seqs, config.max_num_batched_tokens)),
                ("sequences", largest.seqs, min(config.max_num_seqs, config.max_num_batched_tokens)),
                ("blocks per sequence", largest.blocks_per_seq, max_blocks_per_seq),
            ]
            if bucket_set.flat_blocks:
                needs.append(("flat blocks", largest.flat_blocks, max_flat))
            short += [f"{label}{what} {have} < {need}" for what, have, need in needs if have < need]
        if short:
            raise InvalidRequest(
                f"backend {self.backend.name!r} declares step buckets too small for this engine ("
                + ", ".join(short)
                + "): lower max_num_batched_tokens / max_num_seqs / max_model_len"
            )
        program = ModelStepProgram(self.model, block_size, self.model_config.vocab_size, self.model_config.hidden_size)
        cache_dir = compile_cache_dir(config)
        spmd = None
        if spmd_size > 1:
            spmd = spmd_plan(self.model, program.weights, spmd_size, self.model_config.num_kv_heads)
            if config.enforce_eager:
                logger.warning("enforce_eager: the eager steps run on one device, not the %d-device mesh", spmd_size)
        static = StaticSteps(
            buckets, program, kv_caches, services, block_size, cache_dir, compile=not config.enforce_eager, spmd=spmd
        )
        lap = time.monotonic()
        static.warmup()
        self.startup_seconds["compile"] = time.monotonic() - lap
        logger.info(
            "static-shape steps: %d shapes, %d compilations at warm-up in %.1fs",
            len(buckets.shapes()),
            static.compilations,
            self.startup_seconds["compile"],
        )
        return static

    def _num_blocks(self, ranks: list[RankMemory], block_size: int) -> int:
        """KV blocks every rank allocates (see :func:`~plinth.runtime.parts.kv_blocks`)."""
        needed = self.config.max_num_seqs * -(-self.max_model_len // block_size) + 1  # +1: the null block
        return kv_blocks(ranks, self.config, needed)

    # -- LoRA adapters -------------------------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load the PEFT LoRA adapter in folder ``path`` as ``name`` (between steps).

        :raises InvalidRequest: LoRA is off, or the adapter is refused (the ``param`` names the field).
        """
        return self._lora_manager().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``; requests running with it finish with it first.

        :raises InvalidRequest: LoRA is off or no adapter of that name is loaded.
        """
        self._lora_manager().remove(name)

    def list_loras(self) -> list[str]:
        """The names of the loaded LoRA adapters (empty when LoRA is off)."""
        return self.lora.names() if self.lora is not None else []

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRAError("LoRA adapters need an engine started with enable_lora=True", param="lora")
        return self.lora

    # -- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora: str | None = None,
    ) -> None:
        """Validate and queue a request; ``lora`` names a loaded LoRA adapter to run it with.

        :raises InvalidRequest: empty or over-long prompt, a token id outside the vocabulary (in the
            prompt or ``params.logit_bias``), a structured-output constraint that cannot be enforced
            (the message names the keyword), an adapter that is not loaded (``param`` "lora"), or a
            duplicate request id. Nothing is queued then; running requests are unaffected.
        """
        params = params or SamplingParams()
        if request_id in self._groups or request_id in self._embeddings:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if lora is not None and self._lora_manager().get(lora) is None:  # refused before any work
            self._lora_manager().acquire(lora)  # raises: the message names the adapters that are loaded
        if isinstance(prompt, str):
            text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, list(prompt)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.logit_bias and (biased := sorted(t for t in params.logit_bias if t >= vocab)):
            raise InvalidRequest(f"logit_bias token ids {biased[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens; the context length is {self.max_model_len} "
                "(at least one token must remain for the output)"
            )
        max_tokens = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        blocks_needed = -(-(len(prompt_ids) + max_tokens) // self.block_size)
        if blocks_needed > self.num_blocks - 1:
            raise InvalidRequest(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) needs {blocks_needed} "
                f"KV blocks; the cache holds {self.num_blocks - 1}: lower max_tokens or enlarge the cache"
            )
        stop = StopCriteria(
            max_tokens=max_tokens,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
        )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequest(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if params.prompt_logprobs is not None and self.static is not None:
            # the static path returns one logits row per sequence
            raise InvalidRequest(
                "prompt_logprobs need an eager or step-graph runner: not with static-shape steps yet",
                param="prompt_logprobs",
            )
        lora_id = self.lora.acquire(lora) if lora is not None and self.lora is not None else 0
        seed, top = params.seed, params.prompt_logprobs
        request = Request(
            request_id, prompt_ids, stop, params=params, seed=seed, n=params.n, prompt_logprobs=top, lora_id=lora_id
        )
        group = _Group(
            request_id,
            text,
            prompt_ids,
            params,
            RequestMetrics(request.arrival_time, num_prompt_tokens=len(prompt_ids)),
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt_ids),
            lora_id=lora_id,
        )
        self._add_sequence(group, 0)
        if params.structured is not None:
            try:
                self.structured.add(request_id, params)
            except UnsupportedConstraint as exc:
                self._release_lora(group)
                raise InvalidRequest(str(exc), param=f"structured.{exc.field}") from exc
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:  # the scheduler's own guard: forget the request, keep serving
            self.structured.forget(request_id)
            self._release_lora(group)
            raise InvalidRequest(str(exc)) from exc
        self._groups[request_id] = group

    def add_embedding_request(
        self, request_id: str, prompt: str | list[int], params: PoolingParams | None = None
    ) -> None:
        """Validate and queue an embedding request: its prompt is computed like any prompt's
        (batched with generation, chunked), nothing is sampled, and one finished output with
        ``embedding`` set comes from ``step()`` once the prompt is computed.

        :raises InvalidRequest: as for :meth:`add_request` (a prompt may fill the whole context
            here), a ``dimensions`` the model does not allow, or an engine that cannot pool
            (static-shape steps, pipeline parallelism). Nothing is queued then.
        """
        params = params or PoolingParams()
        if request_id in self._groups or request_id in self._embeddings:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if self.static is not None or isinstance(self.runner, PipelineRunner):
            # the static path returns logits rows only; a pipeline's hidden states end on the last stage
            raise InvalidRequest(
                "embeddings need an eager or step-graph runner: not with static-shape steps or pipeline parallelism yet"
            )
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        request = self._embeddings.make(request_id, ids, params, self.model_config, self.max_model_len)
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self._embeddings.add(request, text, params)

    def _add_sequence(self, group: _Group, index: int) -> _Sequence:
        seq = _Sequence(
            index=index,
            detok=IncrementalDetokenizer(
                self.tokenizer, group.prompt_token_ids, skip_special_tokens=group.params.skip_special_tokens
            ),
            logprobs=[] if group.params.logprobs is not None else None,
        )
        group.seqs[index] = seq
        return seq

    def abort_request(self, request_id: str) -> None:
        """Abort a request and all its sequences; their KV blocks return to the pool at once."""
        self.structured.forget(request_id)
        group = self._groups.pop(request_id, None)
        if group is not None:
            self._release_lora(group)
        if group is not None or self._embeddings.discard(request_id):
            self.scheduler.finish(EngineFinishes(aborted=[request_id]))

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._groups or self._embeddings)

    def abort_all(self) -> list[str]:
        """Abort every request, also after a ``step()`` that raised midway, so the engine takes new ones.

        :return: the ids of the requests aborted.
        """
        ids = list(self._groups) + self._embeddings.ids()
        for request_id in ids:
            self.abort_request(request_id)
        self.scheduler.abort_all()  # also forgets the step that never reached update()
        self.runner.pooler.take()  # and any vector that half-done step pooled
        self.runner.prompt_scorer.take()  # and any prompt rows it scored
        return ids

    # -- the step loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch; return the outputs of requests that advanced."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            if self.scheduler.has_unfinished():
                # add_request refuses what can never fit, so an idle step with work queued is a bug
                raise RuntimeError("the scheduler made no progress with requests queued")
            return []
        started = time.monotonic()
        for chunk in sched_out.scheduled:  # queue time ends at a request's first scheduled step
            rid = chunk.seq_id.request_id
            group = self._groups.get(rid)
            metrics = group.metrics if group is not None else self._embeddings.metrics(rid)
            if metrics is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = started
        if self.fatal is not None:
            raise self.fatal
        masks = None
        if self.structured.active:  # the grammars' masks are filled on a thread while the model runs
            masks = self.structured.step_masks([s for chunk in sched_out.scheduled for s in chunk.samples])
        try:
            if self.executor is not None:  # the workers run the same step on their shards, in lockstep
                self.executor.broadcast(sched_out)
            results = self.runner.execute(sched_out, masks)
        except CollectiveError as e:  # a rank died or hung inside the forward's collectives
            assert self.executor is not None
            self.fatal = WorkerFailure(self.executor.diagnose(str(e)))
            raise self.fatal from e
        except WorkerFailure as e:
            self.fatal = e
            raise
        for seq_id, rows in self.runner.prompt_scorer.take().items():
            scored = self._groups.get(seq_id.request_id)
            if scored is not None and scored.prompt_logprobs is not None:  # else aborted meanwhile
                merge(scored.prompt_logprobs, rows)
        sampled = {seq_id: r.token_id for seq_id, r in results.items()}
        accepted = {seq_id: [a.token_id for a in r.accepted] for seq_id, r in results.items() if r.accepted}
        advanced = self.scheduler.update(sched_out, sampled, accepted)
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        stopped = []  # sequences whose text reached a stop string: finished in one call below
        for req in advanced:
            group = self._groups.get(req.request_id)
            if group is None:
                continue  # aborted meanwhile
            seq = group.seqs.get(req.sample_index) or self._add_sequence(group, req.sample_index)
            result = results[req.seq_id]
            complete = group.params.structured is not None and self.structured.accept(req.seq_id, result.token_id)
            if self._observe(group, seq, req, result, now):
                stopped.append(req.seq_id)
            elif complete and not req.status.finished:  # the grammar allows nothing more: end it here
                seq.detok.flush()
                seq.finish_reason = "stop"
                stopped.append(req.seq_id)
            touched[req.request_id] = group
        if stopped:
            self.scheduler.finish(EngineFinishes(stopped=stopped))
        outputs = []
        for group in touched.values():
            output = self._output(group)
            outputs.append(output)
            if output.finished:
                self._release(group)
        if self._embeddings:  # the embedding requests whose prompt this step completed
            outputs += self._embeddings.outputs(self.runner.pooler.take())
        return outputs

    def _observe(
        self, group: _Group, seq: _Sequence, req: Request[SamplingParams], result: SampleResult, now: float
    ) -> bool:
        """Take the sequence's new tokens (``result`` is its sample, after any accepted drafts'
        results); True when its text now ends in a stop string (the caller finishes it in the
        scheduler). A step with drafts brings several tokens: each is taken as a plain step would,
        and those after a stop string are dropped."""
        new_ids = req.output_token_ids[seq.num_seen :]
        if not new_ids:
            return False
        seq.num_seen = len(req.output_token_ids)
        m = group.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_cached_prompt_tokens = max(m.num_cached_prompt_tokens, req.num_cached_prompt_tokens)
        m.num_preemptions = max(m.num_preemptions, req.num_preemptions)
        emitted = [*result.accepted, result] if result.accepted else [result]
        last = len(new_ids) - 1
        for i, token in enumerate(new_ids):
            m.num_generated_tokens += 1
            if seq.logprobs is not None:
                r = emitted[min(i, len(emitted) - 1)]
                seq.logprobs.append(TokenLogprob(r.token_id, r.logprob or 0.0, r.top_logprobs or []))
            seq.detok.step([token])
            if i == last and req.status.finished:
                seq.detok.flush()  # the sequence is over: emit any held-back partial character
                seq.finish_reason = req.status.finish_reason
                if req.status is RequestStatus.FINISHED_STOPPED and token in req.stop.stop_token_ids:
                    seq.stop_reason = token
                return False
            stop = self._find_stop_string(group.params, seq)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        return False

    def _find_stop_string(self, params: SamplingParams, seq: _Sequence) -> str | None:
        """The earliest stop string in the text added since the last scan (a stop may straddle the
        boundary); text produced before ``min_tokens`` is never searched."""
        if not params.stop:
            return None
        text = seq.detok.text
        scan_from, seq.stop_scan_from = seq.stop_scan_from, len(text)
        if len(seq.detok.output_ids) <= params.min_tokens:
            return None
        found: tuple[int, str] | None = None
        for stop in params.stop:
            pos = text.find(stop, max(0, scan_from - len(stop) + 1))
            if pos >= 0 and (found is None or pos < found[0]):
                found = (pos, stop)
        if found is None:
            return None
        pos, stop = found
        seq.detok.truncate(pos + len(stop) if params.include_stop_str_in_output else pos)
        return stop

    def _output(self, group: _Group) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.detok.text,
                token_ids=list(seq.detok.output_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.logprobs,
            )
            for seq in sorted(group.seqs.values(), key=lambda s: s.index)
        ]
        finished = len(completions) == group.params.n and all(c.finished for c in completions)
        if finished:
            group.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            metrics=group.metrics,
            finished=finished,
            prompt_logprobs=group.prompt_logprobs,
        )

    def _release(self, group: _Group) -> None:
        # the scheduler already forgot its sequences; the runner drops their generators when the
        # next step's output lists them as finished
        if self._groups.pop(group.request_id, None) is not None:
            self._release_lora(group)
        self.structured.forget(group.request_id)

    def _release_lora(self, group: _Group) -> None:
        """The group no longer holds its adapter (an unloaded adapter's slot frees with its last group)."""
        if group.lora_id and self.lora is not None:
            self.lora.release(group.lora_id)
            group.lora_id = 0
