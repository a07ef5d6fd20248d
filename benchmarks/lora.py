"""Multi-LoRA costs: the batched LoRA op (reference vs the cpu backend's) and batch-1 decode with an adapter.

    .venv/bin/python benchmarks/lora.py [--op] [--decode] [--threads 2] [--json OUT]

``--op``: one decoder layer's LoRA work (the fused q/k/v, o, fused gate/up and down projections:
a shrink and one expand per module) at SmolLM2-135M's shapes (hidden 576, 9 heads of 64 / 3 KV heads,
intermediate 1536), ranks 8/16/64, T = 1/8/64/512 tokens with a mix of adapters (T=1: one; T=8: a
decode batch of four adapters and none, interleaved; T>=64: four sequences, adapters 0, 1, none, 2),
median of repeats; the base layer's GEMMs at the same T are timed beside it for scale.

``--decode``: batch-1 decode tokens/s of the default model (SmolLM2-135M Q4_1 GGUF, cpu backend,
fp32) in one LoRA-enabled engine, with no adapter (its decode steps replay step graphs) and with a
random rank-16 adapter on every module (eager steps), alternating, median of rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
RANKS = (8, 16, 64)
TOKENS = (1, 8, 64, 512)
MAX_LORAS = 4


def _slots(t: int) -> list[int]:
    if t == 1:
        return [0]
    if t == 8:
        return [0, 1, 2, -1, 0, 1, 2, -1]
    per = t // 4
    return [s for s in (0, 1, -1, 2) for _ in range(per)]


def _timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_op(repeats: int) -> list[dict[str, Any]]:
    """Per (rank, T): ms per layer of LoRA for the reference and cpu ops, and the base GEMMs'."""
    from plinth.model.lora import LoRALayer
    from plinth.platform.reference import ReferenceLoRA
    from plinth.platform.values import LoRASpec
    from plinth_cpu.backend import CpuBackend

    cpu = torch.device("cpu")
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = [
        (HIDDEN, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]),
        (q, [("o_proj", HIDDEN)]),
        (HIDDEN, [("gate_proj", INTER), ("up_proj", INTER)]),
        (INTER, [("down_proj", HIDDEN)]),
    ]
    gemm = CpuBackend().gemm_kernels("float32")
    base = [gemm.prepare(torch.randn(sum(n for _, n in sl), k) * 0.02, None) for k, sl in shapes]
    rows = []
    for rank in RANKS:
        spec = LoRASpec(max_loras=MAX_LORAS, max_rank=rank)
        ops = {"reference": ReferenceLoRA(spec), "cpu": CpuBackend().lora_kernels(spec)}
        layers: dict[str, list[LoRALayer]] = {}
        for name, op in ops.items():
            layers[name] = []
            for k, sl in shapes:
                layer = LoRALayer(op, k, sl, torch.float32, cpu)
                for slot in range(MAX_LORAS):
                    for module, n in sl:
                        layer.write(slot, module, torch.randn(rank, k) * 0.02, torch.randn(n, rank) * 0.02)
                layers[name].append(layer)
        for t in TOKENS:
            xs = [torch.randn(t, k) for k, _ in shapes]
            ys = [torch.zeros(t, sum(n for _, n in sl)) for _, sl in shapes]
            slots = _slots(t)
            row: dict[str, Any] = {"rank": rank, "tokens": t}
            for name, op in ops.items():

                def run(op: Any = op, mine: list[LoRALayer] = layers[name], slots: list[int] = slots) -> None:
                    batch = op.prepare_batch(slots, cpu)  # once per step, as the runner does
                    for layer, x, y in zip(mine, xs, ys, strict=True):  # noqa: B023 - run before the loop moves on
                        layer.apply(y, x, batch)

                reps = max(3, repeats // 10) if name == "reference" and t >= 64 else repeats
                row[f"{name}_ms"] = _timed(run, reps) * 1e3
            row["base_gemm_ms"] = (
                _timed(lambda xs=xs: [gemm.linear(x, w) for x, w in zip(xs, base, strict=True)], repeats) * 1e3
            )
            row["speedup"] = row["reference_ms"] / row["cpu_ms"]
            rows.append(row)
            print(
                f"rank {rank:2d} T {t:3d}: reference {row['reference_ms']:8.3f} ms, cpu {row['cpu_ms']:7.3f} ms "
                f"({row['speedup']:6.1f}x); base GEMMs {row['base_gemm_ms']:.3f} ms",
                file=sys.stderr,
            )
    return rows


def _random_adapter(folder: Path, config: Any, rank: int) -> None:
    """A PEFT folder with random A and B for every module of every layer of ``config``."""
    from safetensors.torch import save_file

    from plinth.model.lora import TARGET_MODULES, module_shape

    tensors = {}
    for i in range(config.num_layers):
        for module in TARGET_MODULES:
            out_f, in_f = module_shape(config, module)
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))


def bench_decode(rounds: int, threads: int) -> dict[str, Any]:
    """Batch-1 decode tok/s of the default model without and with a rank-16 adapter (one engine)."""
    from plinth import LLM, SamplingParams

    llm = LLM(backend="cpu", dtype="float32", num_threads=threads, enable_lora=True, max_lora_rank=16)
    with tempfile.TemporaryDirectory() as tmp:
        _random_adapter(Path(tmp) / "a", llm.engine.model_config, 16)
        llm.add_lora("a", str(Path(tmp) / "a"))
    prompt = list(range(1000, 1032))  # 32 tokens
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

    def decode_tok_s(lora: str | None) -> float:
        out = llm.generate([prompt], params, lora=lora)[0]
        m = out.metrics
        assert m.first_token_time is not None and m.last_token_time is not None
        return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)

    results: dict[str, list[float]] = {"none": [], "adapter": []}
    decode_tok_s(None), decode_tok_s("a")  # warm-up: graph captures, first touches
    for r in range(rounds):
        for name in ("none", "adapter") if r % 2 == 0 else ("adapter", "none"):
            value = decode_tok_s(None if name == "none" else "a")
            results[name].append(value)
            print(f"decode {name}: {value:.1f} tok/s", file=sys.stderr)
    medians = {k: statistics.median(v) for k, v in results.items()}
    from plinth.model.lora import lora_layers

    slot_bytes = sum(
        (h.a[0].numel() + sum(b[0].numel() for b in h.b)) * h.a.element_size() for _, h in lora_layers(llm.engine.model)
    )
    print(f"one adapter slot (rank 16, every module, fp32): {slot_bytes / 2**20:.1f} MiB", file=sys.stderr)
    return {
        "runs": results,
        "median_tok_s": medians,
        "ratio": medians["adapter"] / medians["none"],
        "slot_mib": slot_bytes / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", action="store_true", help="the op: reference vs cpu")
    p.add_argument("--decode", action="store_true", help="batch-1 decode with and without an adapter")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"threads": args.threads}
    if args.op or not args.decode:
        out["op"] = bench_op(args.repeats)
        print("\n| rank | T | reference ms | cpu ms | reference / cpu | base GEMMs ms |\n|---|---|---|---|---|---|")
        for r in out["op"]:
            print(
                f"| {r['rank']} | {r['tokens']} | {r['reference_ms']:.3f} | {r['cpu_ms']:.3f} | "
                f"{r['speedup']:.1f}x | {r['base_gemm_ms']:.3f} |"
            )
    if args.decode or not args.op:
        out["decode"] = bench_decode(args.rounds, args.threads)
        d = out["decode"]["median_tok_s"]
        print(f"\nbatch-1 decode: no adapter {d['none']:.1f} tok/s, rank-16 adapter {d['adapter']:.1f} tok/s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
