"""The model configuration plinth builds from: one dataclass, read from a Hugging Face config.json
or from a GGUF file's metadata.

Both sources describe the same handful of numbers under different names; everything downstream
(layers, loaders, the engine) reads only :class:`ModelConfig`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from plinth.model.registry import UnsupportedArchitecture, is_supported

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_ROPE_TYPES = ("default", "linear", "llama3")

# model_type -> architecture, for configs that do not list "architectures"
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

# GGUF general.architecture -> Hugging Face architecture name (llama.cpp writes Mixtral as "llama"
# with an expert count; that case is told apart in from_gguf_metadata)
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# architectures with q/k RMSNorm over each head before the rotary embedding
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"}
# Qwen architectures whose sliding window is off unless use_sliding_window is set
_QWEN_WINDOWED = {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
# hidden_act / hidden_activation -> the MLP activation plinth runs
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

_CONFIG_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long contexts.

    ``rope_type`` is ``"linear"`` (every inverse frequency divided by ``factor``), ``"llama3"`` (Llama
    3.1's band-wise rule, using the remaining fields) or ``"freq_factors"`` (per-frequency divisors
    as llama.cpp stores them in a GGUF's ``rope_freqs`` tensor).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A model's mixture-of-experts layers: which layers are sparse and how they route.

    ``sparse_layers`` has one entry per layer (True: an MoE block replaces the dense MLP).
    ``shared_expert_size`` > 0 adds a dense shared expert whose output is scaled by
    ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_size: int = 0


@dataclass(slots=True)
class ModelConfig:
    """The shape and numerics of a decoder-only transformer of the Llama, Qwen and Gemma 3 kinds.

    ``layer_types`` has one entry per layer, ``"full_attention"`` or ``"sliding_attention"``; a
    sliding layer attends to the last ``sliding_window`` positions only (and rotates with
    ``rope_local_theta`` where set: Gemma 3's local layers).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2, Llama with attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama with attention_bias; not Qwen2)
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype = torch.float32  # the checkpoint's dtype (float32 for dequantized GGUF)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotary (Qwen3, Gemma 3)
    #: added to every RMSNorm weight at load (Gemma's ``x * (1 + w)``; 0 for a GGUF, whose
    #: converter already added it)
    norm_weight_offset: float = 0.0
    #: Gemma 3's norms after attention and after the MLP too (four per layer)
    sandwich_norms: bool = False
    embed_scale: float | None = None  # the embedding rows are multiplied by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) (None: head_dim)
    rope_local_theta: float | None = None  # the rotary base of sliding layers (None: rope_theta)
    final_logit_softcap: float | None = None
    moe: MoEConfig | None = None
    #: the embedding sizes the model was trained to be truncated to (config.json's
    #: ``matryoshka_dimensions``); empty for a plain decoder LM, whose embeddings are not truncated
    matryoshka_dimensions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = (FULL_ATTENTION,) * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} kv heads")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError(
                f"moe.sparse_layers has {len(self.moe.sparse_layers)} entries for {self.num_layers} layers"
            )

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every attention layer."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope_theta(self, layer_idx: int) -> float:
        """The rotary base of layer ``layer_idx``."""
        if self.rope_local_theta is not None and self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.rope_local_theta
        return self.rope_theta

    def layer_is_sparse(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` has a mixture-of-experts block instead of a dense MLP."""
        return self.moe is not None and self.moe.sparse_layers[layer_idx]

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx``, or None when it attends to the whole context."""
        if self.sliding_window is None or self.layer_types[layer_idx] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    # -- Hugging Face config.json ----------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], source: str = "") -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling).

        :param source: where the dict came from, for error messages.
        :raises UnsupportedArchitecture: when no supported architecture is named.
        :raises ValueError: for a supported architecture with an unsupported feature.
        """
        architecture = _hf_architecture(cfg, source)
        _refuse_unimplemented(cfg, architecture, source)
        gemma = architecture == "Gemma3ForCausalLM"
        act_field = "hidden_activation" if gemma else "hidden_act"
        act = cfg.get(act_field) or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"{architecture}: unsupported {act_field} {act!r}{_where(source)}; supported: {sorted(_ACTIVATIONS)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling, local_theta = _hf_rope(cfg, architecture, source)
        is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        sliding_window, layer_types = _hf_sliding_window(cfg, architecture, num_layers, source)
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            # Qwen2 always has q/k/v bias and never an o_proj bias; Llama's flag covers all four
            attention_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            attention_out_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_id_list(cfg.get("eos_token_id")),
            torch_dtype=_CONFIG_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
            hidden_act=_ACTIVATIONS[act],
            qk_norm=architecture in _QK_NORM,
            norm_weight_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_scale=hidden**0.5 if gemma else None,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256) if gemma else None,
            rope_local_theta=local_theta,
            final_logit_softcap=_positive(cfg.get("final_logit_softcapping")),
            moe=_hf_moe(cfg, architecture, num_layers, source),
            matryoshka_dimensions=tuple(int(d) for d in cfg.get("matryoshka_dimensions") or ()),
        )

    # -- GGUF metadata -----------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str], source: str = ""
    ) -> ModelConfig:
        """Read llama.cpp's metadata keys (``llama.*``, ``qwen2.*``, ``qwen3.*``, ``gemma3.*``, the MoE
        architectures' ``*.expert_*``, ``tokenizer.ggml.*``).

        :param tensor_names: the file's tensor names; a missing ``output.weight`` means tied
            embeddings and ``blk.0.attn_q.bias`` means q/k/v bias, as llama.cpp writes them.
        """
        arch = str(metadata.get("general.architecture", ""))
        if arch not in _GGUF_ARCHITECTURES:
            supported = [f"{a} ({hf})" for a, hf in sorted(_GGUF_ARCHITECTURES.items())]
            raise UnsupportedArchitecture(arch, source, supported)

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}{_where(source)}")
            return value

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // num_heads)
        rotary_dim = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
        if rotary_dim != head_dim:
            raise ValueError(f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported{_where(source)}")
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab_size = metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
        if vocab_size is None:
            raise ValueError(f"GGUF metadata states no vocabulary size{_where(source)}")
        eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata]
        window = metadata.get(f"{arch}.attention.sliding_window")
        num_layers = int(key("block_count"))
        gemma = arch == "gemma3"
        architecture = _GGUF_ARCHITECTURES[arch]
        experts = int(metadata.get(f"{arch}.expert_count") or 0)
        if arch == "llama" and experts:
            architecture = "MixtralForCausalLM"  # llama.cpp writes Mixtral as llama with experts
        if gemma:
            # llama.cpp's Gemma 3 rule: every sixth layer global, local layers rotate with base 10000
            layer_types = tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(num_layers))
        else:
            layer_types = ((SLIDING_ATTENTION if window else FULL_ATTENTION),) * num_layers
        moe = None
        if experts:
            moe = MoEConfig(
                num_experts=experts,
                top_k=int(key("expert_used_count")),
                intermediate_size=int(metadata.get(f"{arch}.expert_feed_forward_length") or key("feed_forward_length")),
                # the file's expert_weights_norm where it states one; else llama.cpp's rule per
                # architecture: Mixtral and Qwen3-MoE renormalise the top-k, Qwen2-MoE not
                renormalize=bool(metadata.get(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
                sparse_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(num_layers)),
                shared_expert_size=int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            )
        return cls(
            architecture=architecture,
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope(metadata, arch, source),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
            torch_dtype=torch.float32,
            hidden_act="gelu_tanh" if gemma else "silu",
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            sandwich_norms=gemma,
            embed_scale=hidden**0.5 if gemma else None,
            # llama.cpp scales Gemma 3's queries by 1/sqrt(head_dim) (query_pre_attn_scalar of the
            # sizes up to 12B); the GGUF stores no scalar
            query_pre_attn_scalar=float(head_dim) if gemma else None,
            rope_local_theta=10000.0 if gemma else None,
            final_logit_softcap=_positive(metadata.get(f"{arch}.final_logit_softcapping")),
            moe=moe,
        )


def _where(source: str) -> str:
    return f" in {source}" if source else ""


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _hf_architecture(cfg: Mapping[str, Any], source: str) -> str:
    names = list(cfg.get("architectures") or [])
    if not names and cfg.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[cfg["model_type"]]]
    for name in names:
        if is_supported(name):
            return str(name)
    if "vision_config" in cfg:
        raise ValueError(
            f"the config names a vision tower (vision_config, architectures {names}){_where(source)}: plinth runs "
            "text models only (for Gemma 3: Gemma3ForCausalLM, the text_config's model without the vision tower)"
        )
    raise UnsupportedArchitecture(", ".join(names) or f"model_type={cfg.get('model_type')!r}", source)


def _refuse_unimplemented(cfg: Mapping[str, Any], architecture: str, source: str) -> None:
    """Config fields naming a variant plinth does not implement: an error naming the field, never wrong output."""
    problems = []
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {cfg['partial_rotary_factor']} (only 1.0: the whole head rotates)")
    if cfg.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention (plinth's attention is causal)")
    if architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        scoring = cfg.get("scoring_func", "softmax")
        if scoring != "softmax":
            problems.append(f"scoring_func {scoring!r} (only softmax routing)")
        if cfg.get("n_group") or cfg.get("topk_group"):
            problems.append("n_group/topk_group (grouped expert routing)")
    if problems:
        raise ValueError(f"{architecture}{_where(source)}: unsupported config: " + "; ".join(problems))


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _hf_rope(cfg: Mapping[str, Any], architecture: str, source: str) -> tuple[float, RopeScaling | None, float | None]:
    """``(rope_theta, scaling, local theta)``; the local theta is Gemma 3's base for sliding layers."""
    # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; 4.x rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or {})
    local_theta = None
    default_theta = 10000.0
    if architecture == "Gemma3ForCausalLM":
        # Gemma 3: one rule per layer kind ({"full_attention": {...}, "sliding_attention": {...}} in
        # transformers 5; rope_theta, rope_local_base_freq and rope_scaling for the global layers in 4.x)
        local = dict(params.get("sliding_attention") or {})
        if "full_attention" in params or "sliding_attention" in params:
            params = dict(params.get("full_attention") or {})
        local_type = local.get("rope_type") or local.get("type") or "default"
        if local_type != "default":
            raise ValueError(
                f"unsupported rope_parameters.sliding_attention.rope_type {local_type!r}{_where(source)}; "
                "supported: ['default']"
            )
        local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
        default_theta = 1000000.0
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or default_theta)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} (rope_scaling / rope_parameters rope_type){_where(source)}; "
            f"supported: {list(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None, local_theta
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(scaling["factor"])), local_theta
    return (
        theta,
        RopeScaling(
            "llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        ),
        local_theta,
    )


def _hf_sliding_window(
    cfg: Mapping[str, Any], architecture: str, num_layers: int, source: str = ""
) -> tuple[int | None, tuple[str, ...]]:
    window = cfg.get("sliding_window")
    if architecture == "LlamaForCausalLM":
        window = None
    if architecture in _QWEN_WINDOWED and not cfg.get("use_sliding_window", False):
        # Qwen configs carry a sliding_window value that is off unless use_sliding_window is set
        window = None
    if not window:
        return None, (FULL_ATTENTION,) * num_layers
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}{_where(source)}; supported: full/sliding_attention")
        return int(window), types
    if architecture == "Gemma3ForCausalLM":
        # every sliding_window_pattern-th layer is global, the others local (5 of 6 by default)
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return int(window), tuple(
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)
        )
    if architecture == "Qwen2MoeForCausalLM":
        # as transformers computes its layer_types: every other layer below max_window_layers
        last = int(cfg.get("max_window_layers", num_layers))
        return int(window), tuple(
            SLIDING_ATTENTION if (i + 1) % 2 and i < last else FULL_ATTENTION for i in range(num_layers)
        )
    if architecture in _QWEN_WINDOWED:
        # Qwen2/Qwen3 slide only from layer max_window_layers on (as transformers computes layer_types)
        first = int(cfg.get("max_window_layers", 0))
        return int(window), tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    return int(window), (SLIDING_ATTENTION,) * num_layers


def _hf_moe(cfg: Mapping[str, Any], architecture: str, num_layers: int, source: str) -> MoEConfig | None:
    if architecture == "MixtralForCausalLM":
        experts = int(cfg.get("num_local_experts") or 8)
        return MoEConfig(
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok") or 2),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=True,  # Mixtral: softmax over the chosen experts
            sparse_layers=(True,) * num_layers,
        )
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts < 1:
        raise ValueError(f"{architecture}: num_experts {experts}{_where(source)}: a mixture of experts needs experts")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok") or 1),
        intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_expert_size=shared,
    )


def _gguf_rope(metadata: Mapping[str, Any], arch: str, source: str) -> RopeScaling | None:
    rope_type = metadata.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))
    raise ValueError(f"unsupported GGUF rope scaling type {rope_type!r}{_where(source)}; supported: ['linear']")
