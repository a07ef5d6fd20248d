"""One decoder graph for every architecture of the registry; the differences are all in :class:`ModelConfig`.

- Llama 2/3 (llama3 rope scaling), Mistral (sliding window), SmolLM2 (GQA, tied embeddings);
- Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm per head before the rotary, no bias);
- Gemma 3 (text): sliding-window layers with their own rotary base between global ones, q/k norm,
  embeddings scaled by sqrt(hidden), GELU-tanh gated MLP, ``x * (1 + w)`` RMSNorm, norms before
  *and* after attention and the MLP, tied embeddings;
- mixture of experts, where ``config.moe`` makes a layer sparse: Mixtral (top-2 of 8, renormalised),
  Qwen2-MoE (a shared expert behind a sigmoid gate), Qwen3-MoE (q/k norm, ``norm_topk_prob``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from plinth.model.config import ModelConfig
from plinth.model.context import ForwardContext, ModelKernels
from plinth.model.layers import Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding, SparseMoE
from plinth.parallel.sharding import shard_grouped_rows
from plinth.platform.backend import AttentionKernels, AttentionSpec, dtype_name
from plinth.platform.devices import HOST
from plinth.platform.quant import QuantizedWeight, dequantize, dequantize_rows

# Checkpoint entries that are derived state, not weights: skipped without complaint.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|.*rotary_emb\.(cos|sin)_cached$")
# Mixtral's names for its router and experts -> the Qwen-MoE names the model reads for every MoE
_MIXTRAL_NAMES = (
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
)


def canonical_name(name: str) -> str:
    """The name the model reads a checkpoint tensor under (Mixtral's MoE names become Qwen-MoE's)."""
    if ".block_sparse_moe." in name:
        for pattern, repl in _MIXTRAL_NAMES:
            name = pattern.sub(repl, name)
    return name


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not match the model: missing, unexpected or misshapen weights."""


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``h += attn(norm(h)); h += mlp(norm(h))``.

    With ``config.sandwich_norms`` (Gemma 3) the attention and MLP outputs are normalised too
    before they join the residual stream: ``h += post_norm(attn(norm(h)))``, the same for the MLP.
    A sparse layer (``config.layer_is_sparse``) has a :class:`SparseMoE` block as its MLP.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        attn: AttentionKernels,
        kernels: ModelKernels,
        dtype: torch.dtype,
        global_idx: int | None = None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.self_attn = Attention(
            layer_idx,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.attention_bias,
            config.attention_out_bias,
            rotary,
            attn,
            kernels,
            qk_norm_eps=eps if config.qk_norm else None,
            scale=config.attention_scale,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, kernels) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, kernels) if sandwich else None
        self.mlp: GatedMLP | SparseMoE
        if config.moe is not None and config.layer_is_sparse(layer_idx if global_idx is None else global_idx):
            self.mlp = SparseMoE(config.hidden_size, config.moe, kernels, dtype, config.hidden_act)
        else:
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, config.mlp_bias, kernels, config.hidden_act
            )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on ``(hidden, residual)`` -> ``(mlp output, residual stream before it)``.

        The residual additions are fused into the next norm (``add_rms_norm``): layer i returns
        its MLP output unadded and layer i + 1 (or the final norm) adds it. The first layer gets
        ``residual=None``: its input is the residual stream itself.
        """
        if residual is None:
            residual = hidden
            normed = self.input_layernorm.forward(hidden)
        else:
            normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn.forward(positions, normed, ctx)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            attn = self.post_attention_layernorm.forward(attn)
            normed, residual = self.pre_feedforward_layernorm.add_forward(attn, residual)
            return self.post_feedforward_layernorm.forward(self.mlp.forward(normed, ctx.lora)), residual
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp.forward(normed, ctx.lora), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over flattened varlen batches and a paged KV cache.

    :param config: the model's shape.
    :param kernels: the backend's GEMM, small ops and attention factory.
    :param dtype: activation and weight dtype.
    :param block_size: KV-cache block size (goes into every layer's :class:`AttentionSpec`).
    :param kv_cache_dtype: KV-cache dtype name ("float32", ...).
    """

    def __init__(
        self,
        config: ModelConfig,
        kernels: ModelKernels,
        dtype: torch.dtype,
        block_size: int,
        kv_cache_dtype: str,
    ) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.dtype = dtype
        self.device = kernels.device
        #: the layers this process holds (a pipeline stage's range; all of them otherwise), by global
        #: index: their checkpoint names; the KV caches are indexed locally, 0..len-1
        self.layer_range = kernels.pp.layers if kernels.pp is not None else range(config.num_layers)
        self.first_stage = kernels.pp is None or kernels.pp.first
        self.last_stage = kernels.pp is None or kernels.pp.last
        self._specs = [
            AttentionSpec(
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_size=config.head_dim,
                block_size=block_size,
                dtype=dtype_name(dtype),
                kv_cache_dtype=kv_cache_dtype,
                sliding_window=config.layer_sliding_window(i),
            )
            for i in self.layer_range
        ]
        attn_by_spec: dict[AttentionSpec, AttentionKernels] = {}
        for spec in self._specs:
            if spec not in attn_by_spec:  # asked once per distinct spec: may raise NotSupported
                attn_by_spec[spec] = kernels.attention(spec)
        rotaries: dict[float, RotaryEmbedding] = {}  # by base: Gemma 3's local layers have their own
        for i in self.layer_range:
            theta = config.layer_rope_theta(i)
            if theta not in rotaries:
                # the rope scaling rule is the global layers' (Gemma 3 scales those only)
                scaling = config.rope_scaling if theta == config.rope_theta else None
                rotaries[theta] = RotaryEmbedding(
                    config.head_dim, config.max_position_embeddings, theta, scaling, kernels
                )
        # [V, hidden]; a quantized checkpoint's embedding stays in its blocks (rows dequantized on lookup)
        self.embed_tokens: torch.Tensor | QuantizedWeight | None = None
        self.embed_scale = (
            torch.tensor(config.embed_scale, dtype=dtype) if config.embed_scale is not None else None
        )  # the model dtype's rounding of sqrt(hidden), as transformers multiplies
        self.layers = nn.ModuleList(  # the cache index is the local one
            DecoderLayer(config, local, rotaries[config.layer_rope_theta(i)], attn_by_spec[spec], kernels, dtype, i)
            for local, (i, spec) in enumerate(zip(self.layer_range, self._specs, strict=True))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, kernels)

    def attention_specs(self) -> list[AttentionSpec]:
        """One :class:`AttentionSpec` per layer, for the engine to allocate KV caches."""
        return list(self._specs)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids`` [T] at ``positions`` [T] -> final-norm hidden states [T, hidden].

        Writes the step's K/V into ``ctx.kv_caches`` at ``ctx.attn.slot_mapping``.
        """
        return self.forward_embedded(self.embed(input_ids), positions, ctx)

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The embedding rows of ``input_ids`` [T] -> [T, hidden] (into ``out`` when given), times
        ``config.embed_scale`` where the architecture scales them."""
        rows = self._embed_rows(input_ids, out)
        if self.embed_scale is not None:
            rows.mul_(self.embed_scale)
        return rows

    def _embed_rows(self, input_ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        table = self.embed_tokens
        assert table is not None, "forward before load_weights"
        tp = self.kernels.tp
        if tp is not None:  # vocab-parallel: this rank's rows, zeros for the others', summed over ranks
            local = input_ids - tp.plan.vocab_start
            mine = (local >= 0) & (local < tp.plan.vocab_shard)
            local = torch.where(mine, local, torch.zeros_like(local))
            if isinstance(table, QuantizedWeight):
                rows = dequantize_rows(table, local.to(HOST)).to(device=self.device, dtype=self.dtype)
            else:
                rows = table.index_select(0, local)
            rows = tp.comm.all_reduce(rows * mine[:, None].to(rows.dtype))
            return rows if out is None else out.copy_(rows)
        if isinstance(table, QuantizedWeight):  # a few rows' blocks, not the whole table, dequantized
            rows = dequantize_rows(table, input_ids.to(HOST))
            if out is not None:  # copy_ casts and moves
                return out.copy_(rows)
            return rows.to(device=self.device, dtype=self.dtype)
        if out is None:
            return table.index_select(0, input_ids)
        return torch.index_select(table, 0, input_ids, out=out)

    @torch.inference_mode()
    def forward_embedded(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """:meth:`forward` from embedded inputs ``hidden`` [T, hidden], which it may overwrite."""
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            hidden, residual = layer.forward(positions, hidden, residual, ctx)
        if residual is None:  # a model with no layers
            return self.norm.forward(hidden)
        return self.norm.add_forward(hidden, residual)[0]

    @torch.inference_mode()
    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        received: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pipeline stage's part of :meth:`forward`.

        The first stage embeds ``input_ids``; a later one starts from ``received``, the previous
        stage's ``[T, 2 * hidden]`` (hidden state and residual stream, concatenated). The last stage
        returns the final-norm hidden states ``[T, hidden]``; the others ``[T, 2 * hidden]`` to send on.
        """
        residual: torch.Tensor | None
        if received is None:
            hidden, residual = self.embed(input_ids), None
        else:
            hidden, residual = received.chunk(2, dim=-1)
            hidden, residual = hidden.contiguous(), residual.contiguous()
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            hidden, residual = layer.forward(positions, hidden, residual, ctx)
        if self.last_stage:
            if residual is None:
                return self.norm.forward(hidden)
            return self.norm.add_forward(hidden, residual)[0]
        assert residual is not None, "a pipeline stage holds at least one layer"
        return torch.cat([hidden, residual], dim=-1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [S, hidden] (the rows that sample) -> logits [S, vocab]."""
        logits = self.lm_head.forward(hidden)
        tp = self.kernels.tp
        if tp is not None:  # vocab-parallel: every rank's slice, in rank order, less the padding rows
            logits = tp.comm.all_gather(logits, dim=-1)[:, : tp.plan.vocab_size]
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma's final soft-cap: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- weights -----------------------------------------------------------------------------------

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face parameter name -> shape, for every weight :meth:`load_weights` needs."""
        c = self.config
        h, d = c.hidden_size, c.head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        if self.first_stage or (self.last_stage and c.tie_word_embeddings):
            shapes["model.embed_tokens.weight"] = (c.vocab_size, h)
        if self.last_stage:
            shapes["model.norm.weight"] = (h,)
            if not c.tie_word_embeddings:
                shapes["lm_head.weight"] = (c.vocab_size, h)
        proj = {
            "self_attn.q_proj": (c.num_heads * d, h, c.attention_bias),
            "self_attn.k_proj": (c.num_kv_heads * d, h, c.attention_bias),
            "self_attn.v_proj": (c.num_kv_heads * d, h, c.attention_bias),
            "self_attn.o_proj": (h, c.num_heads * d, c.attention_out_bias),
        }
        dense_mlp = {
            "mlp.gate_proj": (c.intermediate_size, h, c.mlp_bias),
            "mlp.up_proj": (c.intermediate_size, h, c.mlp_bias),
            "mlp.down_proj": (h, c.intermediate_size, c.mlp_bias),
        }
        norms = ["input_layernorm", "post_attention_layernorm"]
        if c.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for i in self.layer_range:
            p = f"model.layers.{i}."
            for norm in norms:
                shapes[p + norm + ".weight"] = (h,)
            if c.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            layer_proj = dict(proj)
            if c.moe is not None and c.layer_is_sparse(i):
                m = c.moe
                layer_proj["mlp.gate"] = (m.num_experts, h, False)
                for e in range(m.num_experts):
                    layer_proj[f"mlp.experts.{e}.gate_proj"] = (m.intermediate_size, h, False)
                    layer_proj[f"mlp.experts.{e}.up_proj"] = (m.intermediate_size, h, False)
                    layer_proj[f"mlp.experts.{e}.down_proj"] = (h, m.intermediate_size, False)
                if m.shared_expert_size:
                    s = m.shared_expert_size
                    layer_proj["mlp.shared_expert.gate_proj"] = (s, h, False)
                    layer_proj["mlp.shared_expert.up_proj"] = (s, h, False)
                    layer_proj["mlp.shared_expert.down_proj"] = (h, s, False)
                    layer_proj["mlp.shared_expert_gate"] = (1, h, False)
            else:
                layer_proj.update(dense_mlp)
            for name, (n_out, n_in, bias) in layer_proj.items():
                shapes[f"{p}{name}.weight"] = (n_out, n_in)
                if bias:
                    shapes[f"{p}{name}.bias"] = (n_out,)
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Load Hugging Face-named tensors, fuse q/k/v and gate/up, and prepare every Linear.

        Linear weights may come as :class:`QuantizedWeight` (a GGUF's blocks); everything else
        (embedding, norms, biases) is dequantized if it comes quantized.

        :raises WeightLoadError: naming every missing, unexpected or misshapen weight.
        """
        expected = self.expected_weights()
        tied = self.config.tie_word_embeddings
        loaded: dict[str, torch.Tensor | QuantizedWeight] = {}
        unexpected: list[str] = []
        misshapen: list[str] = []
        seen_misshapen: set[str] = set()
        for name, tensor in weights:
            name = canonical_name(name)
            if _IGNORED.match(name) or (tied and name == "lm_head.weight"):
                continue  # a tied checkpoint may still store the (identical) lm_head
            shape = expected.get(name)
            if shape is None:
                unexpected.append(name)
            elif tuple(tensor.shape) != shape:
                misshapen.append(f"{name}: {tuple(tensor.shape)} (expected {shape})")
                seen_misshapen.add(name)
            else:
                loaded[name] = tensor
        missing = [n for n in expected if n not in loaded and n not in seen_misshapen]
        if missing or unexpected or misshapen:
            problems = []
            for label, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("wrong shape", misshapen),
            ):
                if names:
                    more = f" (+{len(names) - 8} more)" if len(names) > 8 else ""
                    problems.append(f"{len(names)} {label}: {', '.join(names[:8])}{more}")
            raise WeightLoadError(
                f"checkpoint does not match {self.config.architecture} "
                f"({self.config.num_layers} layers): " + "; ".join(problems)
            )
        self._assign(loaded)

    def _assign(self, w: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        """Move checked tensors into the layers, consuming ``w`` as it goes to bound peak memory."""

        def dense(t: torch.Tensor | QuantizedWeight) -> torch.Tensor:
            t = dequantize(t) if isinstance(t, QuantizedWeight) else t
            return t.to(device=self.device, dtype=self.dtype)

        def take(name: str) -> torch.Tensor:
            return dense(w.pop(name))

        offset = self.config.norm_weight_offset

        def take_norm(name: str) -> torch.Tensor:  # Gemma's (1 + w), added in fp32 before the cast
            t = w.pop(name)
            t = dequantize(t) if isinstance(t, QuantizedWeight) else t
            return (t.float() + offset).to(device=self.device, dtype=self.dtype) if offset else dense(t)

        stored: frozenset[torch.dtype] = getattr(self.kernels.gemm, "stored_dtypes", frozenset())  # plugin API 1.14

        def linear_dense(t: torch.Tensor | QuantizedWeight) -> torch.Tensor:  # a GEMM's weight: maybe as stored
            if isinstance(t, torch.Tensor) and t.dtype in stored:
                return t.to(device=self.device)
            return dense(t)

        def take_linear(name: str) -> torch.Tensor | QuantizedWeight:
            t = w.pop(name)
            return t if isinstance(t, QuantizedWeight) else linear_dense(t)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in w else None

        groups = self.kernels.shard_groups

        def fused(names: list[str], grouped: bool = False) -> torch.Tensor | QuantizedWeight:
            parts = [w.pop(n) for n in names]
            order = shard_grouped_rows([p.shape[0] for p in parts], groups) if grouped else None
            if all(isinstance(p, QuantizedWeight) for p in parts):
                quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
                if len({p.format for p in quantized}) == 1:
                    cat = QuantizedWeight.cat(quantized)
                    return cat if order is None else cat.rows(order)
            tensors = [p for p in parts if isinstance(p, torch.Tensor)]
            if len(tensors) == len(parts) and len({t.dtype for t in tensors}) == 1:  # one dtype: maybe as stored
                dense_cat = torch.cat([linear_dense(t) for t in tensors], dim=0)
            else:  # mixed formats: fuse dense
                dense_cat = torch.cat([dense(p) for p in parts], dim=0)
            return dense_cat if order is None else dense_cat[order]

        def fused_bias(names: list[str], grouped: bool = False) -> torch.Tensor | None:
            if names[0] not in w:
                return None
            parts = [take(n) for n in names]
            cat = torch.cat(parts, dim=0)
            order = shard_grouped_rows([p.shape[0] for p in parts], groups) if grouped else None
            return cat if order is None else cat[order]

        raw_embed = w.pop("model.embed_tokens.weight", None)  # None: a middle pipeline stage
        # Kept in its blocks: dequantizing a 49k x 576 table took 0.15 s of start-up and 113 MB
        # for lookups of a few rows per step.
        embed = raw_embed if isinstance(raw_embed, QuantizedWeight) or raw_embed is None else dense(raw_embed)
        if self.first_stage:
            self.embed_tokens = embed
        for i, layer in zip(self.layer_range, self.layers, strict=True):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = [a + "q_proj", a + "k_proj", a + "v_proj"]
            layer.self_attn.qkv_proj.load(
                fused([n + ".weight" for n in qkv], True), fused_bias([n + ".bias" for n in qkv], True)
            )
            layer.self_attn.o_proj.load(take_linear(a + "o_proj.weight"), maybe(a + "o_proj.bias"))
            attn = layer.self_attn
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.q_norm.load(take_norm(a + "q_norm.weight"))
                attn.k_norm.load(take_norm(a + "k_norm.weight"))
            m = p + "mlp."
            if isinstance(layer.mlp, SparseMoE):
                self._assign_moe(layer.mlp, m, w, take_linear, fused)
            else:
                gate_up = [m + "gate_proj", m + "up_proj"]
                layer.mlp.gate_up_proj.load(
                    fused([n + ".weight" for n in gate_up], True), fused_bias([n + ".bias" for n in gate_up], True)
                )
                layer.mlp.down_proj.load(take_linear(m + "down_proj.weight"), maybe(m + "down_proj.bias"))
            layer.input_layernorm.load(take_norm(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.load(take_norm(p + "post_attention_layernorm.weight"))
            if layer.pre_feedforward_layernorm is not None and layer.post_feedforward_layernorm is not None:
                layer.pre_feedforward_layernorm.load(take_norm(p + "pre_feedforward_layernorm.weight"))
                layer.post_feedforward_layernorm.load(take_norm(p + "post_feedforward_layernorm.weight"))
        if self.last_stage:
            self.norm.load(take_norm("model.norm.weight"))
            # tied: the embedding matrix is the lm_head weight, prepared through the GEMM like any other
            # (a quantized embedding keeps its blocks for the lm_head, where the GEMM takes them)
            if self.config.tie_word_embeddings:
                tied = raw_embed if isinstance(raw_embed, QuantizedWeight) else embed
                assert tied is not None and raw_embed is not None, "a tied model's last stage loads the embedding"
                keep = isinstance(raw_embed, torch.Tensor) and raw_embed.dtype in stored
                self.lm_head.load(linear_dense(raw_embed) if keep else tied)
            else:
                self.lm_head.load(take_linear("lm_head.weight"))
        assert not w, f"weights left unassigned: {sorted(w)}"

    def _assign_moe(
        self,
        block: SparseMoE,
        m: str,
        w: dict[str, torch.Tensor | QuantizedWeight],
        take_linear: Callable[[str], torch.Tensor | QuantizedWeight],
        fused: Callable[[list[str]], torch.Tensor | QuantizedWeight],
    ) -> None:
        """One sparse layer's router, experts (to the fused-MoE op) and shared expert, from ``w``."""
        block.gate.load(take_linear(m + "gate.weight"))
        experts = range(block.config.num_experts)
        gates = [w.pop(f"{m}experts.{e}.gate_proj.weight") for e in experts]
        ups = [w.pop(f"{m}experts.{e}.up_proj.weight") for e in experts]
        downs = [w.pop(f"{m}experts.{e}.down_proj.weight") for e in experts]
        block.load_experts(gates, ups, downs)
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            s = m + "shared_expert."
            block.shared_expert.gate_up_proj.load(fused([s + "gate_proj.weight", s + "up_proj.weight"]))
            block.shared_expert.down_proj.load(take_linear(s + "down_proj.weight"))
            block.shared_expert_gate.load(take_linear(m + "shared_expert_gate.weight"))
