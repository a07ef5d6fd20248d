"""The runner of one pipeline stage: its layers over each micro-batch, hidden states passed on.

Every stage gets the same scheduler output (rank 0 broadcasts it) and cuts it into the same
micro-batches (contiguous groups of the decode-first ordered sequences). For each micro-batch a
stage receives the previous stage's ``[T, 2 * hidden]`` (stage 0 embeds the tokens instead), runs its
layers and sends the result on without waiting for it to arrive, then starts the next micro-batch:
stage ``s`` works on micro-batch ``m`` while stage ``s + 1`` works on ``m - 1``. The last stage sends
the logits of each micro-batch's sampling rows to rank 0, which samples once it has them all, and
the prompt logprobs of its chunks that ask for them (scored there, sent packed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from plinth.model.context import ForwardContext
from plinth.parallel.pipeline import PipelineStage
from plinth.platform.backend import AttentionKernels, DeviceServices, PendingSend
from plinth.platform.devices import HOST
from plinth.runtime.prompt_logprobs import pack_scores, score_buffer, unpack_scores
from plinth.runtime.runner import ModelRunner
from plinth.runtime.sampler import Sampler, SampleResult
from plinth.runtime.static import decode_first
from plinth.sampling_params import SamplingParams
from plinth.sched.output import ScheduledChunk, SchedulerOutput
from plinth.sched.request import SequenceId

if TYPE_CHECKING:
    from plinth.structured.masks import StepMasks


def micro_batches(
    chunks: list[ScheduledChunk[SamplingParams]], count: int
) -> list[list[ScheduledChunk[SamplingParams]]]:
    """``chunks`` cut into at most ``count`` contiguous groups of near-equal size (none empty)."""
    count = max(1, min(count, len(chunks)))
    base, extra = divmod(len(chunks), count)
    out, at = [], 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        out.append(chunks[at : at + n])
        at += n
    return out


class PipelineRunner(ModelRunner):
    """:class:`ModelRunner` for one pipeline stage (eager; no step graphs or static steps).

    :param stage: this process's stage.
    :param num_micro_batches: micro-batches per step (default: one per stage).
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        attention: AttentionKernels,
        services: DeviceServices,
        block_size: int,
        stage: PipelineStage,
        *,
        sampler: Sampler | None = None,
        sample: bool = True,
        num_micro_batches: int | None = None,
    ) -> None:
        super().__init__(model, kv_caches, attention, services, block_size, sampler=sampler, sample=sample)
        self.stage_model = model  # a LlamaForCausalLM-like model: forward_stage, config, dtype
        self.stage = stage
        self.num_micro_batches = num_micro_batches or stage.num_stages

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput[SamplingParams], masks: StepMasks | None = None
    ) -> dict[SequenceId, SampleResult]:
        for seq_id in out.finished_seq_ids:
            self.sampler.forget(seq_id)
        if out.block_copies:  # this stage's layers' caches
            self.attention.copy_blocks(self.kv_caches, out.block_copies)
        scheduled = decode_first(out.scheduled)
        if not scheduled:
            return {}
        stage, comm, model = self.stage, self.stage.comm, self.stage_model
        hidden_size = model.config.hidden_size
        groups = micro_batches(scheduled, self.num_micro_batches)
        pending: list[PendingSend] = []
        for group in groups:
            batch = self.prepare(group)
            received = None
            if not stage.first:
                received = torch.empty(len(batch.input_ids), 2 * hidden_size, dtype=model.dtype, device=self.device)
                comm.recv(received, stage.stage - 1)
            hidden = model.forward_stage(
                batch.input_ids, batch.positions, ForwardContext(batch.attn, self.kv_caches), received
            )
            if not stage.last:
                pending.append(comm.send(hidden, stage.stage + 1))
                continue
            rows = [i for i, s in enumerate(group) if s.num_samples > 0]
            if rows:  # every tensor-parallel rank computes them (the vocab-parallel head gathers)
                idx = batch.last_token_index.index_select(0, torch.tensor(rows, device=self.device))
                logits_rows = model.compute_logits(hidden.index_select(0, idx)).float()
                if stage.trades_logits:
                    pending.append(comm.send(logits_rows, 0))
            scoring = [i for i, s in enumerate(group) if s.prompt_targets is not None]
            if scoring:  # prompt logprobs: scored here, sent to rank 0 packed (a row per prompt token)
                self.prompt_scorer.score(model.compute_logits, hidden, group, scoring, keep=stage.trades_logits)
                if stage.trades_logits:
                    pending.append(comm.send(pack_scores(self.prompt_scorer.take(), group).to(self.device), 0))
        logits: list[torch.Tensor] = []
        if stage.first and stage.trades_logits:  # rank 0: each micro-batch's logits from the last stage, in order
            tp = model.kernels.tp  # the gathered logits are the whole vocabulary, not this rank's slice
            vocab = tp.plan.vocab_size if tp is not None else model.config.vocab_size
            for group in groups:
                n = sum(1 for s in group if s.num_samples > 0)
                if n:
                    buf = torch.empty(n, vocab, dtype=torch.float32, device=self.device)
                    logits.append(comm.recv(buf, stage.num_stages - 1))
                scores = score_buffer(group)
                if scores is not None:  # then its prompt logprobs, if it scored any
                    packed = comm.recv(scores.to(self.device), stage.num_stages - 1)
                    self.prompt_scorer.put(unpack_scores(packed.to(HOST), group))
        for p in pending:
            p.wait()
        sampling = [i for i, s in enumerate(scheduled) if s.num_samples > 0]
        if not self.sample or not sampling:
            return {}
        return self._sample(torch.cat(logits), scheduled, sampling, masks)
