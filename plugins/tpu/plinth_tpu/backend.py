"""The TPU backend: the contract's static-shape path (API 1.5) on JAX, Pallas attention, XLA GEMMs.

Two modes, fixed by the environment:

* hardware: libtpu and a TPU device present; kernels compiled by Mosaic/XLA for the chip.
* interpreter (``PLINTH_TPU_INTERPRET=1``): the same kernels on JAX's CPU platform, Pallas in its
  interpreter, a score of 5 (picked only by name) and ``emulation=True``: a certificate then says
  "interpreter", never hardware.

The probe never imports JAX when the answer is "no TPU": it looks for libtpu and the device files.
Every step is padded to the backend's buckets and runs as one compiled function
(:mod:`plinth_tpu.compiled`); the weights and KV caches stay on the device.
"""

from __future__ import annotations

import glob
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
    CompiledStep,
    DeviceServices,
    GemmKernels,
    KVCacheLayout,
    Probe,
    SmallOps,
    SpmdPlan,
    StepBuckets,
    StepProgram,
    torch_dtype,
)
from plinth.platform.devices import HOST

try:
    __version__ = metadata.version("plinth-tpu")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"

#: Set to 1 to run the kernels in Pallas' interpreter on JAX's CPU platform.
INTERPRET_ENV = "PLINTH_TPU_INTERPRET"
HARDWARE_SCORE = 100
INTERPRETER_SCORE = 5
INTERPRETER_DEVICE = "Pallas interpreter on JAX's CPU platform"

#: One layer's cache: [num_blocks, block_size, 2 * Hkv // packing, packing, Dp], K/V interleaved per
#: head, 16-bit values packed in pairs, the head size padded to the 128-lane width.
TPU_KV_LAYOUT = KVCacheLayout(("num_blocks", "block_size", "kv_heads", "packing", "head_size"), head_size_align=128)

#: The smallest token and sequence buckets (a step is padded to at least these).
MIN_TOKENS = 16
MIN_SEQS = 8


def interpret_requested() -> bool:
    """True when ``PLINTH_TPU_INTERPRET=1``: the one place the mode is read."""
    return os.environ.get(INTERPRET_ENV, "") == "1"


def tpu_device_files() -> list[str]:
    """The TPU device nodes of this host (``/dev/accel*`` on v2-v4, ``/dev/vfio/*`` on v5e and later)."""
    return sorted(glob.glob("/dev/accel*") + [p for p in glob.glob("/dev/vfio/*") if not p.endswith("/vfio")])


def _jax() -> Any:
    """JAX, imported on first use; in interpreter mode on its CPU platform only (libtpu, if installed,
    is then never initialised: no device search, no metadata-server queries)."""
    if interpret_requested():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    import jax

    return jax


class TpuServices(DeviceServices):
    """Host tensors outside the step; a jax device (a TPU, or the CPU in interpreter mode) inside it."""

    def __init__(self, *, interpret: bool) -> None:
        super().__init__(HOST)
        self.interpret = interpret

    def jax_device(self) -> Any:
        """The jax device steps run on."""
        jax = _jax()
        return jax.devices("cpu" if self.interpret else "tpu")[0]

    def memory_info(self) -> tuple[int, int]:
        """The device's memory from the jax runtime (``memory_stats``); the host's in interpreter mode."""
        if self.interpret:
            return super().memory_info()
        stats = self.jax_device().memory_stats() or {}
        total = int(stats.get("bytes_limit", 0))
        if not total:
            return super().memory_info()
        return total - int(stats.get("bytes_in_use", 0)), total

    def default_dtype(self) -> str:
        return "float32" if self.interpret else "bfloat16"

    def jax_devices(self) -> list[Any]:
        """Every jax device of the mode's platform (an SPMD mesh takes the first N)."""
        return list(_jax().devices("cpu" if self.interpret else "tpu"))

    def compile_step(
        self,
        program: StepProgram,
        kv_caches: list[torch.Tensor],
        *,
        cache_dir: str | None = None,
        spmd: SpmdPlan | None = None,
    ) -> CompiledStep | None:
        """The step jitted per shape on one device, or with ``spmd`` over a mesh of ``spmd.size``.

        :raises ValueError: fewer devices than the plan's size (naming how many jax sees).
        """
        from plinth_tpu.compiled import JaxCompiledStep

        if spmd is None:
            return JaxCompiledStep(program, kv_caches, self.jax_device(), cache_dir)
        from plinth_tpu.spmd import make_mesh

        mesh = make_mesh(self.jax_devices(), spmd.size, interpret=self.interpret)
        return JaxCompiledStep(program, kv_caches, mesh.devices.flat[0], cache_dir, mesh=mesh, plan=spmd)


class TpuBackend(Backend):
    """Google TPUs (or Pallas' interpreter): static-shape compiled steps, ragged paged attention."""

    name = "tpu"
    version = __version__
    api_version = (1, 12)  # 1.5: static-shape steps; 1.12: SPMD tensor parallelism over a mesh
    description = "Google TPUs through JAX: Pallas ragged paged attention, XLA-compiled whole steps (static shapes)"

    def __init__(self) -> None:
        self._services: dict[bool, TpuServices] = {}

    def probe(self) -> Probe:
        if interpret_requested():
            if importlib.util.find_spec("jax") is None:
                return Probe(0, (f"{INTERPRET_ENV}=1, but jax is not installed",), INTERPRETER_DEVICE, True)
            reasons = (
                f"{INTERPRET_ENV}=1: the tpu backend's kernels run in Pallas' interpreter on JAX's CPU platform",
                "emulation: not a hardware certification",
            )
            return Probe(INTERPRETER_SCORE, reasons, INTERPRETER_DEVICE, emulation=True)
        if importlib.util.find_spec("libtpu") is None:
            return Probe(0, ("libtpu is not installed (pip install 'plinth-tpu[tpu]')",))
        files = tpu_device_files()
        if not files:
            return Probe(0, ("no TPU on this machine (no /dev/accel* or /dev/vfio/* device)",))
        try:
            devices = _jax().devices("tpu")
        except RuntimeError as e:  # the runtime could not open the chips (in use, permissions)
            return Probe(0, (f"libtpu found {len(files)} device file(s) but JAX could not open a TPU: {e}",))
        kind = devices[0].device_kind
        return Probe(HARDWARE_SCORE, (f"{len(devices)} x {kind} ({', '.join(files[:4])})",), kind)

    def _interpret(self) -> bool:
        return interpret_requested()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=frozenset({"float32", "bfloat16"}),
            kv_cache_dtypes=frozenset({"float32", "bfloat16"}),
            head_sizes=frozenset({64, 80, 96, 128}),
            block_sizes=(8, 16, 32),
            max_gqa_ratio=None,
            features=frozenset({"sliding_window", "logits_soft_cap"}),
            quant_formats=frozenset({"q8_0"}),
            kv_cache_layout=TPU_KV_LAYOUT,
            spmd=True,
        )

    def device_services(self) -> TpuServices:
        mode = self._interpret()
        if mode not in self._services:
            self._services[mode] = TpuServices(interpret=mode)
        return self._services[mode]

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        self.capabilities().require_attention(self.name, spec)
        _jax()
        from plinth_tpu.kernels import TpuAttention

        return TpuAttention(spec, TPU_KV_LAYOUT, interpret=self._interpret())

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        self.capabilities().require_gemm(self.name, dtype)
        _jax()
        from plinth_tpu.kernels import TpuGemm

        return TpuGemm(torch_dtype(dtype))

    def small_ops(self) -> SmallOps:
        _jax()
        from plinth_tpu.kernels import TpuSmallOps

        return TpuSmallOps()

    def step_buckets(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> StepBuckets:
        """Powers of two of tokens (from 16) and sequences (from 8); one block-table width (the
        context's), as the attention kernel walks only the pages a sequence has."""
        return StepBuckets.powers_of_two(
            max_tokens=max_tokens,
            max_seqs=max_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            min_tokens=MIN_TOKENS,
            min_seqs=min(MIN_SEQS, max_seqs),
            min_blocks_per_seq=max_blocks_per_seq,
        )
