"""The metal backend: Apple Silicon through torch MPS, sized for unified memory.

Two modes, fixed by the environment:

* hardware: macOS, a torch built with MPS and a Metal GPU; the kernels run on the ``mps`` device.
* emulation (``PLINTH_METAL_EMULATE=1``): the same torch code on the CPU device, a score of 5
  (picked only by name) and ``emulation=True``: a certificate then says "emulation", never hardware.

The probe never fails: where MPS cannot run it returns score 0 with the precise reason (not macOS,
a torch without MPS, too old a macOS, no Metal device). The kernels are in
:mod:`plinth_metal.attention`; the 4 GB single-allocation limit is enforced in
:meth:`MetalBackend.allocate_kv_cache`.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata

import torch

from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    Capabilities,
    DeviceServices,
    GemmKernels,
    KVCacheLayout,
    LinearWeight,
    NotSupported,
    Probe,
    torch_dtype,
)
from plinth.platform.devices import HOST
from plinth.platform.reference import ReferenceGemm

try:
    __version__ = metadata.version("plinth-metal")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"

#: Set to 1 to run the backend's torch code on the CPU device (emulation).
EMULATE_ENV = "PLINTH_METAL_EMULATE"
#: The share (0 < f <= 1) of the recommended working set the engine may size its KV cache from.
MEMORY_FRACTION_ENV = "PLINTH_METAL_MEMORY_FRACTION"
DEFAULT_MEMORY_FRACTION = 1.0
HARDWARE_SCORE = 100
EMULATION_SCORE = 5
EMULATION_DEVICE = "CPU device (metal emulation)"
#: MPS became usable in torch with macOS 12.3.
MIN_MACOS = (12, 3)

#: MPS defect (c): one Metal buffer holds at most 4 GiB on the GPUs torch's MPS allocator targets
#: (larger tensors fail to allocate or, on some releases, wrap their offsets). One layer's KV cache is
#: one tensor, so a cache past this is refused with its size (see ``allocate_kv_cache``).
MAX_BUFFER_BYTES = 1 << 32

#: One layer's cache: [2, num_blocks, block_size, num_kv_heads, head_size] (the default layout).
METAL_KV_LAYOUT = KVCacheLayout()


def emulate_requested() -> bool:
    """True when ``PLINTH_METAL_EMULATE=1``: the one place the mode is read."""
    return os.environ.get(EMULATE_ENV, "") == "1"


def memory_fraction() -> float:
    """``PLINTH_METAL_MEMORY_FRACTION`` (default 1.0), validated.

    :raises ValueError: not a number, or outside ``(0, 1]``; the message names the variable and value.
    """
    raw = os.environ.get(MEMORY_FRACTION_ENV, "").strip()
    if not raw:
        return DEFAULT_MEMORY_FRACTION
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{MEMORY_FRACTION_ENV}={raw!r} is not a number (want a fraction in (0, 1])") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{MEMORY_FRACTION_ENV}={raw!r} is outside (0, 1]")
    return value


def _macos_version(text: str) -> tuple[int, ...]:
    """``"14.2.1"`` -> ``(14, 2, 1)``; ``()`` when unknown."""
    try:
        return tuple(int(p) for p in text.split(".") if p)
    except ValueError:
        return ()


def diagnose(system: str, mac_version: str, built: bool, available: bool) -> tuple[str, ...]:
    """Why MPS cannot run, from what the probe read (empty when it can). Pure, so each reason is tested.

    :param system: ``platform.system()``.
    :param mac_version: ``platform.mac_ver()[0]`` (empty off macOS).
    :param built: ``torch.backends.mps.is_built()``.
    :param available: ``torch.backends.mps.is_available()``.
    """
    if system != "Darwin":
        return (f"not macOS ({system}): Apple Silicon's MPS is macOS-only",)
    if not built:
        return (f"torch {torch.__version__} was built without MPS (install the macOS arm64 wheel of torch)",)
    version = _macos_version(mac_version)
    if version and version < MIN_MACOS:
        need = ".".join(map(str, MIN_MACOS))
        return (f"macOS {mac_version} is too old: torch's MPS needs macOS {need} or newer",)
    if not available:
        return (f"torch has MPS and macOS is {mac_version or 'unknown'}, but no Metal device is available (a VM?)",)
    return ()


@functools.cache
def mps_has_bfloat16() -> bool:
    """Whether this GPU family and macOS give MPS bfloat16 (macOS 14+, Apple GPU family 7+ in practice).

    Asked once, at probe time, by making a bfloat16 tensor: torch raises where Metal lacks the type.
    """
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps").sum().item()
    except (RuntimeError, TypeError):
        return False
    return True


def _chip_name() -> str:
    """``"Apple M2 Pro"`` from sysctl; ``"Apple GPU (MPS)"`` when it cannot be read."""
    try:
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return "Apple GPU (MPS)"
    return out.stdout.strip() or "Apple GPU (MPS)"


def unified_memory(recommended: int, allocated: int, fraction: float) -> tuple[int, int]:
    """``(free, total)`` of unified memory: the recommended working set times ``fraction`` is the
    total; what the driver already holds (the loaded weights among it) is used."""
    total = int(recommended * fraction)
    return max(0, total - allocated), total


class MetalServices(DeviceServices):
    """The ``mps`` device (or the host CPU in emulation); memory from the unified-memory working set."""

    def __init__(self, *, emulate: bool) -> None:
        super().__init__(HOST if emulate else torch.device("mps"))
        self.emulate = emulate

    def memory_info(self) -> tuple[int, int]:
        """On MPS: ``torch.mps.recommended_max_memory()`` times the fraction, less
        ``torch.mps.driver_allocated_memory()``. In emulation: the host's, times the fraction."""
        fraction = memory_fraction()
        if self.emulate:
            free, total = super().memory_info()
            total = int(total * fraction)
            return min(free, total), total
        return unified_memory(torch.mps.recommended_max_memory(), torch.mps.driver_allocated_memory(), fraction)

    def synchronize(self) -> None:
        if not self.emulate:
            torch.mps.synchronize()

    def default_dtype(self) -> str:
        if self.emulate:
            return "float32"
        return "bfloat16" if mps_has_bfloat16() else "float16"


class MetalGemm(ReferenceGemm):
    """``F.linear`` on the backend's device: MPS hands it to MPSGraph's matmul."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype)
        self.device = device

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        return super().prepare(weight.to(self.device), None if bias is None else bias.to(self.device))

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        assert weight.weight is not None
        return torch.nn.functional.linear(x, weight.weight, weight.bias)


class MetalBackend(Backend):
    """Apple Silicon GPUs through torch MPS (or the same code on the CPU, labelled emulation)."""

    name = "metal"
    version = __version__
    api_version = (1, 5)
    description = "Apple Silicon through torch MPS: paged gather + SDPA around MPS's defects, unified memory"

    def __init__(self) -> None:
        self._services: dict[bool, MetalServices] = {}

    def probe(self) -> Probe:
        if emulate_requested():
            reasons = (
                f"{EMULATE_ENV}=1: the metal backend's torch code runs on the CPU device",
                "emulation: not a hardware certification",
            )
            return Probe(EMULATION_SCORE, reasons, EMULATION_DEVICE, emulation=True)
        system = platform.system()
        mac = platform.mac_ver()[0] if system == "Darwin" else ""
        built = torch.backends.mps.is_built()
        available = built and torch.backends.mps.is_available()
        why_not = diagnose(system, mac, built, available)
        if why_not:
            return Probe(0, why_not)
        bf16 = "bfloat16 and float16" if mps_has_bfloat16() else "float16 (no bfloat16 on this GPU/macOS)"
        return Probe(HARDWARE_SCORE, (f"MPS on macOS {mac}: {bf16}",), _chip_name())

    def _emulate(self) -> bool:
        return emulate_requested()

    def capabilities(self) -> Capabilities:
        if self._emulate():
            dtypes = frozenset({"float32", "bfloat16", "float16"})
        else:
            dtypes = frozenset({"float32", "float16"} | ({"bfloat16"} if mps_has_bfloat16() else set()))
        return Capabilities(
            dtypes=dtypes,
            kv_cache_dtypes=dtypes,
            head_sizes=frozenset({64, 80, 96, 128, 256}),
            block_sizes=(8, 16, 32),
            max_gqa_ratio=None,
            features=frozenset({"sliding_window", "logits_soft_cap"}),
            kv_cache_layout=METAL_KV_LAYOUT,
        )

    def device_services(self) -> MetalServices:
        mode = self._emulate()
        if mode not in self._services:
            self._services[mode] = MetalServices(emulate=mode)
        return self._services[mode]

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        self.capabilities().require_attention(self.name, spec)
        from plinth_metal.attention import MetalAttention

        return MetalAttention(spec, METAL_KV_LAYOUT)

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        self.capabilities().require_gemm(self.name, dtype)
        return MetalGemm(torch_dtype(dtype), self.device_services().device)

    def allocate_kv_cache(self, spec: AttentionSpec, num_blocks: int, *, prefault: bool = False) -> torch.Tensor:
        """One layer's cache, refused past :data:`MAX_BUFFER_BYTES` (MPS defect (c)).

        The contract gives a layer one tensor, so the cache cannot be split into several buffers
        here; the error names the size and the largest block count that fits.

        :raises NotSupported: one layer's cache would exceed one Metal buffer.
        """
        dtype = torch_dtype(spec.kv_cache_dtype)
        shape = METAL_KV_LAYOUT.shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if nbytes > MAX_BUFFER_BYTES:
            per_block = nbytes // num_blocks
            raise NotSupported(
                self.name,
                "KV cache",
                f"one layer's cache of {num_blocks} blocks is {nbytes} bytes ({nbytes / (1 << 30):.2f} GiB), over "
                f"MPS's {MAX_BUFFER_BYTES >> 30} GiB single-allocation limit; at most {MAX_BUFFER_BYTES // per_block} "
                "blocks per layer fit (lower num_kv_blocks, kv_cache_memory_gb or PLINTH_METAL_MEMORY_FRACTION)",
            )
        return torch.zeros(shape, dtype=dtype, device=self.device_services().device)
