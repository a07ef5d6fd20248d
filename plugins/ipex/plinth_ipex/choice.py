"""Which ops IPEX contributes: only those it was measured to run faster than the cpu backend's own.

The figures come from ``benchmarks/ipex.py``, which times IPEX's kernels and the cpu backend's side by
side in one process on SmolLM2-135M's shapes and writes them to ``measured.json`` (committed with the
plugin), one table per host kind. A host kind is the ISA level IPEX dispatches to on that host
(``intel_extension_for_pytorch._C._get_current_isa_level()``: ``AVX2`` on AMD Zen 3, ``AVX512``,
``AMX`` ...), since that, not the CPU's brand, decides which of its kernels run.

An op (``"gemm/float32"``, ``"attention/bfloat16"``) is chosen on a host kind when the geometric mean,
over the benchmark's cases, of the cpu backend's time divided by IPEX's is at least
:data:`MIN_SPEEDUP`. A host kind with no table gets nothing: no guessing. ``PLINTH_IPEX_OPS``
overrides the table (tests and the conformance run use it to check kernels the table rules out).

This module imports neither torch nor IPEX, so the rule is tested in the main environment too.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The committed table of measurements (written by ``benchmarks/ipex.py --write``).
MEASURED_PATH = Path(__file__).with_name("measured.json")

#: ``measured`` (default: the table decides), ``none``, ``all`` (every op IPEX covers, measured or
#: not), or a comma-separated list of op keys (``gemm/float32,attention/float32``) to contribute.
OPS_ENV = "PLINTH_IPEX_OPS"

#: An op must measure at least this much faster (geometric mean over the benchmark's cases) to be
#: chosen: the dev machines are shared, and repeated runs of one kernel differ by a few percent.
MIN_SPEEDUP = 1.05

#: The ops IPEX can contribute, by key: what the benchmark measures and the provider offers.
OPS: tuple[str, ...] = ("gemm/float32", "gemm/bfloat16", "attention/float32", "attention/bfloat16")


def op_key(op: str, dtype: str) -> str:
    """``"gemm/float32"`` for ``("gemm", "float32")``: how ops are named in the table and the env."""
    return f"{op}/{dtype}"


def geomean(values: list[float]) -> float:
    """The geometric mean of positive ``values`` (a speedup's average: 2x and 0.5x cancel out)."""
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"a geometric mean needs positive values, got {values}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass(frozen=True, slots=True)
class OpChoice:
    """The verdict on one op for this host: whether IPEX contributes it, with which kernel, and why."""

    key: str
    chosen: bool
    #: The IPEX kernel the benchmark found fastest for this op ("" where none was measured).
    variant: str
    #: One line for the log: the figures that decided it.
    reason: str


def speedup_of(entry: Mapping[str, Any]) -> float:
    """The geometric mean, over ``entry["cases"]``, of the cpu backend's time over IPEX's."""
    cases = entry.get("cases") or {}
    if not cases:
        raise ValueError("a measured op needs at least one case")
    return geomean([float(c["cpu_us"]) / float(c["ipex_us"]) for c in cases.values()])


def decide(key: str, table: Mapping[str, Any] | None, host_kind: str) -> OpChoice:
    """The verdict on op ``key`` from the measured ``table`` of ``host_kind`` (None: not measured)."""
    if table is None:
        return OpChoice(key, False, "", f"{key}: not measured on {host_kind} hosts (run benchmarks/ipex.py)")
    entry = table.get("ops", {}).get(key)
    if entry is None:
        unavailable = sorted({why for k, why in table.get("unavailable", {}).items() if k.startswith(key + "/")})
        if unavailable:  # the benchmark found IPEX cannot run it on this host kind
            why = "; ".join(unavailable)
            return OpChoice(key, False, "", f"{key}: IPEX cannot run it on {host_kind} hosts ({why})")
        return OpChoice(key, False, "", f"{key}: not measured on {host_kind} hosts (run benchmarks/ipex.py)")
    speedup = speedup_of(entry)
    variant = str(entry.get("variant", ""))
    cases = ", ".join(f"{name} {c['cpu_us'] / c['ipex_us']:.2f}x" for name, c in entry["cases"].items())
    verdict = "chosen" if speedup >= MIN_SPEEDUP else f"not chosen (below {MIN_SPEEDUP}x)"
    reason = f"{key}: IPEX {variant} measured {speedup:.2f}x the cpu backend's speed on {host_kind} ({cases})"
    reason += f": {verdict}"
    return OpChoice(key, speedup >= MIN_SPEEDUP, variant, reason)


def load_measured(path: Path = MEASURED_PATH) -> dict[str, Any]:
    """The committed table (``{"hosts": {kind: {"ops": {key: entry}}}}``); empty where there is none."""
    if not path.is_file():
        return {"hosts": {}}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def choose(
    host_kind: str,
    measured: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    covered: tuple[str, ...] = OPS,
) -> dict[str, OpChoice]:
    """The verdict on every op in ``covered`` for a host of ``host_kind``.

    :param measured: the table (default: :data:`MEASURED_PATH`'s).
    :param env: where ``PLINTH_IPEX_OPS`` is read (default: the process environment).
    :raises ValueError: ``PLINTH_IPEX_OPS`` names an op IPEX does not cover.
    """
    measured = load_measured() if measured is None else measured
    setting = (os.environ if env is None else env).get(OPS_ENV, "measured").strip() or "measured"
    table = measured.get("hosts", {}).get(host_kind)
    verdicts = {key: decide(key, table, host_kind) for key in covered}
    if setting == "measured":
        return verdicts
    if setting == "none":
        forced: set[str] = set()
    elif setting == "all":
        forced = set(covered)
    else:
        forced = {k.strip() for k in setting.split(",") if k.strip()}
        unknown = forced - set(covered)
        if unknown:
            raise ValueError(
                f"{OPS_ENV}={setting!r}: {', '.join(sorted(unknown))} not among the ops IPEX covers "
                f"({', '.join(covered)}); or use measured, all, none"
            )
    out = {}
    for key, v in verdicts.items():
        # a forced op keeps the measured variant where there is one; the provider's default otherwise
        note = f"{OPS_ENV}={setting}: {'forced on' if key in forced else 'forced off'} (measured: {v.reason})"
        out[key] = OpChoice(key, key in forced, v.variant, note)
    return out
