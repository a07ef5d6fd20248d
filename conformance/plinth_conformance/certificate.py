"""Certificates: what was run, on what, with which result, as JSON plus a Markdown summary.

A certificate always says what the backend ran on: ``hardware``, ``emulation`` (the probe says
the code ran on a device it was not written for) or ``interpreter`` (a kernel language's
interpreter, e.g. ``TRITON_INTERPRET=1``). Emulation is never reported as hardware certification.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plinth_conformance import SUITE_VERSION, TIERS
from plinth_conformance.coverage import covered
from plinth_conformance.tolerance import POLICY

if TYPE_CHECKING:
    import pytest

    from plinth_conformance.plugin import SuiteState

#: Environment variables that mean kernels run in an interpreter, not compiled for the device.
INTERPRETER_ENV: dict[str, str] = {"TRITON_INTERPRET": "1", "PLINTH_INTERPRET": "1", "PLINTH_TPU_INTERPRET": "1"}


def cpu_model() -> str:
    """The host CPU's name (/proc/cpuinfo "model name"), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return value.strip()
    except OSError:  # no /proc (not Linux): platform's answer is all there is
        return platform.processor() or platform.machine() or "unknown"
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> list[float] | None:
    """The host's 1, 5 and 15 minute load averages (perf numbers on a busy host read low), if known."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # not on this platform
        return None


def isa_flags() -> list[str]:
    """The SIMD extensions /proc/cpuinfo names (AVX2/FMA, AVX-512, AMX): kernels dispatch on them, so
    a certificate from an AVX2-only host says nothing about the AVX-512 or AMX paths."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux: unknown, said as such
        return []
    return [w for w in wanted if w in flags]


def host_fingerprint() -> dict[str, Any]:
    """CPU, core count, load, OS, Python and torch versions of the machine the suite ran on."""
    import torch

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "isa": isa_flags(),
        "load_average": load_average(),
        "torch_threads": torch.get_num_threads(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def interpreter_flags() -> list[str]:
    """The ``NAME=value`` settings that put kernels in an interpreter, as found in the environment."""
    return [f"{k}={v}" for k, v in INTERPRETER_ENV.items() if os.environ.get(k, "").lower() == v]


def tier_status(state: SuiteState, tier: str) -> str:
    """``passed``, ``failed``, ``skipped`` (all skipped) or ``not run``."""
    if tier not in state.tiers:
        return "not run"
    counts = state.counts.get(tier)
    if state.error:
        return "failed"
    if not counts:
        return "not run"
    if counts["failed"]:
        return "failed"
    return "passed" if counts["passed"] else "skipped"


def tier_table(state: SuiteState) -> list[str]:
    """Terminal lines: one per tier with counts and seconds."""
    lines = [f"{'tier':<11} {'status':<8} {'passed':>6} {'failed':>6} {'skipped':>7} {'seconds':>8}"]
    for tier in TIERS:
        c = state.counts.get(tier, {"passed": 0, "failed": 0, "skipped": 0})
        lines.append(
            f"{tier:<11} {tier_status(state, tier):<8} {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} "
            f"{state.seconds.get(tier, 0.0):>8.1f}"
        )
    return lines


def _caps_dict(caps: Any) -> dict[str, Any]:
    return {
        "dtypes": sorted(caps.dtypes),
        "kv_cache_dtypes": sorted(caps.kv_cache_dtypes),
        "head_sizes": _ranges(sorted(caps.head_sizes)),
        "block_sizes": list(caps.block_sizes),
        "max_gqa_ratio": caps.max_gqa_ratio,
        "features": sorted(caps.features),
        "quant_formats": sorted(caps.quant_formats),
        "kv_cache_layout": list(caps.kv_cache_layout.dims),
        "fused_moe": _moe_dict(getattr(caps, "fused_moe", None)),
    }


def _moe_dict(moe: Any) -> dict[str, Any] | None:
    """The declared fused-MoE op (plugin API 1.8), or None where the backend supplies none."""
    if moe is None:
        return None
    return {
        "dtypes": sorted(moe.dtypes),
        "quant_formats": sorted(moe.quant_formats),
        "max_experts": moe.max_experts,
        "max_top_k": moe.max_top_k,
        "activations": sorted(moe.activations),
    }


def _ranges(values: list[int]) -> str:
    """``16-512 step 8`` style compression of a sorted integer list (head sizes can be hundreds)."""
    if len(values) <= 6:
        return ", ".join(map(str, values))
    steps = {b - a for a, b in zip(values, values[1:], strict=False)}
    if len(steps) == 1:
        step = steps.pop()
        return f"{values[0]}-{values[-1]}" + (f" step {step}" if step != 1 else "")
    return ", ".join(map(str, values))


def _tolerance_summary(state: SuiteState) -> dict[str, Any]:
    by_dtype: dict[str, dict[str, float]] = {}
    for t in state.tolerances:
        d = by_dtype.setdefault(t["dtype"], {"cases": 0, "max_tol_rel": 0.0, "max_rel": 0.0, "max_tol_max": 0.0})
        d["cases"] += 1
        d["max_tol_rel"] = max(d["max_tol_rel"], t.get("tol_rel", 0.0))
        d["max_rel"] = max(d["max_rel"], t.get("rel", 0.0))
        d["max_tol_max"] = max(d["max_tol_max"], t.get("tol_max", 0.0))
    cases = [
        {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in t.items() if k != "naive_rel"}
        for t in state.tolerances
    ]
    return {"policy": POLICY.as_dict(), "by_dtype": by_dtype, "cases": cases}


def _quantized_summary(state: SuiteState) -> dict[str, Any]:
    """Per declared format: the activation roundings the outputs matched (suite 1.3: modelled
    exactly), the worst relative error against that rounding's fp64 product, the largest rounding-tie
    allowance (relative), and the bytes prepared weights hold per byte of GGUF blocks."""
    metrics = {t["case"]: t for t in state.tolerances}
    by_format: dict[str, dict[str, Any]] = {}
    for q in state.quantized:
        empty = {"cases": 0, "prepared_per_block_byte": 0.0, "prepared_formats": [], "activation_roundings": []}
        d = by_format.setdefault(q["format"], {**empty, "max_raw_rel": 0.0, "max_tie_allowance_rel": 0.0})
        d["cases"] += 1
        ratio = q["prepared_bytes"] / q["blocks_bytes"] if q["blocks_bytes"] else 0.0
        d["prepared_per_block_byte"] = round(max(d["prepared_per_block_byte"], ratio), 3)
        if q["prepared_format"] not in d["prepared_formats"]:
            d["prepared_formats"].append(q["prepared_format"])
        rounding = q.get("activation_rounding") or "none matched"
        if rounding not in d["activation_roundings"]:
            d["activation_roundings"].append(rounding)
        m = metrics.get(q["case"], {})
        d["max_raw_rel"] = float(f"{max(d['max_raw_rel'], m.get('raw_rel', 0.0)):.3g}")
        d["max_tie_allowance_rel"] = float(f"{max(d['max_tie_allowance_rel'], m.get('allowance_rel', 0.0)):.3g}")
    return {"by_format": by_format, "weights": state.quantized}


def _command(state: SuiteState, keyword: str | None) -> str:
    """The ``plinth conformance`` command equivalent to this session (host paths left out)."""
    cmd = f"plinth conformance --backend {state.backend_name} --tier {state.tier_choice}"
    return cmd + (f" -k {keyword!r}" if keyword else "")


def build_certificate(state: SuiteState, keyword: str | None = None) -> dict[str, Any]:
    """The certificate of a finished session (``keyword``: the ``-k`` selection, if any)."""
    status = state.status
    backend = status.backend if status is not None else None
    probe = status.probe if status is not None else None
    interp = interpreter_flags()
    emulation = bool(probe.emulation) if probe is not None else False
    tiers = {
        t: {
            "status": tier_status(state, t),
            **state.counts.get(t, {"passed": 0, "failed": 0, "skipped": 0}),
            "seconds": round(state.seconds.get(t, 0.0), 1),
        }
        for t in TIERS
    }
    passed = not state.error and state.exitstatus == 0 and all(tiers[t]["status"] != "failed" for t in TIERS)
    return {
        "suite_version": SUITE_VERSION,
        "created": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "command": _command(state, keyword),
        "result": "passed" if passed else "failed",
        "tier_selection": state.tier_choice,
        "note": state.note,
        "backend": {
            "name": state.backend_name,
            "version": getattr(backend, "version", None),
            "api_version": ".".join(map(str, getattr(backend, "api_version", ()))),
            "description": getattr(backend, "description", ""),
            "error": state.error,
        },
        "plugin": {
            "entry_point": status.plugin.name if status is not None else None,
            "distribution": status.plugin.dist_name if status is not None else None,
            "version": status.plugin.dist_version if status is not None else None,
            "module": status.plugin.module if status is not None else None,
        },
        "capabilities": _caps_dict(backend.capabilities()) if backend is not None else None,
        "device": {
            "name": probe.device_name if probe is not None else None,
            "probe_score": probe.score if probe is not None else None,
            # the backend's own account of what runs (the cpu backend names its native ISA build)
            "probe_reasons": list(probe.reasons) if probe is not None else [],
            "emulation": emulation,
            "interpreter": bool(interp),
            "interpreter_env": interp,
            "verified_on": "interpreter" if interp else "emulation" if emulation else "hardware",
        },
        "host": host_fingerprint(),
        "tiers": tiers,
        "tolerances": _tolerance_summary(state),
        "quantized": _quantized_summary(state),
        "perf": {"roofline": state.roofline, "kernels": state.perf},
        "coverage": covered(state.covered, backend.capabilities() if backend is not None else None),
        "failures": state.failures,
    }


def summary_markdown(cert: dict[str, Any]) -> str:
    """A human-readable page of a certificate."""
    b, dev, host = cert["backend"], cert["device"], cert["host"]
    lines = [
        f"# Conformance: backend `{b['name']}` — {cert['result'].upper()}",
        "",
        f"- suite {cert['suite_version']}, {cert['created']}",
        f"- backend {b['name']} {b['version']} (plugin API {b['api_version']}), distribution "
        f"{cert['plugin']['distribution']} {cert['plugin']['version']}",
        f"- device: {dev['name']} — verified on **{dev['verified_on']}**"
        + (f" ({', '.join(dev['interpreter_env'])})" if dev["interpreter_env"] else ""),
        f"- host: {host['cpu_model']}, {host['cpu_count']} cores, {host['os']}, torch {host['torch']}"
        + (f", load average {' / '.join(map(str, load))}" if (load := host.get("load_average")) else "")
        + (f", ISA {' '.join(host['isa'])}" if host.get("isa") else "")
        + (f" ({host['note']})" if host.get("note") else ""),
        *([f"- probe: {'; '.join(dev['probe_reasons'])}"] if dev.get("probe_reasons") else []),
        *([f"- note: {cert['note']}"] if cert.get("note") else []),
        "",
        "| tier | status | passed | failed | skipped | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for tier, t in cert["tiers"].items():
        lines.append(f"| {tier} | {t['status']} | {t['passed']} | {t['failed']} | {t['skipped']} | {t['seconds']} |")
    tol = cert["tolerances"]
    if tol["by_dtype"]:
        p = tol["policy"]
        lines += [
            "",
            f"Tolerances: {p['factor']:g}x the naive same-dtype error; floors (relative/element/max) "
            f"{p['rel_floor_out_eps']:g}/{p['elem_floor_out_eps']:g}/{p['max_floor_out_eps']:g} eps of the output "
            f"dtype + {p['rel_floor_acc_eps']:g}/{p['elem_floor_acc_eps']:g}/{p['max_floor_acc_eps']:g} "
            f"sqrt(n) eps of the accumulator; element pass rate >= {p['min_pass_rate']:.0%}.",
            "",
            "| dtype | cases | worst relative error | largest relative threshold |",
            "|---|---|---|---|",
        ]
        for dtype, d in tol["by_dtype"].items():
            lines.append(f"| {dtype} | {d['cases']} | {d['max_rel']:.2e} | {d['max_tol_rel']:.2e} |")
    quant = (cert.get("quantized") or {}).get("by_format") or {}
    if quant:
        lines += [
            "",
            "Quantized GEMM: the activation rounding each output matched (the oracle models none, int16, "
            "int8 and int8 with an fp16 scale exactly), the worst relative error against that rounding's "
            "fp64 product with the dequantized weight, and the largest rounding-tie allowance (one "
            "quantum on activations within fp32 rounding of a half-way point; relative to the output). "
            "Bytes the prepared weight holds per byte of GGUF blocks (not gated; a dense fp32 copy holds "
            "3.76 for q8_0, 6.4 for q4_1).",
            "",
            "| format | cases | activation rounding | worst relative error | tie allowance | "
            "prepared / block bytes | prepared as |",
            "|---|---|---|---|---|---|---|",
        ]
        for fmt, q in quant.items():
            lines.append(
                f"| {fmt} | {q['cases']} | {', '.join(q['activation_roundings'])} | {q['max_raw_rel']:.2e} | "
                f"{q['max_tie_allowance_rel']:.1e} | "
                f"{q['prepared_per_block_byte']:.2f} | {', '.join(q['prepared_formats'])} |"
            )
    perf = cert["perf"]
    if perf["kernels"]:
        roof = perf["roofline"]
        lines += [
            "",
            f"Perf (not gated): read bandwidth {roof.get('read_gbps', 0):.1f} GB/s, "
            f"fp32 GEMM peak {roof.get('gemm_gflops', 0):.1f} GFLOP/s (measured in the same run).",
            "",
            "| kernel | shape | time (ms) | achieved | % of roofline |",
            "|---|---|---|---|---|",
        ]
        for k in perf["kernels"]:
            lines.append(
                f"| {k['name']} | {k['shape']} | {k['ms']:.3f} | {k['achieved']:.1f} {k['unit']} | "
                f"{k['percent']:.1f}% of {k['bound']} |"
            )
    lines += _coverage_lines(cert.get("coverage") or {})
    if cert["failures"]:
        lines += ["", "## Failures", ""]
        for f in cert["failures"]:
            lines.append(f"- `{f['case']}` ({f['tier']}, seed {f['seed']}): {f['message']}  \n  re-run: `{f['rerun']}`")
    return "\n".join(lines) + "\n"


def _coverage_lines(cov: dict[str, Any]) -> list[str]:
    """What the passed cases exercised: capability values, shapes and path classes."""
    if not cov:
        return []
    lines = ["", 'Exercised by passed cases (what "passed" covers):', ""]
    for key in (
        "dtype_pairs",
        "head_sizes",
        "block_sizes",
        "gqa_groups",
        "kv_heads",
        "batch_kinds",
        "value_regimes",
        "sliding_windows",
        "soft_caps",
        "gemm_shapes",
        "quant_shapes",
    ):
        if cov.get(key):
            values = cov[key]
            text = _ranges(values) if key == "head_sizes" else ", ".join(map(str, values))
            lines.append(f"- {key.replace('_', ' ')}: {text}")
    if cov.get("path_classes"):
        lines.append("- path classes (cases): " + ", ".join(f"{k} ({n})" for k, n in cov["path_classes"].items()))
    missing = cov.get("declared_not_exercised") or {}
    lines.append(
        "- declared but not exercised: "
        + ("; ".join(f"{k} {_ranges(v) if k == 'head_sizes' else v}" for k, v in missing.items()) or "none")
    )
    return lines


def write_reports(state: SuiteState, config: pytest.Config) -> Path:
    """Write ``certificate.json`` and ``summary.md`` into the report directory; returns the JSON path."""
    assert state.report_dir is not None
    state.report_dir.mkdir(parents=True, exist_ok=True)
    cert = build_certificate(state, config.getoption("keyword") or None)
    path = state.report_dir / "certificate.json"
    path.write_text(json.dumps(cert, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    (state.report_dir / "summary.md").write_text(summary_markdown(cert), encoding="utf-8")
    return path
