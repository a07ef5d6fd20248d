"""Perf tier: kernel timings normalised to this machine's roofline, measured in the same run.

Two probes give the roofline: read bandwidth (a sum over a tensor far larger than the caches) and
fp32 GEMM peak (``torch.matmul`` of big square matrices). A bandwidth-bound kernel (decode
attention, batch-1 GEMM over the vocabulary, KV write) is reported as a share of the bandwidth, a
compute-bound one (prefill attention, batch-512 GEMM) as a share of the GEMM peak. Nothing here is
gated: the numbers go into the certificate and the summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

#: Bytes summed by the bandwidth probe: far beyond any last-level cache.
BANDWIDTH_PROBE_BYTES = 256 << 20
#: Side of the square fp32 matmul of the GEMM-peak probe.
GEMM_PROBE_SIZE = 1536


def best_time(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 5, budget_s: float = 2.0) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up (fewer when over ``budget_s``).

    The minimum, not the mean: on a shared machine noise only ever adds time.
    """
    fn()
    sync()
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def read_bandwidth_gbps(device: torch.device, sync: Callable[[], None]) -> float:
    """GB/s of a full read of a large fp32 tensor (``sum``)."""
    x = torch.ones(BANDWIDTH_PROBE_BYTES // 4, dtype=torch.float32, device=device)
    return BANDWIDTH_PROBE_BYTES / best_time(x.sum, sync) / 1e9


def gemm_peak_gflops(device: torch.device, sync: Callable[[], None]) -> float:
    """GFLOP/s of a large square fp32 ``torch.matmul``."""
    n = GEMM_PROBE_SIZE
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    return 2 * n**3 / best_time(lambda: torch.matmul(a, b), sync, repeats=3) / 1e9


def roofline(device: torch.device, sync: Callable[[], None]) -> dict[str, float]:
    """Both probes, as the certificate stores them."""
    return {"read_gbps": read_bandwidth_gbps(device, sync), "gemm_gflops": gemm_peak_gflops(device, sync)}
