"""Pipeline parallelism: contiguous layer ranges per stage, hidden states sent between stages.

Stage ``s`` of ``S`` holds layers ``[start, stop)`` (the layers split as evenly as possible, the
earlier stages taking the remainder); stage 0 also holds the embedding, the last stage the final
norm and the LM head (and, for a tied model, the embedding matrix as its LM head). Rank 0 is stage 0
and the engine. Each step's sequences are cut into micro-batches; stage 0 sends micro-batch ``m``'s
hidden state and residual on (a non-blocking send) and starts on ``m + 1`` while stage 1 works on
``m``, so the stages overlap; the last stage sends each micro-batch's logits back to rank 0, which
samples.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from plinth.model.config import ModelConfig
from plinth.platform.backend import Communicator
from plinth.platform.quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class PipelineError(ValueError):
    """The model cannot be split into these stages: the message names the sizes."""


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """Stage ``stage``'s layers: ``num_layers`` split as evenly as possible, earlier stages first.

    :raises PipelineError: fewer layers than stages.
    """
    if num_layers < num_stages:
        raise PipelineError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


@dataclass(slots=True)
class PipelineStage:
    """One stage of the pipeline: its layers, its neighbours and the device group's collectives.

    ``comm`` is the pipeline group (ranked by stage: this rank and the ranks of the other stages with
    the same ``tp_rank``). With tensor parallelism too, every rank of a stage runs the stage's layers
    on its shard; only ``tp_rank`` 0's pipeline group reaches rank 0, so only it trades logits.
    """

    stage: int
    num_stages: int
    layers: range
    comm: Communicator
    #: this rank's place in its stage's tensor-parallel group (0 without tensor parallelism)
    tp_rank: int = 0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def trades_logits(self) -> bool:
        """Whether this rank sends (last stage) or receives (rank 0) the logits of each micro-batch."""
        return self.tp_rank == 0

    def owns(self, name: str, config: ModelConfig) -> bool:
        """Whether this stage loads the checkpoint tensor ``name``."""
        m = _LAYER.match(name)
        if m is not None:
            return int(m.group(1)) in self.layers
        if name == "model.embed_tokens.weight":
            return self.first or (self.last and config.tie_word_embeddings)
        return self.last  # model.norm, lm_head


def stage_weights(
    weights: Iterator[tuple[str, Weight]], stage: PipelineStage, config: ModelConfig
) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors this stage holds; the others are dropped as they are read."""
    for name, tensor in weights:
        if stage.owns(name, config):
            yield name, tensor
