# mypy: disable-error-code="empty-body"
"""The plinth plugin contract: every hook, the plugin API version and its history, and the list of
objects a plugin touches. A vendor reads this module first.

Every hook a backend plugin may implement is specified here, and only here. A plugin is a module (or
object) found through the ``plinth.backends`` entry-point group; the built-in reference backend is
registered through that same group, exactly like a third-party one.

Hooks are resolved once, when the engine starts or a model loads; they are never called in the
per-token loop. What a hook hands back are plain objects (:class:`plinth.platform.Backend`, kernel
objects) whose methods the step loop calls directly.

Versioning
----------

:data:`PLUGIN_API_VERSION` is ``(major, minor)``. A plugin declares the version it was written
against (``Backend.api_version``). A different major is rejected with a message naming the plugin,
and so is a minor newer than this plinth's; an older minor is accepted. A minor only adds, each
addition with a default that keeps older plugins correct. New arguments are only ever *added* to a
hook: the plugin host calls every hook through pluggy, which passes an implementation only the
arguments it names, so an implementation of an older signature keeps working. A hook is never
renamed in place.

Each contract object's docstring carries ``.. versionadded::`` for itself, and each member added or
changed after the object carries its own ``versionadded``/``versionchanged`` (fields: in their
``#:`` comment). :data:`API_HISTORY` below is the summary; the markers are the detail.

The contract objects
--------------------

:data:`CONTRACT` names every object a plugin implements, subclasses, returns or receives:

- torch-free value objects, :mod:`plinth.platform.values` (re-exported by
  :mod:`plinth.platform.backend`): ``NotSupported``, ``Probe``, ``KVCacheLayout``,
  ``AttentionSpec``, ``Capabilities``, ``StepBuckets``, ``StepShape``;
- what a backend implements, :mod:`plinth.platform.backend`: ``Backend``, ``DeviceServices``,
  ``AttentionKernels`` (receiving ``AttentionMetadata``), ``GemmKernels`` (returning
  ``LinearWeight``), ``SmallOps``, ``GraphCapture``, ``StepGraph``, ``KernelProvider``, ``StepInputs``,
  ``StepProgram``, ``CompiledStep``, ``FlatBlocks``, ``Communicator``, and the
  helpers ``torch_dtype``/``dtype_name``;
- quantized weights a GEMM may receive, :mod:`plinth.platform.quant`: ``QuantizedWeight``,
  ``dequantize``;
- the reference kernels a starter plugin subclasses, :mod:`plinth.platform.reference`:
  ``ReferenceAttention``, ``ReferenceGemm``, ``ReferenceMoE``, ``ReferenceLoRA``;
- the batched LoRA op, :mod:`plinth.platform.lora` (re-exported by :mod:`plinth.platform.backend`):
  ``LoRAKernels`` (receiving ``LoRABatch``), built for a ``LoRASpec`` (:mod:`plinth.platform.values`).

Version history
---------------

=====  ===========================================================================================
API    adds / changes
=====  ===========================================================================================
1.0    the hooks ``plinth_register_backends`` and ``plinth_register_kernels(backend_name)``;
       ``Backend``, ``Capabilities``, ``Probe``, ``AttentionSpec``, ``KVCacheLayout``,
       ``NotSupported``, ``DeviceServices`` (``memory_info``, ``synchronize``, ``default_dtype``),
       ``AttentionKernels`` (``write_kv``, ``forward``, ``copy_blocks``), ``AttentionMetadata``,
       ``GemmKernels`` (``prepare``, ``linear``), ``LinearWeight``, ``SmallOps`` (``rms_norm``,
       ``silu_and_mul``, ``rotary``), ``KernelProvider``
1.1    quantized weights: ``Capabilities.quant_formats``, ``GemmKernels.prepare_quantized``
       (default: dequantize, then ``prepare``), ``QuantizedWeight``; ``SmallOps.add_rms_norm``
       (default: add, then ``rms_norm``)
1.2    step graphs: ``DeviceServices.begin_graph_capture`` -> ``GraphCapture`` (``finish``,
       ``cancel``, ``kernels_only``) -> ``StepGraph.replay`` (default: None, every step eager)
1.3    ``StepGraph.replay_rows(rows, captured)``: replay a bucket's first ``rows`` only (default:
       ``replay()``, every row)
1.4    ``plinth_register_kernels`` gains ``backend`` (the selected ``Backend`` object); the host
       calls every hook through pluggy, so implementations of older signatures keep working;
       ``KernelProvider.api_version`` (checked like a backend's: a kernel-only plugin was never
       version-checked);
       the value objects import without torch from :mod:`plinth.platform.values`; the
       quantized-weight types live in :mod:`plinth.platform.quant` (``plinth.quant`` still
       re-exports them);
       ``DeviceServices.compile`` removed (the core never called it: an override is now simply
       unused); ``DeviceServices.synchronize`` documented with its callers;
       ``AttentionMetadata.from_lengths`` (the one constructor of a varlen batch's metadata);
       ``SmallOps.argmax`` (the sampler's greedy pick, default torch's); ``DeviceServices.
       set_num_threads`` (``--threads``; default torch's intra-op count) and ``read_probes``
       (``plinth bench latency``'s bandwidth limit; default torch's ``sum``);
       ``Backend.allocate_kv_cache(..., prefault=)`` (default: zero-filled, so every page is
       touched anyway)
1.5    static-shape steps: ``Backend.step_buckets`` -> ``StepBuckets`` (``StepShape``); every step
       padded (``StepInputs``, its padding semantics) and run as the model's pure ``StepProgram``,
       compiled by ``DeviceServices.compile_step`` into a ``CompiledStep`` (warm-up over every shape,
       a compilation counter, the KV caches as explicit state); a decode-first order of every step
       (``AttentionMetadata.distribution``, ``describe``, ``traced``); the fused, functional
       ``AttentionKernels.write_and_attend`` (default: ``write_kv`` then ``forward``), which the model's
       layers now call; ``KVCacheLayout`` beyond a permutation (interleaved ``kv_heads``,
       ``packing``, ``head_size_align``, ``block_bytes``, ``canonical_kv_view``; the KV cache is
       sized from the physical shape)
1.6    separate prefill and decode graphs: ``Capabilities.mixed_batches`` (False: the scheduler
       runs one phase per step), ``StepBuckets.decode`` (the decode set; ``StepShape.decode``,
       ``AttentionMetadata.decode_only``); flat block lists: ``StepBuckets.flat_blocks``,
       ``StepShape.flat_blocks``, ``FlatBlocks`` (``StepInputs.flat_blocks``,
       ``AttentionMetadata.flat_blocks``); ``Capabilities.block_placement`` ("contiguous": lowest
       free block ids first), ``Capabilities.preferred_block_size``, ``Capabilities.communicator``
       (the ``torch.distributed`` backend of the device's process group)
1.7    scale-out: ``Communicator`` (in-place sum all-reduce, all-gather, broadcast, barrier, send
       (non-blocking: a ``PendingSend``), recv) from ``DeviceServices.communicator(world_size,
       rank, backend)`` (default: ``torch.distributed`` over a new group of
       ``Capabilities.communicator``, gloo where none is declared);
       ``DeviceServices.device_for_rank(local_rank)`` (default: the one device);
       ``CompiledStep.warmup`` has a default (one dummy step per shape)
1.8    the fused mixture-of-experts op: ``MoESpec``, ``Capabilities.fused_moe``
       (``MoECapabilities``: dtypes, quantized formats, max experts and top-k, activations),
       ``Backend.moe_kernels(spec)`` / ``KernelProvider.moe_kernels(spec)`` -> ``MoEKernels``
       (``prepare``, ``prepare_quantized``, ``forward``) with ``ExpertWeights`` and the routing
       rule ``route_experts`` (default: none supplied; the core runs ``ReferenceMoE``);
       ``SmallOps.gelu_tanh_and_mul`` (Gemma 3's gated MLP; default plain torch) and
       ``SmallOps.rms_norm_heads`` (Qwen3/Gemma 3's q/k norm; default: heads copied dense, ``rms_norm``)
1.9    structured output: ``SmallOps.apply_token_bitmask`` (the forbidden tokens' logits set to
       ``-inf`` from a packed int32 bitmask; default plain torch)
1.10   tensor and pipeline parallelism together: ``DeviceServices.communicator(..., groups=)`` (the
       world split into groups, every rank passing the same list; the communicator of this rank's
       group, numbered within it)
1.11   multi-LoRA serving: the batched LoRA op ``LoRAKernels`` (``prepare_batch`` once per step ->
       ``LoRABatch``; ``shrink``, ``expand`` per adapted projection over stacked adapter slots) for a
       ``LoRASpec``, from ``Backend.lora_kernels(spec)`` / ``KernelProvider.lora_kernels(spec)``
       (default: none supplied; the core runs ``ReferenceLoRA`` with a fallback warning)
1.12   SPMD tensor parallelism: ``Capabilities.spmd`` (one process drives a device mesh; the
       compiler inserts the collectives), ``SpmdPlan`` passed as
       ``DeviceServices.compile_step(..., spmd=)`` (the weights' splits, the KV heads)
1.13   per-rank devices: ``Backend.bind_local_rank(local_rank)``, called first in every rank of a
       parallel world (local rank: the rank's index among the ranks on its host, or the device Ray
       gave it), after which the services drive ``device_for_rank(local_rank)`` (default: nothing,
       the one device); ``Capabilities.device_resource`` (Ray's name for one device: "GPU")
1.14   16-bit checkpoints: ``GemmKernels.stored_dtypes`` (dense linear weights stored in one of these
       dtypes reach ``prepare`` as stored, and the GEMM casts them itself: the cpu backend keeps a
       bf16/fp16 checkpoint's weights in 16 bits in an fp32 model; default: none, cast by the core)
1.15   process environment: the ``plinth.process_env`` entry-point group (a torch-free callable
       returning ``{variable: value}``, set at ``import plinth`` where unset, before torch starts:
       the cpu backend asks for ``OMP_WAIT_POLICY=PASSIVE`` where its native kernels run; see
       :mod:`plinth.process_env`; default: nothing asked)
1.16   fp8 KV caches: the dtype name ``float8_e4m3fn`` (torch's, 1 byte a value) in
       ``Capabilities.kv_cache_dtypes`` and ``EngineConfig.kv_cache_dtype`` (``fp8`` its alias at
       the command line); K/V are stored as ``Tensor.to`` rounds them (to nearest even, saturating
       at +-448: no scale), read widened exactly; a KV-cache dtype only, never a compute dtype
=====  ===========================================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from plinth.platform.backend import Backend, KernelProvider

#: The entry-point group (and pluggy project name) every backend plugin registers under.
PROJECT_NAME = "plinth.backends"

#: ``(major, minor)``: a plugin written for another major is refused; minors only add.
PLUGIN_API_VERSION: tuple[int, int] = (1, 16)

#: One line per minor: what it added or changed (the module docstring's table, as data, for the
#: docs, the template and ``plinth backends --verbose``). The last key is :data:`PLUGIN_API_VERSION`.
API_HISTORY: dict[tuple[int, int], str] = {
    (1, 0): "the two hooks; Backend, Capabilities, Probe, AttentionSpec, KVCacheLayout, NotSupported, "
    "DeviceServices, AttentionKernels, AttentionMetadata, GemmKernels, LinearWeight, SmallOps, KernelProvider",
    (1, 1): "quantized weights (Capabilities.quant_formats, GemmKernels.prepare_quantized); SmallOps.add_rms_norm",
    (1, 2): "step graphs: DeviceServices.begin_graph_capture -> GraphCapture -> StepGraph",
    (1, 3): "StepGraph.replay_rows",
    (1, 4): "plinth_register_kernels(backend); hooks called through pluggy; KernelProvider.api_version; "
    "torch-free plinth.platform.values; DeviceServices.compile removed; AttentionMetadata.from_lengths, "
    "SmallOps.argmax, DeviceServices.set_num_threads and read_probes, Backend.allocate_kv_cache(prefault=)",
    (1, 5): "static-shape steps: Backend.step_buckets, StepBuckets, StepShape, StepInputs, StepProgram, "
    "DeviceServices.compile_step -> CompiledStep; decode-first order (AttentionMetadata.distribution, traced); "
    "AttentionKernels.write_and_attend (fused, functional); KVCacheLayout kv_heads/packing/head_size_align/block_bytes",
    (1, 6): "separate prefill/decode graphs: Capabilities.mixed_batches, StepBuckets.decode (StepShape.decode, "
    "AttentionMetadata.decode_only); flat block lists: StepBuckets.flat_blocks, StepShape.flat_blocks, FlatBlocks; "
    "Capabilities.block_placement, preferred_block_size, communicator",
    (1, 7): "scale-out: Communicator from DeviceServices.communicator (default torch.distributed), "
    "DeviceServices.device_for_rank",
    (1, 8): "fused MoE: MoESpec, Capabilities.fused_moe (MoECapabilities), Backend.moe_kernels and "
    "KernelProvider.moe_kernels -> MoEKernels (ExpertWeights), route_experts, ReferenceMoE; "
    "SmallOps.gelu_tanh_and_mul, rms_norm_heads",
    (1, 9): "structured output: SmallOps.apply_token_bitmask",
    (1, 10): "TP x PP: DeviceServices.communicator(groups=), the world split into groups",
    (1, 11): "multi-LoRA: LoRASpec, Backend.lora_kernels and KernelProvider.lora_kernels -> LoRAKernels "
    "(prepare_batch -> LoRABatch, shrink, expand), ReferenceLoRA",
    (1, 12): "SPMD tensor parallelism: Capabilities.spmd, SpmdPlan, DeviceServices.compile_step(spmd=)",
    (1, 13): "per-rank devices: Backend.bind_local_rank(local_rank), the services then drive device_for_rank; "
    "Capabilities.device_resource",
    (1, 14): "16-bit checkpoints: GemmKernels.stored_dtypes (dense linear weights in those dtypes reach "
    "prepare as stored)",
    (1, 15): "process environment: the plinth.process_env entry-point group (torch-free {variable: value} "
    "set at import plinth where unset, before torch starts)",
    (1, 16): "fp8 KV caches: the dtype name float8_e4m3fn in Capabilities.kv_cache_dtypes (stored as Tensor.to "
    "rounds, saturating at +-448, no scale; never a compute dtype)",
}

#: Every object a plugin implements, subclasses, returns or receives, by dotted name.
CONTRACT: tuple[str, ...] = (
    "plinth.hookspecs.plinth_register_backends",
    "plinth.hookspecs.plinth_register_kernels",
    "plinth.platform.values.NotSupported",
    "plinth.platform.values.Probe",
    "plinth.platform.values.KVCacheLayout",
    "plinth.platform.values.AttentionSpec",
    "plinth.platform.values.Capabilities",
    "plinth.platform.values.StepBuckets",
    "plinth.platform.values.StepShape",
    "plinth.platform.values.MoESpec",
    "plinth.platform.values.MoECapabilities",
    "plinth.platform.values.LoRASpec",
    "plinth.platform.values.SpmdPlan",
    "plinth.platform.backend.Backend",
    "plinth.platform.backend.DeviceServices",
    "plinth.platform.backend.AttentionKernels",
    "plinth.platform.backend.AttentionMetadata",
    "plinth.platform.backend.GemmKernels",
    "plinth.platform.backend.LinearWeight",
    "plinth.platform.backend.SmallOps",
    "plinth.platform.backend.GraphCapture",
    "plinth.platform.backend.StepGraph",
    "plinth.platform.backend.KernelProvider",
    "plinth.platform.backend.StepInputs",
    "plinth.platform.backend.StepProgram",
    "plinth.platform.backend.CompiledStep",
    "plinth.platform.backend.Communicator",
    "plinth.platform.backend.PendingSend",
    "plinth.platform.backend.FlatBlocks",
    "plinth.platform.backend.MoEKernels",
    "plinth.platform.backend.ExpertWeights",
    "plinth.platform.backend.route_experts",
    "plinth.platform.lora.LoRAKernels",
    "plinth.platform.lora.LoRABatch",
    "plinth.platform.backend.torch_dtype",
    "plinth.platform.backend.canonical_kv_view",
    "plinth.platform.backend.dtype_name",
    "plinth.platform.quant.QuantizedWeight",
    "plinth.platform.quant.dequantize",
    "plinth.platform.reference.ReferenceAttention",
    "plinth.platform.reference.ReferenceGemm",
    "plinth.platform.reference.ReferenceMoE",
    "plinth.platform.reference.ReferenceLoRA",
)


def api_version_string(version: tuple[int, int] = PLUGIN_API_VERSION) -> str:
    """``"1.4"`` for ``(1, 4)``: how docs, the template and ``plinth backends`` write a version."""
    return f"{version[0]}.{version[1]}"


hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------------------------------
# Discovery: called once per plugin when the plugin host starts.
# -------------------------------------------------------------------------------------------------


@hookspec
def plinth_register_backends() -> Sequence[Backend]:
    """Return the backends this plugin provides.

    Called by the plugin host once per plugin, right after that plugin's entry point has been
    loaded and registered, one plugin at a time (so an error is attributed to the plugin that
    raised it; the other plugins still load).

    :return: a sequence of :class:`plinth.platform.Backend` objects, usually one. Each backend's
        ``name`` must be unique across all installed plugins; its ``api_version`` is checked against
        :data:`PLUGIN_API_VERSION` before anything else is asked of it.

    The implementation must be cheap and must not touch the hardware: constructing a backend object
    must never fail because a device is missing. Hardware checks belong in ``Backend.probe()``,
    which reports "unusable" as a score of 0 with reasons.

    .. versionadded:: 1.0
    """


# -------------------------------------------------------------------------------------------------
# Kernel resolution: called once per engine, after selection.
# -------------------------------------------------------------------------------------------------


@hookspec
def plinth_register_kernels(backend_name: str, backend: Backend) -> Sequence[KernelProvider]:
    """Contribute attention or GEMM kernels to an existing backend.

    Called by the plugin host once per engine, after selection and before the engine resolves its
    kernels (``PluginHost.kernel_providers``), one plugin at a time: a plugin whose implementation
    raises is reported with its name and contributes nothing; the engine still starts. A kernel
    plugin (say, a faster attention for the ``cpu`` backend) returns providers whose
    ``backend_name`` matches; every other plugin returns an empty sequence (or does not implement
    the hook).

    :param backend_name: the name of the backend the engine selected.
    :param backend: that backend's object, so a provider can build its kernels for the backend's
        device (``backend.device_services().device``) and check its version or capabilities.
    :return: :class:`plinth.platform.backend.KernelProvider` objects; any whose ``backend_name``
        differs is dropped. For each op, the providers with ``priority`` above 0 are asked first,
        highest first; then the backend's own kernels (priority 0); then, only where the backend
        raises ``NotSupported``, the remaining providers. See :func:`plinth.platform.kernels.resolve_kernels`.

    The implementation must be cheap and must not build kernels yet: the providers' factories are
    asked per case when the model loads. It must not modify ``backend``.

    .. versionadded:: 1.0
    .. versionchanged:: 1.4
        ``backend``: the selected backend's object. Implementations taking only ``backend_name``
        keep working (pluggy passes each implementation only the arguments it names).
    """
