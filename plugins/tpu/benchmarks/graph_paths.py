"""How plinth's torch model graph runs on JAX/XLA: eager torch, torchax (jax.jit) or torch-xla (PJRT).

Issue 18 asks the TPU backend to run the core's own torch graph (``LlamaForCausalLM.forward`` +
``compute_logits`` over a flattened varlen batch and a paged KV cache) on the device, through
**torchax** (torch tensors backed by JAX arrays) or **torch-xla** (lazy tensors on a PJRT device).
This script measures both on the host CPU against eager torch, for fixed shapes:

- ``decode1``: one sequence, one new token, a 100-token context;
- ``decode8``: eight sequences, one new token each, contexts of 1-127 tokens;
- ``prefill64``: one sequence, 64 new tokens after a 0-48 token cached prefix.

Per path and shape it reports the first call (trace + compile + run), the steady-state step
(median of ``--steps`` calls, host inputs in, host logits out), the compilations over
``--value-steps`` calls with the same shapes and different values (token ids, positions, context
lengths, block tables), the max abs difference of the logits from eager torch with the reference
kernels, and whether the step's K/V write is visible in the cache afterwards.

The model is tiny and random (plinth_conformance.tiny_models: GQA 4/2 heads, head size 64, 2
layers), built by plinth's loader with the reference backend's GEMM and small ops. Attention is
either the reference backend's (``--attention reference``: host loops over sequences, ``.tolist()``
of the metadata) or :class:`StaticAttention` below (``--attention static``, the default): the same
math on fixed shapes with every index computed on the device, the form a traced graph needs.

Each path runs in its own environment (torch-xla pins its own torch)::

    python plugins/tpu/benchmarks/graph_paths.py --path eager
    /work/venvs/torchax/bin/python plugins/tpu/benchmarks/graph_paths.py --path torchax --no-inference-mode
    PJRT_DEVICE=CPU /work/venvs/torch-xla/bin/python plugins/tpu/benchmarks/graph_paths.py \
        --path torch-xla --no-inference-mode        # or --path torch-xla-dynamo

(both JAX/XLA paths fail under the model's own ``@torch.inference_mode()``: see graph_paths.md,
which holds the measured results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from plinth.model.context import ForwardContext, ModelKernels
from plinth.model.loader import load_model, resolve_model
from plinth.platform.backend import AttentionKernels, AttentionMetadata, LinearWeight, SmallOps
from plinth.platform.reference import ReferenceBackend
from plinth_conformance.certificate import cpu_model
from plinth_conformance.tiny_models import save_tiny_model

BLOCK_SIZE = 16
MAX_BLOCKS = 8  # per sequence: a 128-token context
MAX_SEQS = 8
NUM_BLOCKS = 1 + MAX_SEQS * MAX_BLOCKS  # block 0 is the null block padding tokens write into
PATHS = ("eager", "torchax", "torch-xla", "torch-xla-dynamo")
SHAPES = ("decode1", "decode8", "prefill64")


# -- a traceable attention ---------------------------------------------------------------------


class StaticAttention(AttentionKernels):
    """The reference attention's math on fixed shapes, every index computed from tensors.

    No ``.tolist()``, no host loop, no data-dependent shape: a tracer (jax.jit, XLA's lazy graph)
    sees the same ops for any values of the metadata. Each token gathers its sequence's whole
    block table (``[T, max_blocks * block_size]`` keys) and masks what it may not see; a padding
    token (slot -1) writes into the null block 0 and its output is zeroed.
    """

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # kv_cache: [2, num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D]
        block_size = kv_cache.shape[2]
        slots = slot_mapping.clamp(min=0)  # padding (-1) -> slot 0 of the null block
        blocks, offsets = slots // block_size, slots % block_size
        kv = torch.zeros_like(slots)
        # index_put_ on the cache itself, not on a view of it: a functionalising tracer (torchax)
        # then rebinds the cache tensor to the updated array
        kv_cache.index_put_((kv, blocks, offsets), key.to(kv_cache.dtype))
        kv_cache.index_put_((kv + 1, blocks, offsets), value.to(kv_cache.dtype))

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_tokens, num_heads, head_size = query.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        qsl = meta.query_start_loc.long()  # [B+1]
        token = torch.arange(num_tokens, device=query.device)  # [T]
        # sequence of each token: how many sequence ends lie at or before it
        seq = (token[:, None] >= qsl[None, 1:]).sum(-1)  # [T]
        valid = seq < meta.seq_lens.shape[0]
        seq = seq.clamp(max=meta.seq_lens.shape[0] - 1)
        start, end = qsl[seq], qsl[seq + 1]
        pos = meta.seq_lens.long()[seq] - (end - start) + (token - start)  # [T] position of the token
        pos = torch.where(valid, pos, torch.zeros_like(pos))
        blocks = meta.block_tables.long()[seq]  # [T, MB]
        width = blocks.shape[1] * block_size
        # one indexing op, not kv_cache[0][blocks]: torchax 0.0.13 makes kv_cache[0] a lazy View,
        # and a View indexed by a tensor raises AttributeError ('View' object has no attribute '_elem')
        k = kv_cache[0, blocks].reshape(num_tokens, width, num_kv_heads, head_size).float()  # [T, S, Hkv, D]
        v = kv_cache[1, blocks].reshape(num_tokens, width, num_kv_heads, head_size).float()
        q = query.float().reshape(num_tokens, num_kv_heads, group, head_size)  # [T, Hkv, G, D]
        scores = torch.einsum("tkgd,tskd->tkgs", q, k) * scale  # [T, Hkv, G, S]
        if self.spec.logits_soft_cap is not None:
            cap = self.spec.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)
        k_pos = torch.arange(width, device=query.device)[None, :]  # [1, S]
        allowed = k_pos <= pos[:, None]  # [T, S]
        if self.spec.sliding_window is not None:
            allowed = allowed & (pos[:, None] - k_pos < self.spec.sliding_window)
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("tkgs,tskd->tkgd", probs, v).reshape(num_tokens, num_heads, head_size)
        out = out * valid[:, None, None].to(out.dtype)
        return out.to(query.dtype)


# -- a Pallas kernel inside the torch graph ----------------------------------------------------


def silu_and_mul_pallas(x: Any) -> Any:
    """``silu(x[:, :I]) * x[:, I:]`` as a Pallas kernel (interpreted: this runs on JAX CPU).

    A stand-in for the backend's ragged paged attention: it shows how each path reaches a JAX
    kernel from the middle of the torch graph, and what that costs in compilations.
    """
    import jax
    from jax.experimental import pallas as pl

    half = x.shape[-1] // 2

    def kernel(x_ref: Any, o_ref: Any) -> None:
        gate, up = x_ref[:, :half], x_ref[:, half:]
        o_ref[...] = gate * jax.nn.sigmoid(gate) * up

    out = jax.ShapeDtypeStruct((x.shape[0], half), x.dtype)
    return pl.pallas_call(kernel, out_shape=out, interpret=True)(x)


class PallasOps(SmallOps):
    """The reference small ops with ``silu_and_mul`` run by :func:`silu_and_mul_pallas` through ``bridge``."""

    def __init__(self, bridge: Callable[..., torch.Tensor]) -> None:
        self.bridge = bridge
        self.calls = 0  # Python-level calls: once per layer per trace (jit) or per step (lazy)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.bridge(silu_and_mul_pallas, x)


# -- the model and its state as explicit arguments ---------------------------------------------


def build_model(folder: Path, attention: str, ops: SmallOps | None = None) -> Any:
    """The tiny Llama from ``folder`` on the reference GEMM, ``ops`` (default the reference small
    ops) and ``attention`` kernels."""
    backend = ReferenceBackend()

    def attention_kernels(spec: Any) -> AttentionKernels:
        if attention == "reference":
            return backend.attention_kernels(spec)
        return StaticAttention(spec, backend.capabilities().kv_cache_layout)

    kernels = ModelKernels(
        gemm=backend.gemm_kernels("float32"), ops=ops or backend.small_ops(), attention=attention_kernels
    )
    model, _ = load_model(resolve_model(str(folder)), kernels, torch.float32, BLOCK_SIZE, "float32")
    return model


def strip_inference_mode(model: Any) -> None:
    """Run ``model``'s forward, forward_embedded and compute_logits without ``@torch.inference_mode()``.

    Under inference mode every tensor torchax makes is an inference tensor, and its first view op
    (``weight.t()`` in the reference GEMM) raises "Cannot set version_counter for inference tensor".
    The caller then runs the step under ``torch.no_grad()`` instead.
    """
    for name in ("forward", "forward_embedded", "compute_logits"):
        undecorated = getattr(type(model), name).__wrapped__
        setattr(model, name, undecorated.__get__(model))


def _state_slots(model: torch.nn.Module) -> Iterator[tuple[str, Any, str]]:
    """``(name, owner, attribute)`` of every tensor the forward reads from the model.

    plinth keeps weights as plain attributes and :class:`LinearWeight` objects, not
    ``nn.Parameter``: ``named_parameters`` (what ``torchax.extract_jax`` walks) sees none of them.
    """
    seen: set[tuple[int, str]] = set()
    for mod_name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            owner, name = mod, f"{mod_name}.{attr}".lstrip(".")
            slots: list[tuple[str, Any, str]] = []
            if isinstance(value, torch.Tensor):
                slots.append((name, owner, attr))
            elif isinstance(value, LinearWeight):
                slots += [(f"{name}.{f}", value, f) for f in ("weight", "bias") if getattr(value, f) is not None]
            for slot in slots:
                key = (id(getattr(slot[1], slot[2])), "")  # a shared table (rotary cos_sin) once
                if key not in seen:
                    seen.add(key)
                    yield slot


class ModelState:
    """The model's tensors as a dict, swappable for traced ones (a functional call without nn.Parameter)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.slots = list(_state_slots(model))
        # a tensor shared by several owners (the rotary table) is listed once; swap every owner
        self._owners: dict[str, list[tuple[Any, str]]] = {}
        by_id = {id(getattr(o, a)): n for n, o, a in self.slots}
        for _mod_name, mod in model.named_modules():
            for attr, value in vars(mod).items():
                pairs = [(mod, attr, value)] if isinstance(value, torch.Tensor) else []
                if isinstance(value, LinearWeight):
                    pairs = [(value, f, getattr(value, f)) for f in ("weight", "bias") if getattr(value, f) is not None]
                for owner, a, t in pairs:
                    self._owners.setdefault(by_id[id(t)], []).append((owner, a))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> the model's current tensor."""
        return {n: getattr(o, a) for n, o, a in self.slots}

    def assign(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point every owner at ``tensors`` (same names as :meth:`tensors`)."""
        for name, owners in self._owners.items():
            for owner, attr in owners:
                setattr(owner, attr, tensors[name])


# -- the steps ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Step:
    """One step's host inputs: a varlen batch of fixed shapes."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, MAX_BLOCKS] int32
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    seq_lens_host: list[int]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor inputs by name (what crosses to the device each step)."""
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "block_tables": self.block_tables,
            "slot_mapping": self.slot_mapping,
        }


def make_step(shape: str, gen: torch.Generator, vocab: int) -> Step:
    """Random values for the fixed ``shape``: token ids, context lengths, block tables."""
    if shape.startswith("decode"):
        batch = int(shape.removeprefix("decode"))
        query_lens = [1] * batch
        seq_lens = torch.randint(1, MAX_BLOCKS * BLOCK_SIZE, (batch,), generator=gen).tolist()
        if batch == 1:
            seq_lens = [100]  # a fixed context for batch 1, so its times compare across runs
    elif shape == "prefill64":
        query_lens = [64]
        seq_lens = [64 + int(torch.randint(0, 49, (1,), generator=gen))]
    else:
        raise ValueError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()  # never the null block
    tables = [free[i * MAX_BLOCKS : (i + 1) * MAX_BLOCKS] for i in range(len(query_lens))]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, block_tables, block_size=BLOCK_SIZE)
    positions = torch.tensor([p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)])
    return Step(
        input_ids=torch.randint(3, vocab, (sum(query_lens),), generator=gen),
        positions=positions,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        slot_mapping=meta.slot_mapping,
        query_lens=query_lens,
        seq_lens_host=seq_lens,
    )


def forward_fn(model: Any, state: ModelState, host: list[Step], bucket_host: bool) -> Callable[..., Any]:
    """``(weights, kv_caches, inputs) -> (logits, kv_caches)``: the forward as a function of its state.

    The metadata's host fields (query and sequence lengths as Python ints) come from ``host[0]``,
    which the caller sets before each call: an eager or lazy path reads each step's own, a traced
    path reads them once, at trace time, as constants of its graph. With ``bucket_host`` the
    sequence lengths are the bucket's capacity instead (what a static-shape runner passes: a
    tracer that guards on Python ints, dynamo, would otherwise retrace for every new length);
    StaticAttention never reads them, the reference attention needs the step's own.
    """

    def fn(
        weights: dict[str, torch.Tensor], kv_caches: list[torch.Tensor], inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        held = state.tensors()
        state.assign(weights)
        try:
            return _forward(inputs, kv_caches)
        finally:  # never leave the model holding a trace's tracers
            state.assign(held)

    def _forward(
        inputs: dict[str, torch.Tensor], kv_caches: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        step = host[0]
        seq_lens_host = [MAX_BLOCKS * BLOCK_SIZE] * len(step.query_lens) if bucket_host else step.seq_lens_host
        meta = AttentionMetadata(
            query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            slot_mapping=inputs["slot_mapping"],
            max_query_len=max(step.query_lens),
            max_seq_len=max(seq_lens_host),
            query_lens_host=list(step.query_lens),
            seq_lens_host=list(seq_lens_host),
        )
        caches = list(kv_caches)
        with torch.no_grad():  # a no-op where the model's own @torch.inference_mode() is kept
            hidden = model.forward(inputs["input_ids"], inputs["positions"], ForwardContext(meta, caches))
            # caches: the same tensor objects, written in place (rebound to new arrays under torchax)
            return model.compute_logits(hidden), caches

    return fn


def initial_caches(model: Any, seed: int) -> list[torch.Tensor]:
    """Random KV caches (earlier tokens' K/V), one per layer: the same for every path."""
    gen = torch.Generator().manual_seed(seed)
    backend = ReferenceBackend()
    return [
        torch.randn(backend.allocate_kv_cache(spec, NUM_BLOCKS).shape, generator=gen)
        for spec in model.attention_specs()
    ]


def eager_oracle(model_ref: Any, caches: list[torch.Tensor], step: Step) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Eager torch with the reference kernels: logits [T, V] and the caches after the step."""
    caches = [c.clone() for c in caches]
    meta = AttentionMetadata.from_lengths(
        step.query_lens, step.seq_lens_host, step.block_tables, slot_mapping=step.slot_mapping
    )
    hidden = model_ref.forward(step.input_ids, step.positions, ForwardContext(meta, caches))
    return model_ref.compute_logits(hidden), caches


# -- one path per environment -------------------------------------------------------------------


class Runner:
    """A path: puts state on its device, runs the step function, counts compilations."""

    name = "eager"

    def prepare(self, fn: Callable[..., Any], weights: dict[str, torch.Tensor]) -> None:
        """Hold ``fn`` and ``weights`` (on the device)."""
        self.fn, self.weights = fn, weights

    def to_device(self, t: torch.Tensor) -> Any:
        """A host tensor on the path's device."""
        return t

    def run(self, caches: list[Any], step: Step) -> tuple[torch.Tensor, list[Any]]:
        """One step: host inputs in, host logits out; returns the (possibly new) device caches."""
        logits, caches = self.fn(self.weights, caches, step.tensors())
        return logits, caches

    def to_host(self, t: Any) -> torch.Tensor:
        """A device tensor back on the host."""
        return t

    def compiles(self) -> int:
        """Compilations so far (0 for eager)."""
        return 0

    def call_jax(self, fn: Callable[..., Any], *args: torch.Tensor) -> torch.Tensor:
        """``fn`` (a JAX function) on this path's tensors, from inside the torch graph."""
        raise NotImplementedError(f"the {self.name} path has no JAX bridge: --pallas-op needs torchax or torch-xla")

    def notes(self) -> list[str]:
        """What this path needed, in words."""
        return ["eager torch on the host: no compilation; the cache is written in place"]


class _RemovedOverload:
    """Stands for an aten overload this torch no longer has, so a module naming it can import."""

    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<removed overload {self._name}>"


def _shim_removed_overloads(package: str) -> list[str]:
    """Give ``torch.ops.aten`` a placeholder for every overload ``package`` names that torch lacks.

    torchax 0.0.13 (the newest) names the named-tensor (Dimname) overloads at import time
    (``torch.ops.aten.prod.dim_Dimname`` in amp.py, ~20 more in decompositions.py); torch 2.13
    removed them, so ``import torchax`` raises AttributeError. No tensor of ours has names, so no
    traced call can reach them: a distinct placeholder per name (never a real overload, which could
    shadow that overload's real entry in torchax's tables) lets the module import. Returns what it shimmed.
    """
    import importlib.util
    import re

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{package} is not installed in {sys.prefix}")
    shimmed = []
    for root in spec.submodule_search_locations:
        for source in Path(root).rglob("*.py"):
            for op, overload in re.findall(r"torch\.ops\.aten\.(\w+)\.(\w+)", source.read_text()):
                packet = getattr(torch.ops.aten, op, None)
                if packet is None or overload in ("default", "overloads"):
                    continue
                try:
                    getattr(packet, overload)
                except AttributeError:
                    setattr(packet, overload, _RemovedOverload(f"aten::{op}.{overload}"))
                    shimmed.append(f"{op}.{overload}")
    return sorted(set(shimmed))


class TorchaxRunner(Runner):
    """torchax: the step traced once per shape by ``torchax.interop.jax_jit`` (jax.jit underneath).

    A JAX array is immutable: the in-place ``index_put_`` of the KV write rebinds the torchax
    tensor inside the trace, so the caches must leave the function as outputs (explicit state) and
    the caller keeps the returned ones; ``donate_argnums`` lets XLA reuse the old cache buffers.
    """

    name = "torchax"

    def __init__(self) -> None:
        import jax

        self.shimmed = _shim_removed_overloads("torchax")
        import torchax
        import torchax.interop

        self.jax, self.torchax, self.interop = jax, torchax, torchax.interop
        self.env = torchax.default_env()
        self._compiles = 0

        def on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self._compiles += 1

        jax.monitoring.register_event_duration_secs_listener(on_event)

    def prepare(self, fn: Callable[..., Any], weights: dict[str, torch.Tensor]) -> None:
        self.fn = self.interop.jax_jit(fn, kwargs_for_jax_jit={"donate_argnums": (1,)})
        self.weights = {k: self.to_device(v) for k, v in weights.items()}

    def to_device(self, t: torch.Tensor) -> Any:
        return self.interop.torch_view(self.jax.numpy.asarray(t.numpy()))

    def run(self, caches: list[Any], step: Step) -> tuple[torch.Tensor, list[Any]]:
        inputs = {k: self.to_device(v) for k, v in step.tensors().items()}
        logits, caches = self.fn(self.weights, caches, inputs)
        return self.to_host(logits), caches

    def to_host(self, t: Any) -> torch.Tensor:
        return torch.from_numpy(self.jax.device_get(self.interop.jax_view(t)).copy())

    def compiles(self) -> int:
        return self._compiles

    def call_jax(self, fn: Callable[..., Any], *args: torch.Tensor) -> torch.Tensor:
        # a torchax tensor is a JAX array (a tracer under jit): the kernel is traced inline
        return self.interop.call_jax(fn, *args)

    def notes(self) -> list[str]:
        return [
            f"torchax {self.torchax.__version__ if hasattr(self.torchax, '__version__') else '?'}, "
            f"jax {self.jax.__version__} on {self.jax.devices()[0].platform}",
            "torchax.interop.jax_jit(step, donate_argnums=(1,)); weights, caches and inputs are pytree arguments",
            "in-place KV write: the caches are returned by the step and the caller keeps the returned arrays",
            f"torch {torch.__version__} lacks {len(self.shimmed)} aten overloads torchax names at import "
            f"(placeholders set: {', '.join(self.shimmed[:4])}, ...)"
            if self.shimmed
            else "torchax imported without shims",
        ]


class TorchXlaRunner(Runner):
    """torch-xla: lazy tensors on the PJRT CPU device, one graph per step cut by ``torch_xla.sync()``.

    The KV write is an in-place ``index_put_`` on an XLA tensor: the lazy graph records it and
    the sync materialises it into the same tensor (the caller keeps its cache objects).
    """

    name = "torch-xla"

    def __init__(self) -> None:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla
        import torch_xla.debug.metrics as met

        self.torch_xla, self.met = torch_xla, met
        self.device = torch_xla.device()

    def prepare(self, fn: Callable[..., Any], weights: dict[str, torch.Tensor]) -> None:
        self.fn = fn
        self.weights = {k: self.to_device(v) for k, v in weights.items()}
        self.torch_xla.sync()

    def to_device(self, t: torch.Tensor) -> Any:
        return t.to(self.device)

    def run(self, caches: list[Any], step: Step) -> tuple[torch.Tensor, list[Any]]:
        inputs = {k: self.to_device(v) for k, v in step.tensors().items()}
        logits, caches = self.fn(self.weights, caches, inputs)
        self.torch_xla.sync()  # cut the graph: logits and the cache writes execute here
        return self.to_host(logits), caches

    def to_host(self, t: Any) -> torch.Tensor:
        return t.cpu()

    def compiles(self) -> int:
        return int(self.met.counter_value("UncachedCompile") or 0)

    def call_jax(self, fn: Callable[..., Any], *args: torch.Tensor) -> torch.Tensor:
        # jax lowers fn to HLO once per (fn, shapes); the lazy graph embeds it as a computation
        import torch_xla.core.xla_builder as xb

        return xb.call_jax(fn, args)

    def notes(self) -> list[str]:
        return [
            f"torch {torch.__version__}, torch_xla {self.torch_xla.__version__}, "
            f"PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}",
            "lazy tensors: the step is re-traced in Python every call, hashed, and compiled only on a new graph",
            "in-place KV write: index_put_ on the XLA cache tensor, materialised at torch_xla.sync()",
        ]


class TorchXlaDynamoRunner(TorchXlaRunner):
    """torch-xla through dynamo: ``torch.compile(step, backend="openxla")``, XLA graphs replayed
    without re-tracing the Python (dynamo's guards decide when to trace again)."""

    name = "torch-xla-dynamo"

    def prepare(self, fn: Callable[..., Any], weights: dict[str, torch.Tensor]) -> None:
        super().prepare(torch.compile(fn, backend="openxla"), weights)

    def notes(self) -> list[str]:
        from torch._dynamo.utils import counters

        return [
            *super().notes()[:1],
            'torch.compile(step, backend="openxla"); compiles counted by XLA (UncachedCompile)',
            f"dynamo: {dict(counters['stats'])}, graph breaks: {sum(counters['graph_break'].values())}",
        ]


def make_runner(path: str) -> Runner:
    """The runner of ``path``; its library is imported here, so eager needs neither."""
    if path == "eager":
        return Runner()
    if path == "torchax":
        return TorchaxRunner()
    if path == "torch-xla":
        return TorchXlaRunner()
    if path == "torch-xla-dynamo":
        return TorchXlaDynamoRunner()
    raise ValueError(f"unknown path {path!r}: expected one of {', '.join(PATHS)}")


# -- measuring ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    """One (path, shape) row."""

    path: str
    shape: str
    attention: str
    first_call_s: float | None = None
    step_ms_median: float | None = None
    step_ms_min: float | None = None
    compiles_first: int | None = None
    recompiles_value_steps: int | None = None
    max_abs_diff: float | None = None
    max_abs_diff_value_steps: float | None = None
    kv_write_visible: bool | None = None
    kv_write_max_diff: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def measure(
    runner: Runner, model: Any, model_ref: Any, shape: str, attention: str, steps: int, value_steps: int
) -> Result:
    """First call, steady step, recompiles and agreement of ``runner`` on ``shape``."""
    result = Result(runner.name, shape, attention)
    gen = torch.Generator().manual_seed(1234)
    step0 = make_step(shape, gen, model.config.vocab_size)
    host_caches = initial_caches(model, seed=7)
    ref_logits, ref_caches = eager_oracle(model_ref, host_caches, step0)
    state = ModelState(model)
    host = [step0]
    runner.prepare(forward_fn(model, state, host, bucket_host=attention == "static"), state.tensors())
    caches = [runner.to_device(c.clone()) for c in host_caches]
    before = runner.compiles()
    t0 = time.perf_counter()
    try:
        logits, caches = runner.run(caches, step0)
    except Exception as exc:  # the finding: which op stops the tracer
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400]}"
        result.notes.append(_origin(exc))
        return result
    result.first_call_s = time.perf_counter() - t0
    result.compiles_first = runner.compiles() - before
    result.max_abs_diff = float((logits - ref_logits).abs().max())
    # the step's K/V are visible in the caches it left behind, and equal the oracle's
    slots = step0.slot_mapping
    written = [runner.to_host(c).reshape(2, -1, *c.shape[3:])[:, slots] for c in caches]
    expected = [c.reshape(2, -1, *c.shape[3:])[:, slots] for c in ref_caches]
    unwritten = [c.reshape(2, -1, *c.shape[3:])[:, slots] for c in host_caches]
    result.kv_write_max_diff = max(float((w - e).abs().max()) for w, e in zip(written, expected, strict=True))
    result.kv_write_visible = result.kv_write_max_diff < 1e-4 and all(
        float((w - u).abs().max()) > 1e-3 for w, u in zip(written, unwritten, strict=True)
    )
    # steady state: the same inputs again (times include host -> device inputs and logits back)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _, caches = runner.run(caches, step0)
        times.append(time.perf_counter() - t0)
    result.step_ms_median = 1e3 * statistics.median(times)
    result.step_ms_min = 1e3 * min(times)
    # same shapes, different values: each against its own oracle
    before = runner.compiles()
    worst = 0.0
    for _ in range(value_steps):
        step = make_step(shape, gen, model.config.vocab_size)
        host[0] = step
        caches = [runner.to_device(c.clone()) for c in host_caches]
        logits, caches = runner.run(caches, step)
        worst = max(worst, float((logits - eager_oracle(model_ref, host_caches, step)[0]).abs().max()))
    result.recompiles_value_steps = runner.compiles() - before
    result.max_abs_diff_value_steps = worst
    return result


def _origin(exc: BaseException) -> str:
    """The innermost plinth frame of ``exc``'s traceback (where the untraceable op is)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "plinth" in f.filename or f.filename == __file__]
    if not frames:
        return "no plinth frame in the traceback"
    f = frames[-1]
    return f"raised under {Path(f.filename).name}:{f.lineno} `{(f.line or '').strip()}`"


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, measure every shape on one path, print a table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=PATHS, required=True)
    parser.add_argument("--attention", choices=("static", "reference"), default="static")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=20, help="steady-state steps (median reported)")
    parser.add_argument("--value-steps", type=int, default=10, help="steps with new values, counting compiles")
    parser.add_argument(
        "--no-inference-mode",
        action="store_true",
        help="call the model's forward without its @torch.inference_mode() (torch.no_grad() instead)",
    )
    parser.add_argument(
        "--pallas-op",
        action="store_true",
        help="run silu_and_mul as a Pallas kernel (interpret mode) through the path's JAX bridge",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        parser.error(f"unknown shape(s) {', '.join(bad)}: expected some of {', '.join(SHAPES)}")
    if args.steps < 1 or args.value_steps < 0:
        parser.error("--steps must be >= 1 and --value-steps >= 0")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    runner = make_runner(args.path)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_model("llama", Path(tmp) / "llama")
        model = build_model(folder, args.attention, PallasOps(runner.call_jax) if args.pallas_op else None)
        if args.no_inference_mode:
            strip_inference_mode(model)
        model_ref = build_model(folder, "reference")
    rows = []
    for shape in shapes:
        row = measure(runner, model, model_ref, shape, args.attention, args.steps, args.value_steps)
        rows.append(row)
    header = (
        f"path={args.path} attention={args.attention} pallas_op={args.pallas_op} "
        f"inference_mode={not args.no_inference_mode} torch={torch.__version__} python={platform.python_version()} "
        f"host={cpu_model().replace(' ', '_')} threads={torch.get_num_threads()} load={os.getloadavg()[0]:.1f}"
    )
    print(header)
    print(
        f"{'shape':<10} {'first s':>8} {'step ms':>8} {'min ms':>8} {'c1':>3} {'recomp':>6} {'maxdiff':>9} "
        f"{'diff10':>9} {'kv ok':>5}"
    )
    for r in rows:
        if r.error:
            print(f"{r.shape:<10} ERROR {r.error}\n{'':<10} {' '.join(r.notes)}")
            continue
        print(
            f"{r.shape:<10} {r.first_call_s:>8.3f} {r.step_ms_median:>8.3f} {r.step_ms_min:>8.3f} "
            f"{r.compiles_first:>3} {r.recompiles_value_steps:>6} {r.max_abs_diff:>9.2e} "
            f"{r.max_abs_diff_value_steps:>9.2e} {r.kv_write_visible!s:>5}"
        )
    for note in runner.notes():
        print(f"note: {note}")
    if isinstance(model.kernels.ops, PallasOps):
        print(f"note: the Pallas silu_and_mul was called {model.kernels.ops.calls} times from Python")
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
