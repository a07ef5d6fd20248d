"""LoRA adapters in the model: stacked adapter slots per projection, and PEFT adapter folders.

A LoRA-enabled model keeps, for each adapted projection, every resident adapter's matrices in
stacks allocated once (:class:`LoRALayer`): a step never allocates for them, and loading or
unloading an adapter is a copy into (or a zeroing of) one slot. The fused projections (q/k/v,
gate/up) hold one slice per module: each PEFT target module is a column slice of the fused output.

The per-token adapter slots reach the layers in the forward context (``ForwardContext.lora``, a
:class:`~plinth.platform.lora.LoRABatch`); a step with no adapter token has ``None`` there and the
layers skip LoRA with one branch.

:func:`read_peft_adapter` reads and checks a PEFT folder (``adapter_config.json`` +
``adapter_model.safetensors``); :func:`attach_lora` adds the slots to a loaded model;
:func:`write_adapter` / :func:`clear_slot` fill and empty a slot.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plinth.model.config import ModelConfig
from plinth.platform.lora import LoRABatch, LoRAKernels
from plinth.platform.values import LoRASpec

#: The PEFT target modules plinth adapts, by the projection (fused or not) each is a slice of.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter name on save)
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter folder plinth cannot serve; the message names the file and the field at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class LoRALayer:
    """The adapter slots of one projection, fused or not: ``slices`` names each module and its
    output width, in the order of the fused output's columns.

    ``a`` is ``[max_loras, S * rank, in]`` (module i's rows at ``i * rank``: one shrink serves every
    slice), ``b[i]`` is ``[max_loras, out_i, rank]`` with the adapter's scale folded in.
    """

    def __init__(
        self,
        op: LoRAKernels,
        in_features: int,
        slices: list[tuple[str, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        spec = op.spec
        self.op = op
        self.rank = spec.max_rank
        self.names = [name for name, _ in slices]
        self.in_features = in_features
        self.a = torch.zeros(spec.max_loras, len(slices) * spec.max_rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(spec.max_loras, n, spec.max_rank, dtype=dtype, device=device) for _, n in slices]
        bounds = [0]
        for _, n in slices:
            bounds.append(bounds[-1] + n)
        self.bounds = bounds  # module i is columns bounds[i]:bounds[i + 1] of the fused output
        #: how many resident adapters adapt each module (a module none adapts is skipped)
        self.users = [0] * len(slices)

    def apply(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """Add each token's adapter delta to the base output ``y`` [T, out] of input ``x`` [T, in]."""
        if not any(self.users):  # no resident adapter targets this projection
            return
        s = self.op.shrink(x, self.a, batch)  # [T, S * rank]
        r = self.rank
        for i, b in enumerate(self.b):
            if self.users[i]:
                self.op.expand(y[:, self.bounds[i] : self.bounds[i + 1]], s[:, i * r : (i + 1) * r], b, batch)

    def write(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one module's ``a`` [r, in] and (scaled) ``b`` [out, r] into ``slot`` (zero-padded to the rank)."""
        i = self.names.index(module)
        r = a.shape[0]
        self.a[slot, i * self.rank : i * self.rank + r].copy_(a)
        self.b[i][slot, :, :r].copy_(b)
        self.users[i] += 1

    def clear(self, slot: int, modules: set[str]) -> None:
        """Zero ``slot`` (its adapter adapted ``modules`` of this projection)."""
        self.a[slot].zero_()
        for i, b in enumerate(self.b):
            b[slot].zero_()
            if self.names[i] in modules:
                self.users[i] -= 1


class NoLoRA(LoRALayer):
    """What a projection holds while LoRA is off: never applied (a step then has no LoRA batch)."""

    def __init__(self) -> None:  # allocates nothing
        self.users = []

    def apply(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """Never called: a model without LoRA slots gets no LoRA batch."""
        raise RuntimeError("a LoRA batch reached a model without LoRA slots (EngineConfig.enable_lora is off)")


#: The one null object every projection starts with.
NO_LORA = NoLoRA()


@dataclass(slots=True)
class PeftAdapter:
    """A checked PEFT LoRA adapter, read from its folder: rank, scale and each module's matrices.

    ``weights`` maps ``(layer index, module)`` to ``(A [r, in], B [out, r])`` as stored (B unscaled).
    """

    path: str
    rank: int
    scale: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _config_field(config: dict[str, Any], name: str, where: str) -> Any:
    if name not in config:
        raise LoRAAdapterError(f"{where}: {name!r} is missing", field=name)
    return config[name]


def read_peft_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> PeftAdapter:
    """Read and check the PEFT LoRA adapter in folder ``path`` for a model of ``model_config``.

    Scale: ``lora_alpha / sqrt(r)`` with ``use_rslora``, else ``lora_alpha / r``.

    :raises LoRAAdapterError: naming the field or tensor at fault: not a folder, a missing file,
        ``peft_type`` other than LORA, ``r`` above ``max_rank``, ``fan_in_fan_out``, DoRA
        (``use_dora``), ``bias`` other than "none", ``modules_to_save``, per-module ranks or alphas
        (``rank_pattern``/``alpha_pattern``), a target module plinth does not adapt, or tensors
        that do not match the model.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} is not a folder", field="lora_path")
    config_file = folder / "adapter_config.json"
    weights_file = folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise LoRAAdapterError(f"LoRA adapter folder {str(path)!r} has no {f.name}", field="lora_path")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{config_file}: not valid JSON ({exc})", field="lora_path") from None
    where = str(config_file)
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{where}: expected a JSON object", field="lora_path")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r}: only LORA adapters are served", field="peft_type")
    rank = _config_field(config, "r", where)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive int, got {rank!r}", field="r")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"{where}: r={rank} exceeds max_lora_rank={max_rank} (start the engine with a larger max_lora_rank)",
            field="r",
        )
    alpha = _config_field(config, "lora_alpha", where)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}", field="lora_alpha")
    refused = {
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "transposed (Conv1D) weights are not supported"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (config.get("bias", "none") != "none", f"bias {config.get('bias')!r}: only 'none' is supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "fully trained extra modules are not supported"),
        "rank_pattern": (bool(config.get("rank_pattern")), "per-module ranks are not supported"),
        "alpha_pattern": (bool(config.get("alpha_pattern")), "per-module alphas are not supported"),
        "lora_bias": (bool(config.get("lora_bias")), "a bias on lora_B is not supported"),
        "target_parameters": (bool(config.get("target_parameters")), "adapted parameters are not supported"),
        "trainable_token_indices": (bool(config.get("trainable_token_indices")), "trained tokens are not supported"),
    }
    for field, (bad, why) in refused.items():
        if bad:
            raise LoRAAdapterError(f"{where}: {field}: {why}", field=field)
    targets = _config_field(config, "target_modules", where)
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
        raise LoRAAdapterError(f"{where}: target_modules must be a list of module names", field="target_modules")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise LoRAAdapterError(
            f"{where}: target_modules {unknown} are not adapted by plinth (supported: {', '.join(TARGET_MODULES)})",
            field="target_modules",
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(weights_file, model_config, rank, set(targets))
    return PeftAdapter(str(path), rank, float(scale), frozenset(targets), weights)


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """``(out, in)`` of target ``module`` in a layer of ``config``."""
    h, d = config.hidden_size, config.head_dim
    return {
        "q_proj": (config.num_heads * d, h),
        "k_proj": (config.num_kv_heads * d, h),
        "v_proj": (config.num_kv_heads * d, h),
        "o_proj": (h, config.num_heads * d),
        "gate_proj": (config.intermediate_size, h),
        "up_proj": (config.intermediate_size, h),
        "down_proj": (h, config.intermediate_size),
    }[module]


def _read_weights(
    file: Path, config: ModelConfig, rank: int, targets: set[str]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(file))
    except (OSError, SafetensorError) as exc:
        raise LoRAAdapterError(f"{file}: not a readable safetensors file ({exc})", field="lora_path") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"{file}: tensor {key!r} is not a LoRA A/B weight of a decoder layer", field=key)
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if module not in targets:
            raise LoRAAdapterError(f"{file}: tensor {key!r} adapts {module!r}, not in target_modules", field=key)
        if layer >= config.num_layers:
            raise LoRAAdapterError(f"{file}: tensor {key!r}: the model has {config.num_layers} layers", field=key)
        if config.moe is not None and module in MLP_MODULES and config.layer_is_sparse(layer):
            raise LoRAAdapterError(f"{file}: tensor {key!r}: layer {layer}'s MLP is a mixture of experts", field=key)
        out_f, in_f = module_shape(config, module)
        want = (rank, in_f) if which == "A" else (out_f, rank)
        if tuple(tensor.shape) != want:
            shape = tuple(tensor.shape)
            raise LoRAAdapterError(f"{file}: tensor {key!r} has shape {shape}, expected {want}", field=key)
        parts.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAAdapterError(f"{file}: layer {layer} {module} has no {missing} weight", field=module)
        weights[(layer, module)] = (ab["A"], ab["B"])
    if not weights:
        raise LoRAAdapterError(f"{file}: no LoRA weights", field="lora_path")
    return weights


def lora_layers(model: Any) -> Iterator[tuple[int, LoRALayer]]:
    """Every ``(layer index, LoRALayer)`` of a model :func:`attach_lora` gave slots to."""
    for i, layer in zip(model.layer_range, model.layers, strict=True):
        yield i, layer.self_attn.qkv_lora
        yield i, layer.self_attn.o_lora
        mlp = getattr(layer.mlp, "gate_up_lora", None)
        if mlp is not None:
            yield i, mlp
            yield i, layer.mlp.down_lora


def attach_lora(model: Any, op: LoRAKernels, spec: LoRASpec) -> None:
    """Give every target projection of ``model`` (a loaded :class:`LlamaForCausalLM`) its slots."""
    from plinth.model.layers import GatedMLP

    c: ModelConfig = model.config
    dtype, device = model.dtype, model.device
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    del spec  # the op carries it
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_lora = LoRALayer(op, c.hidden_size, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)], dtype, device)
        attn.o_lora = LoRALayer(op, q, [("o_proj", c.hidden_size)], dtype, device)
        if isinstance(layer.mlp, GatedMLP):  # a sparse layer's experts are not adapted
            inter = c.intermediate_size
            mlp = layer.mlp
            mlp.gate_up_lora = LoRALayer(op, c.hidden_size, [("gate_proj", inter), ("up_proj", inter)], dtype, device)
            mlp.down_lora = LoRALayer(op, inter, [("down_proj", c.hidden_size)], dtype, device)


def _holders(model: Any) -> dict[tuple[int, str], LoRALayer]:
    return {(i, name): holder for i, holder in lora_layers(model) for name in holder.names}


#: Projections whose input dim tensor parallelism splits (row-parallel): their ``A`` is sliced by
#: input columns; the others' ``B`` by output rows (as the base weights are).
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def shard_adapter_weights(plan: Any, layer: int, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """A tensor-parallel rank's slice of one module's ``A`` [r, in] and ``B`` [out, r]: a
    column-parallel module's ``B`` rows as its weight's rows (its heads, its KV heads, its slice of
    the intermediate dim), a row-parallel one's ``A`` columns as its weight's input columns (its
    delta is then a partial sum, all-reduced with the base product)."""
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    name = f"model.layers.{layer}.{block}.{module}.weight"
    if module in _ROW_PARALLEL:
        return plan.shard(name, a), b
    return a, plan.shard(name, b)


def write_adapter(model: Any, slot: int, adapter: PeftAdapter) -> None:
    """Copy ``adapter`` into ``slot`` of every projection it adapts (the slot must be clear); under
    tensor parallelism, this rank's slice of it (:func:`shard_adapter_weights`)."""
    holders = _holders(model)
    tp = getattr(model.kernels, "tp", None)
    for (layer, module), (a, b) in adapter.weights.items():
        if tp is not None:
            a, b = shard_adapter_weights(tp.plan, layer, module, a, b)
        holder = holders[(layer, module)]
        dtype = holder.a.dtype
        # the scale folded into B in fp32, then cast: B @ A * scale as PEFT's merge computes it
        holder.write(slot, module, a.to(dtype), (b.float() * adapter.scale).to(dtype))


def clear_slot(model: Any, slot: int, adapter: PeftAdapter) -> None:
    """Zero ``slot`` everywhere (it held ``adapter``)."""
    adapted: dict[int, set[str]] = {}
    for layer, module in adapter.weights:
        adapted.setdefault(layer, set()).add(module)
    for i, holder in lora_layers(model):
        holder.clear(slot, adapted.get(i, set()))
