"""What the CUDA and ROCm backends share: capabilities, device services, kernel factories, probing.

A vendor backend (``plinth_cuda``, ``plinth_rocm``) subclasses :class:`TritonBackend` and says only
how to find its hardware (``probe_hardware``), how to name its architecture (``arch``) and which
collective library it would use (``communicator``). The kernels are the same Triton sources.

Two modes, fixed by the environment when asked:

* hardware: tensors on ``torch.device("cuda", i)`` (ROCm builds of torch use the same device type),
  bfloat16 by default, memory from ``torch.cuda.mem_get_info``, feature ``cuda_graphs`` declared;
* interpreter (``PLINTH_TRITON_INTERPRET=1``): the same kernels in Triton's interpreter on CPU
  tensors, float32 by default, host memory, a score of 5 (below the cpu backend's 50: it is picked
  only by name) and ``emulation=True``: a certificate then says "interpreter", never hardware.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    Capabilities,
    DeviceServices,
    GemmKernels,
    KVCacheLayout,
    MoECapabilities,
    MoEKernels,
    MoESpec,
    Probe,
    SmallOps,
    torch_dtype,
)
from plinth_triton import runtime
from plinth_triton.ops import InterpreterTarget, KernelTarget, TritonAttention, TritonGemm, TritonMoE, TritonSmallOps

#: Score on a usable GPU: above every CPU backend.
HARDWARE_SCORE = 100
#: Score on a GPU without bfloat16 (compute capability 7.x): usable in float16.
NO_BF16_SCORE = 60
#: Score in interpreter mode: usable, but below the cpu backend's 50, so only picked by name.
INTERPRETER_SCORE = 5
#: The probe's device name in interpreter mode.
INTERPRETER_DEVICE = "triton interpreter (CPU)"

_DTYPES = frozenset({"float32", "bfloat16", "float16"})


class GpuServices(DeviceServices):
    """One GPU through torch's ``cuda`` device type (CUDA or HIP)."""

    def __init__(self, device: torch.device, default: str) -> None:
        super().__init__(device)
        self._default = default

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory, as the driver reports them."""
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def synchronize(self) -> None:
        """Wait for the device's queued kernels."""
        torch.cuda.synchronize(self.device)

    def device_for_rank(self, local_rank: int) -> torch.device:
        """GPU ``local_rank`` of this host: one GPU per rank."""
        return torch.device("cuda", local_rank)

    def default_dtype(self) -> str:
        """bfloat16 where the GPU has it, else float16."""
        return self._default


class InterpreterServices(DeviceServices):
    """Triton's interpreter: CPU tensors, host memory, synchronous, float32 (fastest in numpy)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))


class _Hardware:
    """Hardware mode: the vendor's probe, GPU services, the arch's launch target, CUDA graphs declared."""

    emulation = False
    #: torch.distributed's backend for the GPUs' collectives: NCCL, and on torch's ROCm builds RCCL
    #: under the same name
    collectives: str | None = "nccl"
    #: what Ray counts one GPU as (its executor reserves one per rank)
    device_resource: str | None = "GPU"

    def probe(self, backend: TritonBackend) -> Probe:
        return backend.probe_hardware()

    def bind(self, backend: TritonBackend, local_rank: int) -> None:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"local rank {local_rank} needs GPU {local_rank}; {backend.vendor} sees {count} GPU(s)")
        torch.cuda.set_device(local_rank)

    def features(self) -> frozenset[str]:
        # Launches never read device memory on the host, so a step can be captured; the core has
        # no capture hook yet (docs/gpu.md), so this only declares it.
        return frozenset({"sliding_window", "logits_soft_cap", "cuda_graphs"})

    def services(self) -> DeviceServices:
        index = torch.cuda.current_device()
        default = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return GpuServices(torch.device("cuda", index), default)

    def target(self, backend: TritonBackend) -> KernelTarget:
        return KernelTarget(backend.arch(), amd=backend.amd)


class _Interpreter:
    """Interpreter mode: Triton's interpreter on CPU tensors, labelled emulation."""

    emulation = True
    collectives: str | None = None  # host tensors: the host collectives (gloo)
    device_resource: str | None = None  # host cores only

    def bind(self, backend: TritonBackend, local_rank: int) -> None:
        return None  # every rank on the host's CPU

    def probe(self, backend: TritonBackend) -> Probe:
        status = runtime.triton_status()
        if not status.available:
            return Probe(0, (f"{runtime.INTERPRET_ENV}=1, but {status.detail}",), INTERPRETER_DEVICE, True)
        reasons = (
            f"{runtime.INTERPRET_ENV}=1: the {backend.vendor} backend's Triton kernels run in Triton's "
            f"interpreter on CPU tensors (for tests; select it by name: --backend {backend.name})",
            status.detail,
            "emulation: not a hardware certification",
        )
        return Probe(INTERPRETER_SCORE, reasons, INTERPRETER_DEVICE, emulation=True)

    def features(self) -> frozenset[str]:
        return frozenset({"sliding_window", "logits_soft_cap"})

    def services(self) -> DeviceServices:
        return InterpreterServices()

    def target(self, backend: TritonBackend) -> KernelTarget:
        return InterpreterTarget()


_MODES: dict[bool, _Hardware | _Interpreter] = {False: _Hardware(), True: _Interpreter()}


class TritonBackend(Backend):
    """Base of the Triton-kernel backends. Subclasses set ``name``, ``vendor``, ``communicator``.

    What differs between hardware and interpreter mode lives in one mode object per mode
    (``_Hardware``, ``_Interpreter``), looked up in one place (:meth:`mode`); no method asks which
    mode it is in.
    """

    api_version = (1, 13)  # 1.8: the fused-MoE op; 1.13: a GPU per rank (bind_local_rank)
    #: Human name of the platform, for reasons ("CUDA", "ROCm").
    vendor: ClassVar[str]
    #: The vendor's collective library ("nccl", "rccl"), for reasons and docs; torch.distributed
    #: reaches both as "nccl" (``Capabilities.communicator`` on hardware).
    communicator: ClassVar[str]
    #: Launch AMD-only options (``waves_per_eu``) from the config tables.
    amd: ClassVar[bool] = False

    def __init__(self) -> None:
        self._services: dict[bool, DeviceServices] = {}

    # -- what subclasses provide --------------------------------------------------------------------

    @abstractmethod
    def probe_hardware(self) -> Probe:
        """Probe the real device; score 0 with reasons when it or its runtime is missing."""

    @abstractmethod
    def arch(self) -> str:
        """The config-table key of the current device ("sm90", "gfx942"). Hardware mode only."""

    # -- shared ---------------------------------------------------------------------------------------

    @staticmethod
    def interpreting() -> bool:
        """True in interpreter mode (``PLINTH_TRITON_INTERPRET=1``)."""
        return runtime.interpret_requested()

    def mode(self) -> _Hardware | _Interpreter:
        """The mode the environment asks for now: the one place it is read."""
        return _MODES[self.interpreting()]

    def probe(self) -> Probe:
        """Interpreter mode when requested, else the hardware probe. Never raises for missing hardware."""
        return self.mode().probe(self)

    def capabilities(self) -> Capabilities:
        """The same envelope in both modes; ``cuda_graphs`` only on hardware."""
        return Capabilities(
            dtypes=_DTYPES,
            kv_cache_dtypes=_DTYPES,
            # 16/32 for tests; 80/96/112/160/192 go through the head-dim mask (padded to a power of 2)
            head_sizes=frozenset({16, 32, 64, 80, 96, 112, 128, 160, 192, 256}),
            block_sizes=(16, 32, 64),
            max_gqa_ratio=None,
            features=self.mode().features(),
            # no ggml block format (plinth.platform.quant) yet: the GEMM's int8/int4 weight-only formats
            # are its own, made by plinth_triton.quant.quantize, not by the core's loader
            quant_formats=frozenset(),
            kv_cache_layout=KVCacheLayout(),
            # the grouped-GEMM fused MoE (kernels/moe.py): dense experts in every compute dtype
            fused_moe=MoECapabilities(dtypes=_DTYPES, activations=frozenset({"silu", "gelu_tanh"})),
            communicator=self.mode().collectives,
            device_resource=self.mode().device_resource,
        )

    def bind_local_rank(self, local_rank: int) -> None:
        """On hardware, GPU ``local_rank`` becomes this process's device (and its services' device);
        in interpreter mode every rank stays on the CPU.

        :raises ValueError: the host has no GPU ``local_rank``.
        """
        mode = self.mode()
        mode.bind(self, local_rank)
        self._services.pop(mode.emulation, None)  # made again, for the current device

    def device_services(self) -> DeviceServices:
        """GPU services on hardware, host services in interpreter mode (one object per mode)."""
        mode = self.mode()
        if mode.emulation not in self._services:
            self._services[mode.emulation] = mode.services()
        return self._services[mode.emulation]

    def target(self) -> KernelTarget:
        """Where and how kernels launch now."""
        return self.mode().target(self)

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        """:class:`TritonAttention` for ``spec``; :class:`NotSupported` with reasons otherwise."""
        caps = self.capabilities()
        caps.require_attention(self.name, spec)
        return TritonAttention(spec, caps.kv_cache_layout, self.target())

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        """:class:`TritonGemm` computing in ``dtype``."""
        self.capabilities().require_gemm(self.name, dtype)
        return TritonGemm(torch_dtype(dtype), self.device_services().device, self.target())

    def moe_kernels(self, spec: MoESpec) -> MoEKernels:
        """:class:`TritonMoE` for ``spec``; :class:`NotSupported` with reasons for an undeclared one."""
        self.capabilities().require_moe(self.name, spec)
        return TritonMoE(spec, self.device_services().device, self.target())

    def small_ops(self) -> SmallOps:
        """Triton RMSNorm and rotary; torch silu_and_mul."""
        return TritonSmallOps(self.target())
