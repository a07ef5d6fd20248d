"""The gaudi backend: Intel Gaudi (HPU) through ``habana_frameworks.torch``, static shapes throughout.

Two modes, fixed by the environment:

* hardware: the Gaudi software stack (``habana_frameworks``) and an HPU; the kernels run on the
  ``hpu`` device and every step shape is captured once as an HPU graph (:mod:`plinth_gaudi.compiled`).
* emulation (``PLINTH_GAUDI_EMULATE=1``): the same torch code on the CPU device, a score of 5
  (picked only by name) and ``emulation=True``: a certificate then says "emulation", never hardware.
  Every step is still padded to its bucket and the shapes counted, so "no new shape after warm-up"
  is checked here exactly as on the device.

What it declares through the contract (API 1.6): separate prefill and decode bucket sets with a
flat block list (:meth:`GaudiBackend.step_buckets`), no mixed prefill/decode forwards
(``mixed_batches=False``), block size 128 by default, optional contiguous block placement
(``PLINTH_GAUDI_CONTIGUOUS=1``) and HCCL as the communicator for the scale-out issue.

Importing this module never imports ``habana_frameworks``: the probe finds it with
:func:`importlib.util.find_spec` and imports it only when it is there.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from importlib import metadata
from typing import Any

import torch

from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    Capabilities,
    Communicator,
    CompiledStep,
    DeviceServices,
    GemmKernels,
    KVCacheLayout,
    LinearWeight,
    Probe,
    StepBuckets,
    StepProgram,
    torch_dtype,
)
from plinth.platform.devices import HOST
from plinth.platform.reference import ReferenceGemm

try:
    __version__ = metadata.version("plinth-gaudi")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"

#: Set to 1 to run the backend's torch code on the CPU device (emulation).
EMULATE_ENV = "PLINTH_GAUDI_EMULATE"
#: Set to 1 to ask the block pool for contiguous placement (lowest free block ids first).
CONTIGUOUS_ENV = "PLINTH_GAUDI_CONTIGUOUS"
#: The vendor package the hardware mode needs (never imported unless found).
VENDOR_MODULE = "habana_frameworks.torch"
HARDWARE_SCORE = 100
EMULATION_SCORE = 5
EMULATION_DEVICE = "CPU device (gaudi emulation)"
DEFAULT_BLOCK_SIZE = 128
#: Smallest token bucket of a prefill step, and of a decode step's batch.
MIN_PREFILL_TOKENS = 16
MIN_DECODE_SEQS = 1

#: Separate K and V caches: ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
GAUDI_KV_LAYOUT = KVCacheLayout()


def emulate_requested() -> bool:
    """True when ``PLINTH_GAUDI_EMULATE=1``: the one place the mode is read."""
    return os.environ.get(EMULATE_ENV, "") == "1"


def contiguous_requested() -> bool:
    """True when ``PLINTH_GAUDI_CONTIGUOUS=1``."""
    return os.environ.get(CONTIGUOUS_ENV, "") == "1"


def vendor_present() -> bool:
    """Whether ``habana_frameworks.torch`` is installed (found, not imported)."""
    try:
        return importlib.util.find_spec("habana_frameworks") is not None and (
            importlib.util.find_spec(VENDOR_MODULE) is not None
        )
    except (ImportError, ValueError):
        return False


def _vendor() -> Any:
    """``habana_frameworks.torch`` (importing it registers the ``hpu`` device with torch)."""
    return importlib.import_module(VENDOR_MODULE)


def hpu_memory(hpu: Any) -> tuple[int, int]:
    """``(free, total)`` bytes of HPU memory from the runtime.

    ``mem_get_info`` where the stack has it, else the allocator's ``memory_stats`` (``Limit`` and
    ``InUse``). Never a placeholder: a runtime that reports no memory is an error.

    :raises RuntimeError: the runtime reports a total of 0 or cannot be asked.
    """
    if hasattr(hpu, "mem_get_info"):
        free, total = (int(x) for x in hpu.mem_get_info())
    else:
        stats = hpu.memory_stats()
        total = int(stats.get("Limit", 0))
        free = total - int(stats.get("InUse", 0))
    if total <= 0:
        raise RuntimeError(f"gaudi: the HPU runtime reports {total} bytes of device memory; cannot size the KV cache")
    return max(0, free), total


def probe_vendor(found: bool, emulate: bool) -> Probe:
    """The probe's answer from what it found (pure where it can be, so each reason is tested).

    :param found: :func:`vendor_present`.
    :param emulate: :func:`emulate_requested`.
    """
    if emulate:
        reasons = (
            f"{EMULATE_ENV}=1: the gaudi backend's torch code runs on the CPU device",
            "emulation: not a hardware certification",
        )
        return Probe(EMULATION_SCORE, reasons, EMULATION_DEVICE, emulation=True)
    if not found:
        return Probe(0, (f"the Gaudi software stack ({VENDOR_MODULE}) is not installed",))
    try:
        ht = _vendor()
        available = bool(ht.hpu.is_available())
        count = int(ht.hpu.device_count()) if available else 0
    except Exception as e:  # the vendor stack is there but broken: say how, never raise from a probe
        return Probe(0, (f"{VENDOR_MODULE} is installed but failed to initialise: {type(e).__name__}: {e}",))
    if not available or count == 0:
        return Probe(0, (f"{VENDOR_MODULE} is installed, but no HPU is visible (driver loaded? /dev/accel*?)",))
    name = str(ht.hpu.get_device_name()) if hasattr(ht.hpu, "get_device_name") else "Gaudi HPU"
    return Probe(HARDWARE_SCORE, (f"{count} HPU(s) through {VENDOR_MODULE}",), name)


class GaudiServices(DeviceServices):
    """The ``hpu`` device (or the host CPU in emulation): runtime memory, HPU-graph steps."""

    def __init__(self, *, emulate: bool) -> None:
        super().__init__(HOST if emulate else torch.device("hpu"))
        self.emulate = emulate

    def memory_info(self) -> tuple[int, int]:
        """On an HPU: the runtime's free and total device memory. In emulation: the host's."""
        if self.emulate:
            return super().memory_info()
        return hpu_memory(_vendor().hpu)

    def synchronize(self) -> None:
        if not self.emulate:
            _vendor().hpu.synchronize()

    def default_dtype(self) -> str:
        return "float32" if self.emulate else "bfloat16"

    def communicator(
        self, world_size: int, rank: int, backend: str | None, *, groups: list[list[int]] | None = None
    ) -> Communicator:
        """HCCL on HPUs (habana's module registers it with torch.distributed when imported); gloo in
        emulation, where the ranks are CPU processes."""
        if self.emulate:
            return super().communicator(world_size, rank, "gloo", groups=groups)
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
        return super().communicator(world_size, rank, backend or "hccl", groups=groups)

    def compile_step(
        self, program: StepProgram, kv_caches: list[torch.Tensor], *, cache_dir: str | None = None
    ) -> CompiledStep:
        """One HPU graph per step shape on the device; in emulation the same padded steps, eager,
        with every new shape counted as a capture."""
        from plinth_gaudi.compiled import GaudiCompiledStep

        return GaudiCompiledStep(program, kv_caches, self.device, hpu=None if self.emulate else _vendor().hpu)


class GaudiGemm(ReferenceGemm):
    """``F.linear`` on the backend's device (on an HPU, the MME matrix engine)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype)
        self.device = device

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        return super().prepare(weight.to(self.device), None if bias is None else bias.to(self.device))

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        assert weight.weight is not None
        return torch.nn.functional.linear(x, weight.weight, weight.bias)


def _powers(low: int, high: int) -> tuple[int, ...]:
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return tuple(out)


class GaudiBackend(Backend):
    """Intel Gaudi through ``habana_frameworks.torch`` (or the same code on the CPU, labelled emulation)."""

    name = "gaudi"
    version = __version__
    api_version = (1, 10)
    description = "Intel Gaudi (HPU): flat paged attention, bucketed prefill/decode HPU graphs, never mixed"

    def __init__(self) -> None:
        self._services: dict[bool, GaudiServices] = {}

    def probe(self) -> Probe:
        return probe_vendor(vendor_present(), emulate_requested())

    def capabilities(self) -> Capabilities:
        dtypes = frozenset({"float32", "bfloat16"})
        return Capabilities(
            dtypes=dtypes,
            kv_cache_dtypes=dtypes,
            head_sizes=frozenset({64, 80, 96, 128, 256}),
            block_sizes=(DEFAULT_BLOCK_SIZE, 16, 32, 64),
            features=frozenset({"sliding_window", "logits_soft_cap"}),
            kv_cache_layout=GAUDI_KV_LAYOUT,
            mixed_batches=False,
            block_placement="contiguous" if contiguous_requested() else "any",
            preferred_block_size=DEFAULT_BLOCK_SIZE,
            communicator="hccl",
        )

    def device_services(self) -> GaudiServices:
        mode = emulate_requested()
        if mode not in self._services:
            self._services[mode] = GaudiServices(emulate=mode)
        return self._services[mode]

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        self.capabilities().require_attention(self.name, spec)
        from plinth_gaudi.attention import GaudiAttention

        return GaudiAttention(spec, GAUDI_KV_LAYOUT)

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        self.capabilities().require_gemm(self.name, dtype)
        return GaudiGemm(torch_dtype(dtype), self.device_services().device)

    def step_buckets(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> StepBuckets:
        """Two sets, both with a flat block list in powers of two up to ``max_seqs`` full tables:

        * prefill: tokens in powers of two from 16, sequences from 1, one block-table width (the
          context's: the kernels read the flat list, not the table);
        * decode: batch sizes in powers of two from 1 (T == B).
        """
        flat = _powers(1, max_seqs * max_blocks_per_seq)
        decode_seqs = _powers(MIN_DECODE_SEQS, min(max_seqs, max_tokens))
        decode = StepBuckets(
            tokens=decode_seqs, seqs=decode_seqs, blocks_per_seq=(max_blocks_per_seq,), flat_blocks=flat
        )
        return StepBuckets(
            tokens=_powers(MIN_PREFILL_TOKENS, max_tokens),
            seqs=_powers(1, max_seqs),
            blocks_per_seq=(max_blocks_per_seq,),
            flat_blocks=flat,
            decode=decode,
        )
