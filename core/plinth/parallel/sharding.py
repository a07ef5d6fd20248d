"""The sharding plan the core owns: which slice of each weight a tensor-parallel rank loads.

Megatron-style, for the Llama family (Llama, Mistral, Qwen2, SmolLM2):

- **column-parallel** (output dim split): the fused QKV projection by heads (each rank its query
  heads and the KV heads they read), gate and up by the intermediate dim; biases split with them;
- **row-parallel** (input dim split): ``o_proj`` and ``down_proj``; each rank's partial product is
  summed over the ranks (all-reduce) and the bias added once, after the reduction;
- **vocab-parallel** embedding and LM head: each rank a contiguous range of the (padded) vocabulary;
  a lookup outside a rank's range contributes zeros to the all-reduce; the logits are all-gathered;
- **KV heads replicated** when the ranks outnumber them: ``tp / num_kv_heads`` ranks share a KV head;
- norms replicated;
- a quantized weight keeps its blocks: rows (the output dim) are sliced whole, and the input dim
  only where the split falls on block boundaries (else that one weight is dequantized, logged).

Weights are sliced while they stream from the checkpoint (:func:`shard_weights`): a rank never
holds more than its shard plus the one tensor being read.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from plinth.model.config import ModelConfig
from plinth.platform.backend import Communicator
from plinth.platform.quant import QUANT_BLOCKS, QuantizedWeight, dequantize

logger = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight


class ShardingError(ValueError):
    """The model cannot be split this way: the message names the field and the sizes."""


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Rank ``rank`` of ``size``'s slice of a model of ``config``'s shape."""

    rank: int
    size: int
    num_heads: int  # the model's
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def for_config(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        """The plan, after checking the model splits ``size`` ways.

        :raises ShardingError: a dimension that does not divide, naming it.
        """
        problems = []
        if config.num_heads % size:
            problems.append(f"num_attention_heads {config.num_heads} is not divisible by {size}")
        kv = config.num_kv_heads
        if kv % size and size % kv:
            problems.append(f"num_key_value_heads {kv} neither divides nor is divisible by {size}")
        if config.intermediate_size % size:
            problems.append(f"intermediate_size {config.intermediate_size} is not divisible by {size}")
        if config.moe is not None:
            problems.append(
                f"its {config.moe.num_experts}-expert MoE layers have no tensor-parallel plan yet "
                "(pipeline parallelism splits them by layer)"
            )
        if problems:
            raise ShardingError(f"cannot split {config.architecture} {size} ways: " + "; ".join(problems))
        return cls(rank, size, config.num_heads, kv, config.head_dim, config.intermediate_size, config.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        """``num_kv_heads / size``, or 1 when the ranks outnumber the KV heads (replicated)."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank keeps."""
        if self.size <= self.num_kv_heads:
            return self.rank * self.local_kv_heads
        return self.rank // (self.size // self.num_kv_heads)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_shard(self) -> int:
        """Rows of the embedding and LM head per rank (the vocabulary padded to a multiple of size)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shape of this rank's model: its heads, KV heads, intermediate and vocabulary slices."""
        return dataclasses.replace(
            config,
            num_heads=self.local_heads,
            num_kv_heads=self.local_kv_heads,
            intermediate_size=self.local_intermediate,
            vocab_size=self.vocab_shard,
        )

    # -- slicing one tensor ------------------------------------------------------------------------

    def _rows(self, name: str, t: Weight, start: int, stop: int, pad_to: int | None = None) -> Weight:
        n = t.shape[0]
        stop_real = min(stop, n)
        index = torch.arange(start, stop_real)
        if isinstance(t, QuantizedWeight):
            part = t.rows(index)
            if pad_to is not None and part.out_features < pad_to:  # padded vocabulary rows: zero blocks
                pad = torch.zeros(pad_to - part.out_features, part.blocks.shape[1], dtype=torch.uint8)
                part = QuantizedWeight(part.format, pad_to, part.in_features, torch.cat([part.blocks, pad]))
            return part
        dense = t[start:stop_real]
        if pad_to is not None and dense.shape[0] < pad_to:
            dense = torch.cat([dense, dense.new_zeros(pad_to - dense.shape[0], *dense.shape[1:])])
        return dense.clone()  # own the slice: the full tensor it came from is dropped

    def _cols(self, name: str, t: Weight, start: int, stop: int) -> Weight:
        if isinstance(t, QuantizedWeight):
            per_block, nbytes = QUANT_BLOCKS[t.format]
            if start % per_block == 0 and stop % per_block == 0:
                blocks = t.blocks.view(t.out_features, -1, nbytes)[:, start // per_block : stop // per_block]
                return QuantizedWeight(
                    t.format, t.out_features, stop - start, blocks.reshape(t.out_features, -1).clone()
                )
            logger.warning(
                "%s: the %d-way split of its %d inputs is not on %s block boundaries (%d values): dequantized",
                name,
                self.size,
                t.in_features,
                t.format,
                per_block,
            )
            t = dequantize(t)
        return t[:, start:stop].clone()

    def shard(self, name: str, t: Weight) -> Weight:
        """This rank's slice of the checkpoint tensor ``name`` (Hugging Face names)."""
        d = self.head_dim
        kind = _kind(name)
        if kind == "q":
            return self._rows(name, t, self.rank * self.local_heads * d, (self.rank + 1) * self.local_heads * d)
        if kind == "kv":
            start = self.kv_head_start * d
            return self._rows(name, t, start, start + self.local_kv_heads * d)
        if kind == "o" and name.endswith(".weight"):
            return self._cols(name, t, self.rank * self.local_heads * d, (self.rank + 1) * self.local_heads * d)
        if kind == "gate_up":
            i = self.local_intermediate
            return self._rows(name, t, self.rank * i, (self.rank + 1) * i)
        if kind == "down" and name.endswith(".weight"):
            i = self.local_intermediate
            return self._cols(name, t, self.rank * i, (self.rank + 1) * i)
        if kind == "vocab":
            start = self.vocab_start
            return self._rows(name, t, start, start + self.vocab_shard, pad_to=self.vocab_shard)
        return t  # norms, row-parallel biases (added once, after the reduction)


_KINDS = (
    (re.compile(r".*\.q_proj\.(weight|bias)$"), "q"),
    (re.compile(r".*\.(k_proj|v_proj)\.(weight|bias)$"), "kv"),
    (re.compile(r".*\.o_proj\.(weight|bias)$"), "o"),
    (re.compile(r".*\.(gate_proj|up_proj)\.(weight|bias)$"), "gate_up"),
    (re.compile(r".*\.down_proj\.(weight|bias)$"), "down"),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "vocab"),
)


def _kind(name: str) -> str:
    for pattern, kind in _KINDS:
        if pattern.match(name):
            return kind
    return "replicated"


def shard_grouped_rows(sizes: list[int], groups: int) -> torch.Tensor | None:
    """The row order that groups a fused weight by shard, for SPMD tensor parallelism.

    A fused weight is its parts (q, k, v; gate, up) of ``sizes`` rows stacked. Grouped, it is
    ``groups`` contiguous groups, group ``r`` holding the ``r``-th ``1/groups`` of every part in
    part order, so an even split of the rows gives each device its own heads (its own slice of the
    intermediate dim). None when ``groups`` is 1 (the plain order).

    :raises ShardingError: a part whose rows do not divide into ``groups``.
    """
    if groups == 1:
        return None
    if any(n % groups for n in sizes):
        raise ShardingError(f"fused parts of {sizes} rows do not split into {groups} groups")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    order = [
        start + g * (n // groups) + j
        for g in range(groups)
        for start, n in zip(starts, sizes, strict=True)
        for j in range(n // groups)
    ]
    return torch.tensor(order, dtype=torch.long)


def shard_weights(weights: Iterator[tuple[str, Weight]], plan: ShardPlan) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors, each cut to this rank's slice as it is read."""
    for name, tensor in weights:
        yield name, plan.shard(name, tensor)


@dataclass(slots=True)
class TensorParallel:
    """What a tensor-parallel model's layers need: the plan and the device group's collectives."""

    plan: ShardPlan
    comm: Communicator

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size
