"""The sharding plan: which slice of each weight a tensor-parallel rank loads (no processes here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plinth.model.config import ModelConfig
from plinth.parallel.sharding import ShardingError, ShardPlan
from plinth.platform.quant import QuantizedWeight, dequantize, quantize_q8_0


def _config(**overrides: object) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=10,
        hidden_size=16,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        max_position_embeddings=32,
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_a_model_that_does_not_split_is_refused_naming_each_field() -> None:
    with pytest.raises(ShardingError) as e:
        ShardPlan.for_config(_config(), 0, 3)
    text = str(e.value)
    assert "num_attention_heads 4 is not divisible by 3" in text
    assert "num_key_value_heads 2 neither divides nor is divisible by 3" in text
    assert "intermediate_size 8 is not divisible by 3" in text
    assert ShardPlan.for_config(_config(), 1, 2).local_heads == 2  # the same model splits 2 ways


def test_heads_kv_heads_intermediate_and_vocab_split_and_reassemble() -> None:
    config = _config()
    plans = [ShardPlan.for_config(config, r, 2) for r in range(2)]
    q = torch.randn(16, 16)  # 4 heads x 4
    kv = torch.randn(8, 16)  # 2 kv heads x 4
    o = torch.randn(16, 16)
    emb = torch.randn(10, 16)
    assert torch.equal(torch.cat([p.shard("model.layers.0.self_attn.q_proj.weight", q) for p in plans]), q)
    assert torch.equal(torch.cat([p.shard("model.layers.0.self_attn.k_proj.weight", kv) for p in plans]), kv)
    assert torch.equal(torch.cat([p.shard("model.layers.0.self_attn.o_proj.weight", o) for p in plans], 1), o)
    bias = torch.randn(16)
    assert plans[1].shard("model.layers.0.self_attn.o_proj.bias", bias) is bias  # added once, after the sum
    assert plans[1].shard("model.norm.weight", bias) is bias
    vocab = [p.shard("model.embed_tokens.weight", emb) for p in plans]
    assert [v.shape[0] for v in vocab] == [5, 5] and torch.equal(torch.cat(vocab), emb)
    local = plans[0].local_config(config)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 4, 5)


def test_more_ranks_than_kv_heads_replicate_them_and_pad_the_vocabulary() -> None:
    config = _config(num_kv_heads=1, vocab_size=11, intermediate_size=16)
    kv = torch.arange(4 * 16, dtype=torch.float32).view(4, 16)  # one kv head of 4
    plans = [ShardPlan.for_config(config, r, 4) for r in range(4)]
    assert all(torch.equal(p.shard("model.layers.0.self_attn.v_proj.weight", kv), kv) for p in plans)
    assert [p.kv_head_start for p in plans] == [0, 0, 0, 0]
    two = dataclasses.replace(config, num_kv_heads=2)
    assert [ShardPlan.for_config(two, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    emb = torch.randn(11, 16)
    last = plans[3].shard("lm_head.weight", emb)  # rows 9, 10 and one zero row of padding
    assert last.shape == (3, 16) and torch.equal(last[:2], emb[9:]) and not last[2].any()


def test_quantized_weights_keep_their_blocks_when_the_split_is_aligned() -> None:
    config = _config(hidden_size=64, num_heads=2, num_kv_heads=2, head_dim=32, intermediate_size=64)
    plans = [ShardPlan.for_config(config, r, 2) for r in range(2)]
    w = quantize_q8_0(torch.randn(64, 64))  # o_proj: input dim 64 -> 32 per rank, one block each
    parts = [p.shard("model.layers.0.self_attn.o_proj.weight", w) for p in plans]
    assert all(isinstance(x, QuantizedWeight) and x.in_features == 32 for x in parts)
    assert torch.equal(torch.cat([dequantize(x) for x in parts], 1), dequantize(w))
    rows = [p.shard("model.layers.0.mlp.gate_proj.weight", w) for p in plans]  # rows: always whole blocks
    assert all(isinstance(x, QuantizedWeight) for x in rows)
    assert torch.equal(torch.cat([dequantize(x) for x in rows]), dequantize(w))


def test_an_unaligned_quantized_split_is_dequantized_exactly(caplog: pytest.LogCaptureFixture) -> None:
    config = _config(hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=64)
    w = quantize_q8_0(torch.randn(64, 64))
    plans = [ShardPlan.for_config(config, r, 4) for r in range(4)]  # 16 inputs per rank: half a block
    parts = [p.shard("model.layers.0.self_attn.o_proj.weight", w) for p in plans]
    assert all(isinstance(x, torch.Tensor) for x in parts) and "dequantized" in caplog.text
    assert torch.equal(torch.cat(parts, 1), dequantize(w))  # type: ignore[arg-type]


def test_fused_rows_grouped_by_shard_put_each_shards_parts_together() -> None:
    from plinth.parallel.sharding import shard_grouped_rows

    # q of 4 rows, k and v of 2 each, over 2 shards: shard 0 takes q0 q1 k0 v0, shard 1 q2 q3 k1 v1
    order = shard_grouped_rows([4, 2, 2], 2)
    assert order is not None and order.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert shard_grouped_rows([4, 2, 2], 1) is None
    with pytest.raises(ShardingError, match=r"fused parts of \[4, 3\] rows do not split into 2 groups"):
        shard_grouped_rows([4, 3], 2)


def test_an_spmd_plan_refuses_a_split_it_does_not_know_and_kv_heads_that_do_not_divide() -> None:
    from plinth.platform.values import SpmdPlan

    assert SpmdPlan(2, {"a": "out", "b": "in"}, 4).size == 2
    with pytest.raises(ValueError, match="'sideways'"):
        SpmdPlan(2, {"a": "sideways"}, 4)
    with pytest.raises(ValueError, match="3 KV heads do not split over 2 devices"):
        SpmdPlan(2, {}, 3)
    with pytest.raises(ValueError, match="at least 2 devices"):
        SpmdPlan(1, {}, 4)


def test_local_ranks_count_the_ranks_before_each_on_its_host() -> None:
    from plinth.parallel.layout import local_ranks

    assert local_ranks(["a", "a", "b", "a", "b"]) == [0, 1, 0, 2, 1]
    assert local_ranks(["a"]) == [0]


def test_a_rank_whose_services_drive_another_device_than_its_own_is_refused_naming_both() -> None:
    """After ``bind_local_rank`` (API 1.13) the services must drive ``device_for_rank(local_rank)``."""
    from plinth.config import EngineConfig
    from plinth.platform.backend import DeviceServices
    from plinth.platform.reference import ReferenceBackend
    from plinth.runtime.parts import InvalidRequest, _split

    class Unbound(DeviceServices):
        def device_for_rank(self, local_rank: int) -> torch.device:
            return torch.device("meta", local_rank)

    backend = ReferenceBackend()
    config = EngineConfig(tensor_parallel_size=2)
    model = ModelConfig("LlamaForCausalLM", 64, 64, 128, 2, 4, 2, 16)
    with pytest.raises(InvalidRequest, match=r"maps rank 1 \(local rank 1\) to meta:1, but its services drive cpu"):
        _split(config, Unbound(torch.device("cpu")), backend.capabilities(), "fake", model, 1, 2, 1)
