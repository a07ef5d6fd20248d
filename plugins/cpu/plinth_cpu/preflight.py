"""What the cpu backend can tell about this host without torch: whether its native kernels can be
built and run here, and the process environment it asks for before torch starts (plugin API 1.15).

Nothing here imports torch, compiles or loads anything: :func:`process_env` runs when ``plinth`` is
imported (entry-point group ``plinth.process_env``), before the engine imports torch.
"""

from __future__ import annotations

import os
import platform
import shutil

#: What every build of the native kernels needs of the CPU (the AVX2 variant's flags).
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})

#: The OpenMP wait policy asked for where the native kernels run. torch's OpenMP workers (GNU
#: libgomp) otherwise spin for a while after every parallel torch op (a 16-bit model's logits cast,
#: oneDNN's GEMMs), on the cores the native kernels' own pool is working on. Measured (AMD EPYC
#: Zen 5, AVX-512, 2 threads, SmolLM2-135M, 64-request throughput, output tok/s, unset / PASSIVE,
#: two runs each): bf16 395, 396 / 500, 516; fp32 370, 400 / 428, 421; bf16 batch-1 decode 74 /
#: 143 tok/s. Without native kernels every op is torch's, and PASSIVE cost 7-18% there (fp32 125,
#: 129 / 116, 106), so it is asked for only where the kernels can run.
OMP_POLICY = ("OMP_WAIT_POLICY", "PASSIVE")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_flags() -> set[str] | None:
    """The x86 "flags" of /proc/cpuinfo; None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        return None
    return set()


def build_check() -> tuple[str | None, str]:
    """``(compiler, "")`` where the kernels can be built and run here, else ``(None, why not)``.

    Reads the environment, ``/proc/cpuinfo`` and ``$PATH`` only: nothing is compiled or loaded."""
    if os.environ.get("PLINTH_CPU_NATIVE", "1") == "0":
        return None, "native kernels off (PLINTH_CPU_NATIVE=0)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"native kernels need x86-64, this is {platform.machine()}"
    flags = _cpu_flags()
    if flags is None:
        return None, "native kernels off: /proc/cpuinfo is unreadable, so AVX2/FMA/F16C cannot be confirmed"
    missing = REQUIRED_CPU_FLAGS - flags
    if missing:
        return None, f"native kernels need {', '.join(sorted(missing))}, which this CPU lacks"
    compiler = _compiler()
    if compiler is None:
        return None, "native kernels need a C compiler (cc, gcc or clang; or $CC), none found"
    return compiler, ""


def process_env() -> dict[str, str]:
    """The ``plinth.process_env`` entry point: ``OMP_WAIT_POLICY=PASSIVE`` where the native kernels
    can run (see :data:`OMP_POLICY`), nothing elsewhere. The core sets each variable only where the
    environment does not already (an operator's own value wins)."""
    return dict([OMP_POLICY]) if build_check()[0] is not None else {}
