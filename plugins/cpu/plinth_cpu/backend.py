"""The CPU backend object: probe, capabilities and kernel factories."""

from __future__ import annotations

import platform
from importlib import metadata

import torch

from plinth.host_memory import huge_page_tensor
from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    Capabilities,
    DeviceServices,
    GemmKernels,
    GraphCapture,
    Probe,
    SmallOps,
    StepGraph,
    torch_dtype,
)
from plinth_cpu.attention import CPU_KV_LAYOUT, CpuAttention
from plinth_cpu.gemm import CpuGemm
from plinth_cpu.native import QUANT_FORMATS, NativeGraph, NativeKernels, native, native_status
from plinth_cpu.ops import CpuOps

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
    ("amx", frozenset({"amx_tile", "amx_bf16", "amx_int8"})),
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
    """The host CPU's services; step graphs of the native kernels where they are loaded."""

    def __init__(self, native: NativeKernels | None) -> None:
        super().__init__(torch.device("cpu"))
        self._native = native

    def begin_graph_capture(self) -> GraphCapture | None:
        """Record native kernel calls; None without native kernels (torch ops cannot be recorded)."""
        return None if self._native is None else CpuGraphCapture(self._native)


class CpuBackend(Backend):
    """Vectorised torch kernels on the host CPU: fp32 (fastest here), bf16/fp16 with fp32 attention."""

    name = "cpu"
    version = __version__
    api_version = (1, 3)
    description = "vectorised torch kernels on the host CPU (x86-64 AVX2/AVX-512/AMX, Arm NEON)"

    def __init__(self) -> None:
        dtypes = frozenset({"float32", "float64", "bfloat16", "float16"})
        self._native = native()  # None without AVX2/FMA/F16C or a C compiler: torch kernels only
        self._services = CpuServices(self._native)
        self._caps = Capabilities(
            dtypes=dtypes,
            kv_cache_dtypes=dtypes,
            # torch ops take any head size; multiples of 8 keep rows SIMD-aligned. Kept wide on
            # purpose: with a head-major cache the core cannot fall back to the reference kernel.
            head_sizes=frozenset(range(16, 513, 8)),
            block_sizes=(8, 16, 32, 64, 128),
            max_gqa_ratio=None,
            features=frozenset({"sliding_window", "logits_soft_cap"}),
            kv_cache_layout=CPU_KV_LAYOUT,
            quant_formats=frozenset(QUANT_FORMATS) if self._native is not None else frozenset(),
        )

    def probe(self) -> Probe:
        """Score the host CPU; never raises (no /proc/cpuinfo just means fewer details)."""
        info = _read_cpuinfo()
        model = cpu_model(info)
        features = isa_features(info)
        capability = torch.backends.cpu.get_cpu_capability()  # what torch's kernels dispatch to
        reasons = [
            f"CPU: {model}",
            f"ISA features: {', '.join(features) if features else 'none of avx2/avx512f/amx/neon found'}",
            f"torch kernels use {capability}, {torch.get_num_threads()} threads",
            native_status(),
        ]
        if features or capability != "DEFAULT":
            score = SIMD_SCORE
        else:
            score = SCALAR_SCORE
            reasons.append("no SIMD found: usable, but slow")
        return Probe(score=score, reasons=tuple(reasons), device_name=model)

    def capabilities(self) -> Capabilities:
        """Dtypes, head sizes, block sizes and features this backend's kernels run."""
        return self._caps

    def device_services(self) -> DeviceServices:
        """The host CPU's device services (memory from sysconf, no-op synchronize, step graphs)."""
        return self._services

    def allocate_kv_cache(self, spec: AttentionSpec, num_blocks: int) -> torch.Tensor:
        """A zeroed cache in anonymous memory, which the kernel zero-fills page by page on first touch,
        advised into 2 MiB huge pages (see :mod:`plinth.host_memory`).

        ``torch.zeros`` writes the whole cache at start-up (the default 1 GiB: 0.5-2 s on a VM, where
        every first touch faults); here a step pays only for the blocks it writes.
        """
        shape = CPU_KV_LAYOUT.shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        dtype = torch_dtype(spec.kv_cache_dtype)
        return huge_page_tensor(shape, dtype)

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        """:class:`CpuAttention` for ``spec``; :class:`NotSupported` with reasons otherwise."""
        self._caps.require_attention(self.name, spec)
        return CpuAttention(spec, self._caps.kv_cache_layout, self._native)

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        """:class:`CpuGemm` computing in ``dtype``."""
        self._caps.require_gemm(self.name, dtype)
        if self._native is not None:  # the engine has set torch's thread count by now
            self._native.set_num_threads(torch.get_num_threads())
        return CpuGemm(torch_dtype(dtype), self._native)

    def small_ops(self) -> SmallOps:
        """RMSNorm, SiLU-and-mul and rotary: native kernels for fp32, torch for other dtypes."""
        return CpuOps(self._native)
