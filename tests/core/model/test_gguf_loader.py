"""GGUF loading: a tiny GGUF written here the way llama.cpp's converter writes one (names, Q/K row
permutation, metadata), loaded by plinth and compared with the Hugging Face model it came from;
plus the default SmolLM2 Q4_1 file against transformers' own GGUF loader (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import one_gguf_parse
from model_helpers import allocate_caches, hf_logits, reference_kernels, run_step, save_tiny
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from plinth.model.gguf_loader import hf_name, unpermute_qk
from plinth.model.gguf_reader import GGML_TYPES, GGUFFile
from plinth.model.llama import canonical_name
from plinth.model.loader import load_config, load_model, load_tokenizer, resolve_model
from plinth.platform.reference import ReferenceBackend

PROMPT = [5, 17, 200, 3, 99, 42, 7, 7, 128, 250, 1, 64, 33]

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, kind = name.rsplit(".", 1)
    if base in top:
        return f"{top[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{kind}"


def write_gguf(path: Path, hf: Any, arch: str, expert_type: Any = None, matrix_type: Any = np.float32) -> None:
    """Write ``hf`` as a GGUF the way llama.cpp's converter lays it out: F32 (2-D matrices in
    ``matrix_type``, e.g. np.float16 for an F16 file), experts stacked into one [E, N, K] tensor per
    layer and projection (in ``expert_type``, e.g. Q8_0, when given)."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for raw_name, tensor in hf.state_dict().items():
        name = canonical_name(raw_name)  # Mixtral's block_sparse_moe.experts.E.w1 -> mlp.experts.E.gate_proj
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if ".mlp.experts." in name:  # transformers 5 holds them fused in memory: [E, 2I, H] and [E, H, I]
            prefix, rest = name.split(".mlp.experts.")
            if rest == "gate_up_proj":
                gate, up = np.split(data, 2, axis=1)
                stacks[(prefix, "gate_proj")] = dict(enumerate(gate))
                stacks[(prefix, "up_proj")] = dict(enumerate(up))
            elif rest == "down_proj":
                stacks[(prefix, "down_proj")] = dict(enumerate(data))
            else:  # per-expert names: E.gate_proj.weight
                index, proj, _ = rest.split(".")
                stacks.setdefault((prefix, proj), {})[int(index)] = data
            continue
        if name.endswith("shared_expert_gate.weight"):
            data = data[0]  # llama.cpp stores the [1, H] gate as [H]
        if data.ndim == 2:
            data = data.astype(matrix_type)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    for (prefix, proj), by_index in stacks.items():
        stacked = np.ascontiguousarray(np.stack([by_index[e] for e in sorted(by_index)]))  # [E, N, K]
        layer = prefix.split(".")[2]
        name = f"blk.{layer}.{_EXPERT[proj]}.weight"
        if expert_type is None:
            writer.add_tensor(name, stacked)
        else:
            packed = gguf.quants.quantize(stacked, expert_type)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("llama", LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_theta=100000.0)),
        ("qwen2", Qwen2Config(**_COMMON, tie_word_embeddings=False)),
        ("qwen3", Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=False)),
        ("llama", MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)),  # Mixtral
        (
            "qwen2moe",
            Qwen2MoeConfig(
                **_COMMON,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                tie_word_embeddings=False,
            ),
        ),
        (
            "qwen3moe",
            Qwen3MoeConfig(
                **_COMMON,
                head_dim=16,
                num_experts=8,
                num_experts_per_tok=3,
                moe_intermediate_size=24,
                norm_topk_prob=True,
            ),
        ),
    ],
    ids=["llama", "qwen2", "qwen3", "mixtral", "qwen2moe", "qwen3moe"],
)
def test_tiny_gguf_logits_match_hf(tmp_path: Path, arch: str, config: Any) -> None:
    hf = save_tiny(config, tmp_path / "hf")
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, hf, arch)
    source = resolve_model(str(path))
    assert source.kind == "gguf"
    model, cfg = load_model(source, reference_kernels(), torch.float32, 4, "float32")
    assert cfg.tie_word_embeddings == config.tie_word_embeddings
    assert cfg.attention_bias == (arch in ("qwen2", "qwen2moe"))
    assert cfg.architecture == type(hf).__name__
    logits = run_step(model, allocate_caches(model, 1), [PROMPT], [0])
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() < 1e-4


def test_gguf_expert_tensors_split_per_expert(tmp_path: Path) -> None:
    """A [E, N, K] Q8_0 expert tensor comes back as E raw-block weights, each the expert's own rows."""
    config = Qwen3MoeConfig(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    hf = save_tiny(config, tmp_path / "hf")
    path = tmp_path / "q8-experts.gguf"
    write_gguf(path, hf, "qwen3moe", expert_type=gguf.GGMLQuantizationType.Q8_0)
    file = GGUFFile(path)
    parts = file.quantized_experts("blk.1.ffn_up_exps.weight")
    assert parts is not None and len(parts) == 4
    dense = file.tensor("blk.1.ffn_up_exps.weight")  # [E, I, H] dequantized
    from plinth.platform.quant import dequantize

    for e, part in enumerate(parts):
        assert part.format == "q8_0" and part.shape == (hf.config.moe_intermediate_size, 64)
        assert torch.equal(dequantize(part), dense[e])
        original = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][e].chunk(2)[1]  # [E, 2I, H] in memory
        assert (dense[e] - original).abs().max().item() < 0.02  # q8_0's rounding, and the right expert
    # loaded through the model, the Q8_0 experts give the logits of the HF model with those same
    # rounded experts (a rounding can change a token's routing, so the unrounded model is no oracle)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            gate, up, down = (file.tensor(f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            layer.mlp.experts.down_proj.copy_(down)
    model, _ = load_model(resolve_model(str(path)), reference_kernels(), torch.float32, 4, "float32")
    logits = run_step(model, allocate_caches(model, 1), [PROMPT], [0])
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() < 1e-4


@pytest.mark.parametrize(("n_head", "n_kv"), [(4, 4), (4, 2), (9, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_kv: int) -> None:
    head_dim, dim = 8, 12
    q = torch.randn(n_head * head_dim, dim)
    k = torch.randn(n_kv * head_dim, dim)
    bias = torch.randn(n_kv * head_dim)
    pq = torch.from_numpy(llama_cpp_permute(q.numpy(), n_head, n_head))
    pk = torch.from_numpy(llama_cpp_permute(k.numpy(), n_head, n_kv))
    pb = torch.from_numpy(llama_cpp_permute(bias.numpy(), n_head, n_kv))
    assert not torch.equal(pq, q)
    assert torch.equal(unpermute_qk(pq, n_head), q)
    assert torch.equal(unpermute_qk(pk, n_kv), k)
    assert torch.equal(unpermute_qk(pb, n_kv), bias)


def test_gguf_name_mapping() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    # Gemma 3's ffn_norm is the norm before the MLP; Llama's is post_attention_layernorm
    assert hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_name("blk.1.ffn_up_exps.weight", "qwen3moe") == "model.layers.1.mlp.experts.{e}.up_proj.weight"
    with pytest.raises(ValueError, match="blk.0.attn_sinks.weight"):
        hf_name("blk.0.attn_sinks.weight")


def _one_tensor_gguf(path: Path, packed: np.ndarray, kind: Any) -> Path:
    """A GGUF file at ``path`` holding one tensor "t.weight" of ggml type ``kind``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t.weight", packed, raw_shape=packed.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequantize_matches_gguf(tmp_path: Path, qtype: str) -> None:
    """plinth's reader (torch fast paths for Q8_0/Q4_0/Q4_1) is bit-identical to gguf's numpy code."""
    kind = gguf.GGMLQuantizationType[qtype]
    data = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    packed = gguf.quants.quantize(data, kind)
    got = GGUFFile(_one_tensor_gguf(tmp_path / "q.gguf", packed, kind)).tensor("t.weight")
    assert got.shape == (48, 96) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), gguf.quants.dequantize(packed, kind))


def test_type_table_matches_gguf() -> None:
    """The reader's own ggml type table (it spares a cold start gguf's import) agrees with gguf's."""
    for type_id, (name, block, block_bytes) in GGML_TYPES.items():
        kind = gguf.GGMLQuantizationType(type_id)
        assert (kind.name, *gguf.GGML_QUANT_SIZES[kind]) == (name, block, block_bytes)


def test_a_type_only_gguf_knows_is_read_through_gguf(tmp_path: Path) -> None:
    kind = gguf.GGMLQuantizationType.TQ2_0
    assert kind.value not in GGML_TYPES
    data = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    packed = gguf.quants.quantize(data, kind)
    f = GGUFFile(_one_tensor_gguf(tmp_path / "tq.gguf", packed, kind))
    assert f.tensors["t.weight"].type_name == "TQ2_0" and f.quantized("t.weight") is None
    assert np.array_equal(f.tensor("t.weight").numpy(), gguf.quants.dequantize(packed, kind))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)


# -- the default model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_source() -> Any:
    pytest.importorskip("gguf")
    try:
        return resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_default_model_config_from_metadata(default_source: Any) -> None:
    cfg = load_config(default_source)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192 and cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]


def test_default_model_reads_without_gguf_and_without_copies(default_source: Any) -> None:
    """A Q4_1 model's header, quantized blocks (views of the file's map) and fp32 norms are read
    without importing the gguf package (about 0.1 s of a cold start)."""
    code = (
        "import sys; from plinth.model.gguf_reader import GGUFFile; "
        f"f = GGUFFile({str(default_source.path)!r}); "
        "q = f.quantized('blk.0.ffn_up.weight'); n = f.tensor('blk.0.attn_norm.weight'); "
        "base = q.blocks.untyped_storage().data_ptr(); "
        "import mmap, ctypes; m = ctypes.addressof(ctypes.c_char.from_buffer(f._map)); "
        "print('gguf' in sys.modules, m <= base < m + len(f._map), tuple(n.shape))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "(576,)"], out.stdout + out.stderr


def _transformers_gguf_model(path: Path) -> Any:
    """transformers' fp32 model of a GGUF: from_pretrained when accelerate is there, else the same
    conversion by hand (transformers' GGUF config, dequantization and Q/K un-permutation)."""
    from transformers import AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401
    except ImportError:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        config = LlamaConfig(**{k: v for k, v in parsed.items() if k not in ("model_type", "_model_name_or_path")})
        model = LlamaForCausalLM(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        if config.tie_word_embeddings:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        model.load_state_dict(tensors, strict=True)
        return model.float().eval()
    with one_gguf_parse():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_default_gguf_logits_match_transformers(default_source: Any) -> None:
    model, _ = load_model(default_source, reference_kernels(), torch.float32, 16, "float32")
    hf = _transformers_gguf_model(default_source.path)
    tokenizer = load_tokenizer(default_source)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = tokenizer.encode(text)
    ours = run_step(model, allocate_caches(model, 1), [prompt], [0])
    theirs = hf_logits(hf, prompt)
    assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()
    assert (ours - theirs).abs().max().item() < 1e-3  # measured: 8e-5 (logits up to ~38)


def test_gguf_q8_0_experts_stay_in_their_blocks_on_the_cpu_backend(tmp_path: Path) -> None:
    """Where the backend's fused-MoE op declares q8_0, a GGUF's Q8_0 experts reach it as blocks
    (``prepare_quantized``), and the model still computes what the dequantized one does."""
    from plinth.model.context import ModelKernels
    from plinth.model.layers import SparseMoE
    from plinth.platform.kernels import resolve_kernels

    cpu = pytest.importorskip("plinth_cpu").CpuBackend()
    caps = cpu.capabilities()
    if caps.fused_moe is None or "q8_0" not in caps.fused_moe.quant_formats:
        pytest.skip("the cpu backend's native kernels are not loaded here (no q8_0 experts)")
    config = Qwen3MoeConfig(**_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    hf = save_tiny(config, tmp_path / "hf")
    path = tmp_path / "q8-experts.gguf"
    write_gguf(path, hf, "qwen3moe", expert_type=gguf.GGMLQuantizationType.Q8_0)
    ks = resolve_kernels(cpu, [], "float32", strict=True)
    kernels = ModelKernels(
        gemm=ks.gemm,
        ops=ks.ops,
        attention=ks.attention,
        quant_formats=caps.quant_formats,
        moe=ks.moe,
        moe_quant_formats=caps.fused_moe.quant_formats,
    )
    model, _ = load_model(resolve_model(str(path)), kernels, torch.float32, 16, "float32")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.op is not None and b.op.spec.quant_format == "q8_0" for b in blocks)
    dense, _ = load_model(resolve_model(str(path)), reference_kernels(), torch.float32, 16, "float32")
    caches = [cpu.allocate_kv_cache(s, 8) for s in model.attention_specs()]
    from plinth.model.context import ForwardContext
    from plinth.platform.backend import AttentionMetadata

    meta = AttentionMetadata.from_lengths([len(PROMPT)], [len(PROMPT)], [[0]], block_size=16)
    ids, positions = torch.tensor(PROMPT), torch.arange(len(PROMPT))
    got = model.compute_logits(model(ids, positions, ForwardContext(meta, caches)))
    ref_caches = [ReferenceBackend().allocate_kv_cache(s, 8) for s in dense.attention_specs()]
    expected = dense.compute_logits(dense(ids, positions, ForwardContext(meta, ref_caches)))
    # the same rounded experts, multiplied from their blocks (6e-6 here when written; the cpu's
    # quantized GEMMs may round activations too, hence not exact)
    assert (got - expected).abs().max().item() < 1e-3


def test_f16_gguf_matrices_reach_a_gemm_that_takes_them_as_stored(tmp_path: Path) -> None:
    """An F16 GGUF's matrices come out of the reader as fp16 (``as_stored``): the reference GEMM gets
    them cast to fp32 (the logits match transformers on the fp16-rounded weights), and the cpu
    backend's native GEMM keeps them in fp16 panels with the same logits bit for bit as fp32 panels."""
    from plinth.model.context import ModelKernels
    from plinth_cpu import CpuBackend
    from plinth_cpu.native import native

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    hf = save_tiny(config, tmp_path / "hf")
    path = tmp_path / "tiny-f16.gguf"
    write_gguf(path, hf, "llama", matrix_type=np.float16)
    file = GGUFFile(path)
    assert file.tensors["blk.0.attn_q.weight"].type_name == "F16"
    assert file.tensor("blk.0.attn_q.weight", as_stored=True).dtype == torch.float16
    assert file.tensor("blk.0.attn_q.weight").dtype == torch.float32
    source = resolve_model(str(path))
    model, _ = load_model(source, reference_kernels(), torch.float32, 4, "float32")
    with torch.no_grad():  # transformers on the same fp16-rounded matrices
        for p in hf.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    logits = run_step(model, allocate_caches(model, 1), [PROMPT], [0])
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() < 1e-4
    if native() is None:
        pytest.skip("no native kernels: the 16-bit panels are theirs")
    backend = CpuBackend()
    runs = {}
    for keep in ("1", "0"):
        os.environ["PLINTH_CPU_KEEP_16BIT"] = keep
        try:
            ref = reference_kernels()  # the cpu GEMM under the reference attention and ops
            kernels = ModelKernels(gemm=backend.gemm_kernels("float32"), ops=ref.ops, attention=ref.attention)
        finally:
            os.environ.pop("PLINTH_CPU_KEEP_16BIT")
        cpu_model, _ = load_model(source, kernels, torch.float32, 4, "float32")
        proj = cpu_model.layers[0].self_attn.qkv_proj.weight
        assert (proj.format, proj.data["panels"].dtype) == (
            ("w16_panels", torch.float16) if keep == "1" else ("f32_panels", torch.float32)
        )
        runs[keep] = run_step(cpu_model, allocate_caches(cpu_model, 1), [PROMPT], [0])
    assert torch.equal(runs["1"], runs["0"])
    assert (runs["1"] - hf_logits(hf, PROMPT)).abs().max().item() < 1e-4
