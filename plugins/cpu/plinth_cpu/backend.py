"""The CPU backend object: probe, capabilities and kernel factories."""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from importlib import metadata

import torch

from plinth import process_env
from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    Capabilities,
    Communicator,
    DeviceServices,
    GemmKernels,
    GraphCapture,
    LoRAKernels,
    LoRASpec,
    MoECapabilities,
    MoEKernels,
    MoESpec,
    Probe,
    SmallOps,
    StepGraph,
    torch_dtype,
)
from plinth_cpu.attention import CPU_KV_LAYOUT, CpuAttention, NativeAttention
from plinth_cpu.gemm import (
    CpuGemm,
    NativeGemm,
    amx_int8_status,
    bf16_pairs_status,
    bf16x3_status,
    onednn_packing_status,
)
from plinth_cpu.host_memory import huge_page_tensor
from plinth_cpu.lora import CpuLoRA
from plinth_cpu.moe import CpuMoE, MoEScratch
from plinth_cpu.native import (
    QUANT_FORMATS,
    NativeGraph,
    NativeKernels,
    emulating,
    native,
    native_loaded,
    native_status,
)
from plinth_cpu.ops import CpuOps, TorchOps
from plinth_cpu.preflight import build_check

try:
    __version__ = metadata.version("plinth-cpu")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.1.0"

#: Score on a host with a SIMD unit torch's kernels use; far above the reference's 1.
SIMD_SCORE = 50
#: Score without any SIMD feature found: still better than the one-sequence-at-a-time reference.
SCALAR_SCORE = 10

#: ISA features looked for in /proc/cpuinfo, as (name reported, flags that imply it).
_ISA_FLAGS: tuple[tuple[str, frozenset[str]], ...] = (
    ("avx2", frozenset({"avx2"})),
    ("avx512f", frozenset({"avx512f"})),
    ("avx512_vnni", frozenset({"avx512_vnni"})),
    ("avx512_bf16", frozenset({"avx512_bf16"})),
    ("avx512_fp16", frozenset({"avx512_fp16"})),
    ("amx_bf16", frozenset({"amx_bf16"})),
    ("amx_int8", frozenset({"amx_int8"})),
    ("neon", frozenset({"neon", "asimd"})),  # aarch64 kernels report Advanced SIMD as "asimd"
)


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> str:
    """The text of /proc/cpuinfo, or "" where there is none (macOS, Windows, sandboxes)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_model(cpuinfo: str) -> str:
    """The CPU's marketing name: /proc/cpuinfo "model name" (x86), else ``platform.processor()``."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def isa_features(cpuinfo: str) -> list[str]:
    """SIMD features named in the "flags" (x86) or "Features" (Arm) lines of ``cpuinfo``."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return [name for name, implied in _ISA_FLAGS if flags & implied]


class CpuStepGraph(StepGraph):
    """A step's native kernel calls, replayed in one call into the library."""

    def __init__(self, graph: NativeGraph) -> None:
        self.graph = graph

    def replay(self) -> None:
        """Run the recorded calls; :class:`~plinth_cpu.native.GraphError` names one that failed."""
        self.graph.replay()

    def replay_rows(self, rows: int, captured: int) -> None:
        """Run the recorded calls over the first ``rows`` rows only: every native call works row
        by row, so a bucket's padding rows cost nothing (a 9-sequence step in the 16 bucket:
        67.8 -> 54.6 ms, SmolLM2-135M fp32, 2 threads)."""
        self.graph.replay(rows, captured)


class CpuGraphCapture(GraphCapture):
    """Records the native kernels' calls (torch ops are not recorded: ``kernels_only``)."""

    kernels_only = True

    def __init__(self, native: NativeKernels) -> None:
        self._native = native
        native.begin_recording()

    def finish(self) -> StepGraph:
        """The calls made since the capture began, as a :class:`CpuStepGraph`."""
        return CpuStepGraph(self._native.end_recording())

    def cancel(self) -> None:
        """Stop recording and drop the calls."""
        self._native.cancel_recording()


class CpuServices(DeviceServices):
    """The host CPU's services: the native kernels' thread pool, their read probe and step graphs.

    The native library is loaded (and built, on a fresh cache) on first use, never at discovery."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def set_num_threads(self, n: int) -> None:
        """``n`` threads for torch's CPU ops and for the native kernels' pool (which starts, when the
        library loads, with torch's count: so a count set before that reaches it too)."""
        torch.set_num_threads(n)
        if native_loaded() and (kernels := native()) is not None:  # loaded: resize its pool
            kernels.set_num_threads(n)

    def read_probes(self) -> dict[str, Callable[[torch.Tensor], object]]:
        """torch's ``sum`` and, with the native kernels, their AVX2 streaming loop (``avx2_stream``:
        the loads the fp32 GEMV makes, four streams per thread on the pool), the larger of which is the
        read bandwidth batch-1 decode is held to."""
        probes = super().read_probes()
        if (kernels := native()) is not None:
            probes["avx2_stream"] = kernels.read_probe
        return probes

    def communicator(
        self, world_size: int, rank: int, backend: str | None, *, groups: list[list[int]] | None = None
    ) -> Communicator:
        """gloo (the default), with its all-reduce through shared memory where every rank of the group
        is on this host (:mod:`plinth_cpu.shm_comm`: ~0.6 ms a call through gloo's loopback TCP)."""
        from plinth.parallel.comm import world_timeout_s
        from plinth_cpu.shm_comm import SharedMemoryCommunicator

        inner = super().communicator(world_size, rank, backend, groups=groups)
        return SharedMemoryCommunicator.create(inner, timeout_s=world_timeout_s() or 60.0)

    def begin_graph_capture(self) -> GraphCapture | None:
        """Record native kernel calls; None without native kernels (torch ops cannot be recorded)."""
        kernels = native()
        return None if kernels is None else CpuGraphCapture(kernels)


class CpuBackend(Backend):
    """Vectorised torch kernels on the host CPU: fp32 (fastest here), bf16/fp16 with fp32 attention.

    Building it touches no hardware and compiles nothing: the native kernels are built or loaded when
    the capabilities or a kernel are first asked for (after selection), and the probe only reports
    whether they are built."""

    name = "cpu"
    version = __version__
    # 1.4: set_num_threads, read_probes, prefault, SmallOps.argmax; 1.8: fused MoE; 1.9: apply_token_bitmask;
    # 1.10: communicator(groups=) (a shared-memory all-reduce on one host); 1.11: batched LoRA;
    # 1.14: GemmKernels.stored_dtypes (16-bit checkpoint weights kept in 16-bit panels);
    # 1.15: a plinth.process_env entry point (OMP_WAIT_POLICY=PASSIVE where the native kernels run);
    # 1.16: fp8 (e4m3fn) KV caches
    api_version = (1, 16)
    description = "vectorised torch kernels on the host CPU (x86-64 AVX2/AVX-512/AMX, Arm NEON)"

    def __init__(self) -> None:
        self._services = CpuServices()
        self._moe_scratch = MoEScratch()  # the fused MoE's [T * k, H] work buffers, shared by all layers

    @functools.cached_property
    def _caps(self) -> Capabilities:
        dtypes = frozenset({"float32", "float64", "bfloat16", "float16"})
        return Capabilities(
            dtypes=dtypes,
            # fp8 (e4m3fn) caches: a quarter of fp32's bytes a decode step reads, opt-in (--kv-cache-dtype)
            kv_cache_dtypes=dtypes | {"float8_e4m3fn"},
            # torch ops take any head size; multiples of 8 keep rows SIMD-aligned. Kept wide on
            # purpose: with a head-major cache the core cannot fall back to the reference kernel.
            head_sizes=frozenset(range(16, 513, 8)),
            block_sizes=(8, 16, 32, 64, 128),
            max_gqa_ratio=None,
            features=frozenset({"sliding_window", "logits_soft_cap"}),
            kv_cache_layout=CPU_KV_LAYOUT,
            # None without AVX2/FMA/F16C or a C compiler: torch kernels only, no native block formats
            quant_formats=frozenset(QUANT_FORMATS) if native() is not None else frozenset(),
            # grouped over the backend's own GEMM: every GEMM dtype, blocks kept where GEMM keeps them
            fused_moe=MoECapabilities(
                dtypes=dtypes,
                quant_formats=frozenset(QUANT_FORMATS) if native() is not None else frozenset(),
                activations=frozenset({"silu", "gelu_tanh"}),
            ),
        )

    def probe(self) -> Probe:
        """Score the host CPU; never raises (no /proc/cpuinfo just means fewer details) and builds
        nothing (the native kernels' line says whether they are built, or will be on first use)."""
        info = _read_cpuinfo()
        model = cpu_model(info)
        features = isa_features(info)
        capability = torch.backends.cpu.get_cpu_capability()  # what torch's kernels dispatch to
        reasons = [
            f"CPU: {model}",
            f"ISA features: {', '.join(features) if features else 'none of avx2/avx512f/amx/neon found'}",
            f"torch kernels use {capability}, {torch.get_num_threads()} threads",
            native_status(),
            onednn_packing_status(),
            bf16_pairs_status(),
            f"torch's OpenMP threads: {process_env.report('OMP_WAIT_POLICY')}",
        ]
        if bf16x3 := bf16x3_status():
            reasons.insert(-1, bf16x3)
        if amx_int8 := amx_int8_status():
            reasons.insert(-1, amx_int8)
        if features or capability != "DEFAULT":
            score = SIMD_SCORE
        else:
            score = SCALAR_SCORE
            reasons.append("no SIMD found: usable, but slow")
        try:  # the AVX-512 build emulated (a test build): a certificate made so says "emulation"
            emulated = emulating() and build_check()[0] is not None
        except ValueError:  # named by the native kernels' line
            emulated = False
        return Probe(score=score, reasons=tuple(reasons), device_name=model, emulation=emulated)

    def capabilities(self) -> Capabilities:
        """Dtypes, head sizes, block sizes and features this backend's kernels run (the quantized
        formats depend on the native kernels, which are loaded, or built, on this first call)."""
        return self._caps

    def device_services(self) -> DeviceServices:
        """The host CPU's device services (memory from sysconf, no-op synchronize, step graphs)."""
        return self._services

    def allocate_kv_cache(self, spec: AttentionSpec, num_blocks: int, *, prefault: bool = False) -> torch.Tensor:
        """A zeroed cache in anonymous memory, which the kernel zero-fills page by page on first touch,
        advised into 2 MiB huge pages (see :mod:`plinth_cpu.host_memory`).

        ``torch.zeros`` writes the whole cache at start-up (the default 1 GiB: 0.5-2 s on a VM, where
        every first touch faults); here a step pays only for the blocks it writes. ``prefault`` writes
        it all now instead (1.2 s for 1 GiB on the dev VM, and the 64-request throughput workload ran
        4% faster: what a long-running server wants).
        """
        shape = CPU_KV_LAYOUT.shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        cache = huge_page_tensor(shape, torch_dtype(spec.kv_cache_dtype))
        if prefault:
            cache.zero_()  # every page faulted in now, not by the first step that writes it
        return cache

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        """:class:`NativeAttention` where the native kernels load and cover ``spec``, else
        :class:`CpuAttention`; :class:`NotSupported` with reasons where the capabilities exclude it."""
        self._caps.require_attention(self.name, spec)
        kernels = native()
        if kernels is not None and NativeAttention.covers(spec):
            return NativeAttention(spec, self._caps.kv_cache_layout, kernels)
        return CpuAttention(spec, self._caps.kv_cache_layout)

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        """GEMM computing in ``dtype``: :class:`NativeGemm` with the native kernels, else :class:`CpuGemm`."""
        self._caps.require_gemm(self.name, dtype)
        kernels = native()
        return CpuGemm(torch_dtype(dtype)) if kernels is None else NativeGemm(torch_dtype(dtype), kernels)

    def moe_kernels(self, spec: MoESpec) -> MoEKernels:
        """:class:`CpuMoE`: the step's tokens grouped by expert, one GEMM per expert group through
        :meth:`gemm_kernels` in ``spec.dtype``, its work buffers shared with every other MoE layer's;
        :class:`NotSupported` for an undeclared ``spec``."""
        self._caps.require_moe(self.name, spec)
        return CpuMoE(spec, self.gemm_kernels(spec.dtype), self.small_ops(), self._moe_scratch)

    def lora_kernels(self, spec: LoRASpec) -> LoRAKernels:
        """:class:`CpuLoRA`: the step's tokens grouped by adapter once per step, one torch GEMM per
        group; :class:`NotSupported` for a dtype the GEMM does not declare."""
        self._caps.require_gemm(self.name, spec.dtype)
        return CpuLoRA(spec)

    def small_ops(self) -> SmallOps:
        """RMSNorm, SiLU-and-mul, rotary and the sampler's argmax: :class:`CpuOps` (native for fp32)
        with the native kernels, else :class:`TorchOps` (torch's defaults and the sliced argmax)."""
        kernels = native()
        return TorchOps() if kernels is None else CpuOps(kernels)
