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
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF general.architecture -> Hugging Face architecture name
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

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


@dataclass(slots=True)
class ModelConfig:
    """The shape and numerics of a decoder-only model of the Llama family.

    ``layer_types`` has one entry per layer, ``"full_attention"`` or ``"sliding_attention"``; a
    sliding layer attends to the last ``sliding_window`` positions only.
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

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = (FULL_ATTENTION,) * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} kv heads")

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
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{architecture}: unsupported activation {act!r} (only silu){_where(source)}")
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _hf_rope(cfg, source)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        sliding_window, layer_types = _hf_sliding_window(cfg, architecture, num_layers)
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an o_proj bias; Llama's flag covers all four
            attention_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            attention_out_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_id_list(cfg.get("eos_token_id")),
            torch_dtype=_CONFIG_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
        )

    # -- GGUF metadata -----------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str], source: str = ""
    ) -> ModelConfig:
        """Read llama.cpp's metadata keys (``llama.*``, ``qwen2.*``, ``tokenizer.ggml.*``).

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
        return cls(
            architecture=_GGUF_ARCHITECTURES[arch],
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
            layer_types=((SLIDING_ATTENTION if window else FULL_ATTENTION),) * num_layers,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
            torch_dtype=torch.float32,
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
    raise UnsupportedArchitecture(", ".join(names) or f"model_type={cfg.get('model_type')!r}", source)


def _hf_rope(cfg: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; 4.x rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}{_where(source)}; supported: {list(_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(scaling["factor"]))
    return theta, RopeScaling(
        "llama3",
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _hf_sliding_window(
    cfg: Mapping[str, Any], architecture: str, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    window = cfg.get("sliding_window")
    if architecture == "LlamaForCausalLM":
        window = None
    if architecture == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        # Qwen2 configs carry a sliding_window value that is off unless use_sliding_window is set
        window = None
    if not window:
        return None, (FULL_ATTENTION,) * num_layers
    if cfg.get("layer_types"):
        return int(window), tuple(cfg["layer_types"])
    if architecture == "Qwen2ForCausalLM":
        # Qwen2 slides only from layer max_window_layers on (as transformers computes layer_types)
        first = int(cfg.get("max_window_layers", 0))
        return int(window), tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    return int(window), (SLIDING_ATTENTION,) * num_layers


def _gguf_rope(metadata: Mapping[str, Any], arch: str, source: str) -> RopeScaling | None:
    rope_type = metadata.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))
    raise ValueError(f"unsupported GGUF rope scaling type {rope_type!r}{_where(source)}; supported: ['linear']")
