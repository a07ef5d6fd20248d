"""SPMD tensor parallelism (plugin API 1.12): one process, a mesh of devices, the compiler's collectives.

A backend that declares ``Capabilities.spmd`` (an XLA-style compiler: the tpu backend) is not run
as worker processes. The core loads the whole model once, with the fused q/k/v and gate/up rows
grouped by shard (:func:`~plinth.parallel.sharding.shard_grouped_rows`), and hands the backend's
``compile_step`` an :class:`~plinth.platform.values.SpmdPlan`: Megatron's plan as placements, which
weight splits along which dimension. The backend places the weights and KV caches over its mesh;
its compiler partitions the step and inserts the all-reduces and all-gathers the plan implies.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from plinth.model.config import ModelConfig
from plinth.model.layers import Linear
from plinth.parallel.sharding import ShardingError, ShardPlan
from plinth.platform.values import SpmdPlan

#: Linear modules split by output (column-parallel) and by input (row-parallel), by attribute name.
_BY_OUTPUT = frozenset({"qkv_proj", "gate_up_proj", "lm_head"})
_BY_INPUT = frozenset({"o_proj", "down_proj"})


def check_spmd(config: ModelConfig, size: int) -> None:
    """Check ``config``'s model splits over a mesh of ``size`` devices.

    :raises ShardingError: naming each dimension that does not divide (KV heads must divide: a
        mesh splits the caches by head and never replicates one).
    """
    ShardPlan.for_config(config, 0, size)  # heads, intermediate, MoE
    if config.num_kv_heads % size:
        raise ShardingError(
            f"cannot split {config.architecture} over {size} devices: num_key_value_heads "
            f"{config.num_kv_heads} is not divisible by {size} (an SPMD mesh splits the KV cache by head)"
        )


def spmd_plan(model: nn.Module, weights: Mapping[str, torch.Tensor], size: int, num_kv_heads: int) -> SpmdPlan:
    """The plan for ``model``'s step-program ``weights`` (names as :class:`StepProgram` gives them).

    Column-parallel linears (fused q/k/v, gate/up, the LM head) split by output, weight and bias;
    row-parallel ones (``o_proj``, ``down_proj``) by input, their bias whole; the embedding table by
    vocabulary row; everything else (norms, rotary tables) is left out: replicated.
    """
    splits: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        if not isinstance(module, Linear) or leaf not in _BY_OUTPUT | _BY_INPUT:
            continue
        how = "out" if leaf in _BY_OUTPUT else "in"
        prefix = f"{mod_name}.weight."
        for name in weights:
            if name.startswith(prefix) and not (how == "in" and name == prefix + "bias"):
                splits[name] = how
    if "embed_tokens" in weights:
        splits["embed_tokens"] = "out"
    return SpmdPlan(size, splits, num_kv_heads)
