"""The limits ``plinth bench`` holds the engine to, measured in the same process as the engine's own
figures: read bandwidth over a large buffer (DRAM), the speed of streaming the model's own linear
weights in place (what batch-1 decode must read per token, partly from cache on a host whose last-level
cache holds much of the model), and the device's GEMM peak (what prefill is compute-bound by)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from plinth.platform.backend import Backend, DeviceServices

#: Bytes each read-bandwidth probe reads: far beyond any last-level cache.
PROBE_BYTES = 256 << 20
#: The read probes take fp32 tensors whose length is a multiple of this many floats
#: (:meth:`~plinth.platform.backend.DeviceServices.read_probes`).
PROBE_FLOATS = 4096


def read_bandwidth_probes(
    services: DeviceServices, nbytes: int = PROBE_BYTES, repeats: int = 5, buffer: Any = None
) -> dict[str, float]:
    """GB/s of reading ``nbytes`` (best of ``repeats``) by each of the backend's read probes
    (:meth:`~plinth.platform.backend.DeviceServices.read_probes`: torch's ``sum``, and the loads the
    backend's own GEMV makes where it offers them). The largest is the limit decode is held to.
    ``buffer`` (fp32 on the services' device, a multiple of 4096 floats) is read instead of a fresh
    ``nbytes`` one, so repeated probes do not allocate and fault in 256 MB each."""
    x = buffer if buffer is not None else probe_buffer(services, nbytes)
    return _stream_gbps(services, WeightStream(blocks=(x,), rest=()), repeats)


def probe_buffer(services: DeviceServices, nbytes: int = PROBE_BYTES) -> Any:
    """An fp32 buffer of ``nbytes`` (rounded down to 4096 floats) on the services' device, written
    once, for :func:`read_bandwidth_probes`."""
    import torch

    return torch.ones(nbytes // 4 // PROBE_FLOATS * PROBE_FLOATS, dtype=torch.float32, device=services.device)


# -- the model's own weights -------------------------------------------------------------------------


def weight_tensors(model: Any) -> list[torch.Tensor]:
    """The tensors of every linear weight a batch-1 decode step reads, in the model's module order
    (its forward order): each prepared weight's dense tensor or backend blocks (``LinearWeight.data``)
    and its bias. The embedding contributes one row per token, so it is left out."""
    import torch

    from plinth.model.layers import Linear

    tensors = []
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            w = module.weight
            tensors += [t for t in (w.weight, w.bias, *w.data.values()) if isinstance(t, torch.Tensor)]
    return tensors


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of weights a batch-1 decode step must read: every linear weight (dense or quantized
    blocks) once (:func:`weight_tensors`)."""
    return sum(t.numel() * t.element_size() for t in weight_tensors(model))


@dataclass(frozen=True, slots=True)
class WeightStream:
    """Tensors to read in place, cut for the read probes: ``blocks`` are fp32 views whose length is a
    multiple of :data:`PROBE_FLOATS` (what every probe takes), ``rest`` the bytes no block holds (a
    tensor's tail under 16 KiB, a few bytes before its first 4-byte boundary, a tensor that is not
    contiguous or lives elsewhere), which torch's ``sum`` reads. Together they cover every byte once."""

    blocks: tuple[torch.Tensor, ...]
    rest: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor], device: torch.device) -> WeightStream:
        """The bytes of ``tensors``, in order, each viewed as it is stored (no copy)."""
        import torch

        chunk = PROBE_FLOATS * 4
        blocks: list[torch.Tensor] = []
        rest: list[torch.Tensor] = []
        for t in tensors:
            if t.numel() == 0:
                continue
            if not t.is_contiguous() or not _on(t, device):
                rest.append(t)
                continue
            b = t.detach().reshape(-1).view(torch.uint8)  # its bytes, in place
            head = min((-b.storage_offset()) % 4, b.numel())  # an fp32 view starts on a 4-byte boundary
            body = (b.numel() - head) // chunk * chunk
            tail = b[head + body :]
            aligned = tail.numel() // 4 * 4
            if body:
                blocks.append(b[head : head + body].view(torch.float32))
            rest += [p for p in (b[:head], tail[:aligned].view(torch.float32), tail[aligned:]) if p.numel()]
        return cls(tuple(blocks), tuple(rest))

    @property
    def nbytes(self) -> int:
        """Bytes one pass reads."""
        return sum(t.numel() * t.element_size() for t in (*self.blocks, *self.rest))


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """``t`` is on ``device``; a device named without an index (the services' usual form) matches
    every index of its type."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def weight_stream(model: Any, services: DeviceServices) -> WeightStream:
    """The model's linear weights (:func:`weight_tensors`), in place, as the read probes take them."""
    return WeightStream.of(weight_tensors(model), services.device)


def weight_stream_probes(services: DeviceServices, stream: WeightStream, repeats: int = 3) -> dict[str, float]:
    """GB/s of whole passes over ``stream`` (best of ``repeats``, after one unmeasured pass) by each
    read probe: the blocks through the probe in order, then the rest through torch. A pass reads what
    one batch-1 decode step must, from wherever the host's caches keep it, so ``1 / pass time`` is
    the decode speed streaming the weights allows (``GB/s * 1e9 / stream.nbytes`` tok/s)."""
    return _stream_gbps(services, stream, repeats)


def _stream_gbps(services: DeviceServices, stream: WeightStream, repeats: int) -> dict[str, float]:
    results = {}
    for name, probe in services.read_probes().items():

        def read(probe: Callable[[Any], object] = probe) -> None:
            for x in stream.blocks:
                probe(x)
            for x in stream.rest:
                x.sum()

        results[name] = stream.nbytes / _best(read, services, repeats) / 1e9
    return results


# -- GEMM peak -------------------------------------------------------------------------------------


#: The square shape of every GEMM-peak measurement, beside the model's own.
PEAK_SQUARE = (2048, 2048, 2048)


def gemm_peak(
    services: DeviceServices,
    shapes: Sequence[tuple[int, int, int]],
    dtypes: Sequence[str] = ("bfloat16", "float32"),
    repeats: int = 5,
    budget_s: float = 3.0,
    backend: Backend | None = None,
) -> dict[str, dict[str, float]]:
    """GFLOP/s of torch's ``F.linear`` (``x`` [M, K] times ``w`` [N, K] transposed) for each
    ``(M, K, N)`` of ``shapes`` in each dtype, on the services' device with the threads the engine set:
    the best of ``repeats`` calls after one warm-up (fewer when a shape's calls pass ``budget_s``: a
    dtype without hardware support runs slowly). With ``backend``, also its own GEMM kernels for each
    dtype it offers (:meth:`~plinth.platform.backend.Backend.gemm_kernels`, the weight prepared once
    as a model's is), under ``"MxKxN <backend name>"``: torch is not always the faster (on the cpu
    backend's fp32, its panel kernels are). ``{dtype: {"MxKxN": GFLOP/s, ...}}``; a dtype's peak is
    its largest figure."""
    import torch
    import torch.nn.functional as F

    from plinth.platform.backend import NotSupported

    results: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        figures = results.setdefault(dtype, {})
        try:
            gemm = backend.gemm_kernels(dtype) if backend is not None else None
        except NotSupported:
            gemm = None
        for m, k, n in shapes:
            x = torch.randn(m, k, device=services.device).to(getattr(torch, dtype))
            w = torch.randn(n, k, device=services.device).to(getattr(torch, dtype))
            calls: dict[str, Callable[[], object]] = {f"{m}x{k}x{n}": functools.partial(F.linear, x, w)}
            if gemm is not None and backend is not None:
                calls[f"{m}x{k}x{n} {backend.name}"] = functools.partial(gemm.linear, x, gemm.prepare(w, None))
            for name, fn in calls.items():
                figures[name] = 2 * m * k * n / _best(fn, services, repeats, budget_s) / 1e9
    return results


def _best(fn: Callable[[], object], services: DeviceServices, repeats: int, budget_s: float = float("inf")) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after one warm-up, each synchronized (an
    accelerator's work has finished when the clock stops); fewer once they have taken ``budget_s``."""

    def call() -> None:
        fn()
        services.synchronize()

    call()
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        t = _timed(call)
        best, spent = min(best, t), spent + t
        if spent > budget_s:
            break
    return best


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
