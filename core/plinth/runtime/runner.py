"""The model runner: turns a SchedulerOutput into one flattened forward pass and sampled tokens.

It sees only the scheduler's value objects (chunks, samples, sequence ids), never a ``Request``, and
returns the sampled tokens keyed by the ``SequenceId`` each sample names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from plinth.model.context import ForwardContext
from plinth.platform.backend import AttentionKernels, AttentionMetadata, DeviceServices, LoRABatch
from plinth.runtime.graphs import DecodeGraphs
from plinth.runtime.pooler import Pooler
from plinth.runtime.prompt_logprobs import PromptScorer
from plinth.runtime.sampler import Sampler, SampleResult
from plinth.runtime.speculative import logit_rows, verify
from plinth.runtime.static import StaticSteps, decode_first
from plinth.sampling_params import SamplingParams
from plinth.sched.output import ScheduledChunk, SchedulerOutput
from plinth.sched.request import Sample, SequenceId

if TYPE_CHECKING:
    from plinth.runtime.lora import LoRAManager
    from plinth.structured.masks import StepMasks


@dataclass(slots=True)
class BatchInputs:
    """The flattened varlen batch of one step (T tokens, B sequences)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    last_token_index: torch.Tensor  # [B] index into T of each sequence's last token


class CausalLM(Protocol):
    """What the runner needs of a model: a flattened forward and the logits head."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """Owns the model, the KV caches and the sampler; runs one scheduled step at a time.

    :param sampler: default: a :class:`Sampler` with the plain-torch ops.
    :param static: the static-shape path, for a backend that declares step buckets: every step is
        padded and run through it (``graphs`` is then unused).
    :param sample: False on a tensor-parallel worker rank: the forward and the logits run (their
        collectives need every rank), the sampling does not.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        attention: AttentionKernels,
        services: DeviceServices,
        block_size: int,
        graphs: DecodeGraphs | None = None,
        sampler: Sampler | None = None,
        static: StaticSteps | None = None,
        sample: bool = True,
    ) -> None:
        self.model = model
        #: False on a tensor-parallel worker: the step runs (its collectives need every rank), rank 0 samples
        self.sample = sample
        self.graphs = graphs  # decode steps replayed from step graphs; None: every step eager
        self.static = static  # every step padded to a bucket (API 1.5); None: steps keep their shapes
        self.kv_caches = kv_caches
        self.attention = attention  # used for block copies; every layer shares the cache layout
        self.services = services
        self.device = services.device
        self.block_size = block_size
        self.sampler = sampler or Sampler()
        #: embedding requests' vectors, pooled from the hidden states; the engine takes them after the step
        self.pooler = Pooler()
        #: prompt logprobs of the chunks that ask for them; the engine takes them after the step
        self.prompt_scorer = PromptScorer()
        #: the engine's LoRA adapters (None: LoRA off); a step with adapter tokens runs eagerly
        self.lora: LoRAManager | None = None

    def prepare(self, scheduled: list[ScheduledChunk[SamplingParams]]) -> BatchInputs:
        """Build the step's tensors from the scheduler's value objects (in the order given)."""
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        for s in scheduled:
            input_ids.extend(s.token_ids)
            query_lens.append(len(s.token_ids))
            starts.append(s.start_position)
            seq_lens.append(s.start_position + len(s.token_ids))
            tables.append(s.block_ids)
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        # positions of the flattened tokens: each sequence counts up from its start position
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # [T]
        offset_in_seq = torch.arange(len(input_ids)) - query_start_loc[:-1].index_select(0, seq_of_token)
        positions = torch.tensor(starts, dtype=torch.long).index_select(0, seq_of_token) + offset_in_seq
        block_idx = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = block_idx * self.block_size + positions % self.block_size
        # the positions are needed here anyway: the slots and offsets are passed in, not derived again
        attn = AttentionMetadata.from_lengths(
            query_lens,
            seq_lens,
            block_tables,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            device=dev,
        )
        return BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=positions.to(dev),
            attn=attn,
            last_token_index=(query_start_loc[1:] - 1).to(dev),
        )

    @staticmethod
    def _graph_step(out: SchedulerOutput[SamplingParams], graphs: DecodeGraphs) -> bool:
        """Whether this step is a pure decode a step graph can run (counted as eager if not)."""
        if not out.scheduled or any(len(s.token_ids) != 1 or s.prompt_targets is not None for s in out.scheduled):
            return False
        if graphs.bucket(len(out.scheduled)) is None:
            graphs.stats.eager += 1
            return False
        return True

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput[SamplingParams], masks: StepMasks | None = None
    ) -> dict[SequenceId, SampleResult]:
        """Run the step; return one result per sample of the step, keyed by the sample's sequence id.

        ``masks``: the allowed tokens of the step's constrained samples (structured output), being
        filled while the forward runs; the sampler applies them.
        """
        for seq_id in out.finished_seq_ids:
            self.sampler.forget(seq_id)
            self.pooler.forget(seq_id)
        if out.block_copies:
            if self.static is not None:
                self.static.copy_blocks(out.block_copies, self.attention.copy_blocks)
            else:
                self.attention.copy_blocks(self.kv_caches, out.block_copies)
        # the contract's order (API 1.5): decodes, prefills, other chunks; results go by sequence id
        scheduled = decode_first(out.scheduled)
        sampling = [i for i, s in enumerate(scheduled) if s.num_samples > 0]
        # embedding requests' chunks (the engine refuses them on the static path); rank 0 pools
        pooling = [i for i, s in enumerate(scheduled) if s.pool is not None] if self.sample else []
        # prompt-logprobs chunks (refused on the static path too); every rank runs their LM head
        scoring = [i for i, s in enumerate(scheduled) if s.prompt_targets is not None]
        graphs = self.graphs
        # each token's adapter slot; None (every step of an engine without LoRA): the layers skip LoRA
        lora = self.lora.batch(scheduled) if self.lora is not None else None
        if any(s.draft_token_ids for s in scheduled):  # step graphs and static shapes take 1-token decodes only
            return self._execute_drafts(scheduled, sampling, masks, scoring, lora)
        if self.static is not None:
            if not scheduled:
                return {}
            if scoring:  # its steps return one logits row per sequence: no prompt rows to score
                raise RuntimeError("a static-shape step cannot score a prompt (the engine refuses prompt_logprobs)")
            rows = self.static.run(scheduled)  # [B, vocab]
            if not sampling:
                return {}
            logits = rows if len(sampling) == len(scheduled) else rows[torch.tensor(sampling)]
            return self._sample(logits, scheduled, sampling, masks)
        # a step graph records the base model's calls only: steps with adapter tokens run eagerly
        if graphs is not None and lora is None and self._graph_step(out, graphs):
            hidden = graphs.run(
                [s.token_ids[0] for s in scheduled],
                [s.start_position for s in scheduled],
                [s.block_ids for s in scheduled],
            )  # [B, hidden]: one row per sequence
            if pooling:
                self.pooler.pool(hidden, scheduled, pooling)
            if not sampling:
                return {}
            last = hidden if len(sampling) == len(scheduled) else hidden[torch.tensor(sampling, device=self.device)]
        else:
            batch = self.prepare(scheduled)
            hidden = self.model(batch.input_ids, batch.positions, ForwardContext(batch.attn, self.kv_caches, lora))
            if pooling:
                self.pooler.pool(hidden, scheduled, pooling)
            if scoring:
                self.prompt_scorer.score(self.model.compute_logits, hidden, scheduled, scoring, keep=self.sample)
            if not sampling:
                return {}
            idx = batch.last_token_index.index_select(0, torch.tensor(sampling, device=self.device))
            last = hidden.index_select(0, idx)
        return self._sample(self.model.compute_logits(last), scheduled, sampling, masks)  # logits [S, V]

    def _execute_drafts(
        self,
        scheduled: list[ScheduledChunk[SamplingParams]],
        sampling: list[int],
        masks: StepMasks | None,
        scoring: list[int],
        lora: LoRABatch | None = None,
    ) -> dict[SequenceId, SampleResult]:
        """An eager step with draft tokens: logits at every position of each speculating chunk
        (and at the prompt rows of the chunks ``scoring`` indexes, for their prompt logprobs)."""
        if self.static is not None:
            raise RuntimeError("a static-shape step cannot take draft tokens (the engine refuses speculation there)")
        batch = self.prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, ForwardContext(batch.attn, self.kv_caches, lora))
        if scoring:
            self.prompt_scorer.score(self.model.compute_logits, hidden, scheduled, scoring, keep=self.sample)
        idx = torch.tensor(logit_rows(scheduled, sampling), device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))  # [R, V]
        return verify(self.sampler, logits, scheduled, sampling, masks) if self.sample else {}

    def _sample(
        self,
        logits: torch.Tensor,
        scheduled: list[ScheduledChunk[SamplingParams]],
        sampling: list[int],
        masks: StepMasks | None = None,
    ) -> dict[SequenceId, SampleResult]:
        """Sample every sample of the chunks ``sampling`` indexes; row j of ``logits`` is chunk ``sampling[j]``'s."""
        if not self.sample:
            return {}
        samples: list[Sample[SamplingParams]] = []
        logits_rows: list[int] = []  # the row of `logits` each sample reads (a fork's n share one)
        for j, i in enumerate(sampling):
            for sample in scheduled[i].samples:
                samples.append(sample)
                logits_rows.append(j)
        results = self.sampler.sample(logits, samples, logits_rows, masks, writable=True)  # the step's own logits
        return {sample.seq_id: result for sample, result in zip(samples, results, strict=True)}
