"""Performance and end-to-end checks that ``scripts/gpu-check.sh`` runs on a GPU machine.

* ``perf``: decode attention at long context as a share of the device's memory bandwidth (measured
  in the same run by a copy-bandwidth probe), and the bf16 GEMM against ``torch.matmul`` on a
  model's projection shapes; the numbers go to a markdown file (``docs/gpu-perf.md``).
* ``e2e``: greedy tokens of a tiny random Llama on the backend vs the reference backend.

Everything takes a backend name and sizes, so the same code runs in Triton's interpreter on tiny
shapes in the test lane (``--tiny``); only the numbers are meaningless there.

    python -m plinth_cuda.perfcheck perf --backend cuda --out docs/gpu-perf.md
    python -m plinth_cuda.perfcheck e2e --backend cuda
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from plinth.platform.backend import AttentionMetadata, AttentionSpec, Backend, DeviceServices, torch_dtype
from plinth.platform.host import PluginHost


@dataclass(frozen=True, slots=True)
class Sizes:
    """What to measure. ``HARDWARE`` is Llama-3-8B's attention and projections; ``TINY`` is for CI."""

    copy_bytes: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    batch: int
    context: int
    hidden: int
    gemm_out: tuple[tuple[str, int, int], ...]  # (name, N, K)
    gemm_m: tuple[int, ...]
    dtype: str
    reps: int


HARDWARE = Sizes(
    copy_bytes=1 << 30,
    num_heads=32,
    num_kv_heads=8,
    head_size=128,
    block_size=16,
    batch=8,
    context=16384,
    hidden=4096,
    gemm_out=(("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)),
    gemm_m=(1, 16, 256, 2048),
    dtype="bfloat16",
    reps=20,
)
TINY = Sizes(
    copy_bytes=1 << 20,
    num_heads=4,
    num_kv_heads=2,
    head_size=16,
    block_size=16,
    batch=2,
    context=40,
    hidden=32,
    gemm_out=(("qkv", 64, 32),),
    gemm_m=(3,),
    dtype="float32",
    reps=1,
)


def timed(fn: Callable[[], object], services: DeviceServices, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up, synchronized around each."""
    fn()
    times = []
    for _ in range(reps):
        services.synchronize()
        t0 = time.perf_counter()
        fn()
        services.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(services: DeviceServices, nbytes: int, reps: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted): the roofline the kernels are held to."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=services.device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), services, reps)


def decode_attention(backend: Backend, sizes: Sizes) -> tuple[float, float]:
    """``(seconds, bytes read)`` of one decode step: ``batch`` sequences of ``context`` tokens."""
    services = backend.device_services()
    spec = AttentionSpec(
        sizes.num_heads,
        sizes.num_kv_heads,
        sizes.head_size,
        sizes.block_size,
        dtype=sizes.dtype,
        kv_cache_dtype=sizes.dtype,
    )
    kernels = backend.attention_kernels(spec)
    dev, dtype = services.device, torch_dtype(sizes.dtype)
    per_seq = -(-sizes.context // sizes.block_size)
    cache = backend.allocate_kv_cache(spec, sizes.batch * per_seq + 1)
    cache.normal_()
    tables = (torch.randperm(sizes.batch * per_seq, device=dev) + 1).view(sizes.batch, per_seq).to(torch.int32)
    meta = AttentionMetadata.from_lengths(
        [1] * sizes.batch,
        [sizes.context] * sizes.batch,
        tables,
        slot_mapping=torch.zeros(sizes.batch, dtype=torch.int64),
        device=dev,
    )
    query = torch.randn(sizes.batch, sizes.num_heads, sizes.head_size, dtype=dtype, device=dev)
    seconds = timed(lambda: kernels.forward(query, cache, meta, sizes.head_size**-0.5), services, sizes.reps)
    kv_bytes = 2 * sizes.batch * sizes.context * sizes.num_kv_heads * sizes.head_size * dtype.itemsize
    return seconds, kv_bytes


def gemm_vs_torch(backend: Backend, sizes: Sizes) -> list[tuple[str, int, int, int, float, float]]:
    """``(name, M, N, K, triton seconds, torch.matmul seconds)`` for each projection shape and M."""
    services = backend.device_services()
    gemm = backend.gemm_kernels(sizes.dtype)
    dev, dtype = services.device, torch_dtype(sizes.dtype)
    rows = []
    for name, n, k in sizes.gemm_out:
        w = torch.randn(n, k, dtype=dtype, device=dev) / k**0.5
        prepared = gemm.prepare(w, None)
        for m in sizes.gemm_m:
            x = torch.randn(m, k, dtype=dtype, device=dev)
            ours = timed(functools.partial(gemm.linear, x, prepared), services, sizes.reps)
            theirs = timed(functools.partial(torch.matmul, x, w.t()), services, sizes.reps)
            rows.append((name, m, n, k, ours, theirs))
    return rows


def perf_report(backend_name: str, sizes: Sizes, host: PluginHost | None = None) -> str:
    """Run the perf checks on ``backend_name`` and return them as markdown."""
    status = (host or PluginHost()).select(backend_name)
    backend = status.backend
    services = backend.device_services()
    bandwidth = copy_bandwidth(services, sizes.copy_bytes, sizes.reps)
    seconds, kv_bytes = decode_attention(backend, sizes)
    attn_bw = kv_bytes / seconds
    device = status.probe.device_name if status.probe else "?"
    lines = [
        f"# GPU performance: {backend_name} on {device}",
        "",
        f"Measured by `scripts/gpu-check.sh` ({datetime.date.today().isoformat()}, torch {torch.__version__}); "
        f"emulation: {bool(status.probe and status.probe.emulation)}.",
        "",
        "## Decode attention at long context",
        "",
        f"Copy-bandwidth probe ({sizes.copy_bytes >> 20} MiB copy, read + write): **{attn_fmt(bandwidth)}**.",
        "",
        "| batch | context | heads / kv heads / head size | dtype | time | K/V read | share of copy bandwidth |",
        "|---|---|---|---|---|---|---|",
        f"| {sizes.batch} | {sizes.context} | {sizes.num_heads} / {sizes.num_kv_heads} / {sizes.head_size} | "
        f"{sizes.dtype} | {seconds * 1e6:.1f} us | {attn_fmt(attn_bw)} | {100 * attn_bw / bandwidth:.0f}% |",
        "",
        "## GEMM vs torch.matmul",
        "",
        "| projection | M | N | K | Triton | torch.matmul | Triton / torch speed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m, n, k, ours, theirs in gemm_vs_torch(backend, sizes):
        timing = f"{ours * 1e6:.1f} us | {theirs * 1e6:.1f} us | {theirs / ours:.2f}"
        lines.append(f"| {name} | {m} | {n} | {k} | {timing} |")
    return "\n".join(lines) + "\n"


def attn_fmt(bytes_per_s: float) -> str:
    """GB/s with one decimal."""
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def greedy_tokens(backend_name: str, model: Path, max_tokens: int, dtype: str | None = None) -> list[list[int]]:
    """Greedy continuations of the conformance suite's prompts on ``backend_name``."""
    from plinth import LLM, SamplingParams
    from plinth_conformance.tiny_models import prompts

    llm = LLM(model=str(model), backend=backend_name, dtype=dtype, max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts(0, (5, 17, 33)), params)
    return [list(o.outputs[0].token_ids) for o in outs]


def e2e_check(backend_name: str, max_tokens: int = 8) -> tuple[bool, str]:
    """Greedy tokens of a tiny random Llama in fp32 on ``backend_name`` vs the reference backend."""
    from plinth_conformance.tiny_models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model("llama", Path(tmp) / "tiny-llama")
        want = greedy_tokens("reference", model, max_tokens)
        got = greedy_tokens(backend_name, model, max_tokens, dtype="float32")
    same = got == want
    return same, f"{backend_name} {'==' if same else '!='} reference: {got} vs {want}"


def main(argv: list[str] | None = None) -> int:
    """``perf`` or ``e2e``; exit status 1 when the end-to-end tokens differ."""
    parser = argparse.ArgumentParser(prog="python -m plinth_cuda.perfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["perf", "e2e"])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--out", default=None, help="markdown file for the perf numbers (default: stdout)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CI, interpreter)")
    args = parser.parse_args(argv)
    if args.check == "e2e":
        ok, message = e2e_check(args.backend)
        print(message)
        return 0 if ok else 1
    report = perf_report(args.backend, TINY if args.tiny else HARDWARE)
    if args.out:
        Path(args.out).write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
