"""The CPU backend's native kernels: ``csrc/kernels.c`` built once with the system C compiler.

The library has a plain C ABI and is called through :mod:`ctypes` with raw data pointers, so it
needs neither Python nor torch headers and builds in about a second. The build is cached on disk
under ``$PLINTH_CACHE_DIR`` (default ``~/.cache/plinth``), keyed by a hash of the source, the
flags and the compiler, so only the first start on a machine pays for it; ``make install`` builds
it ahead (``python -m plinth_cpu.native``).

The kernels need x86-64 with AVX2, FMA and F16C. The same source is built once per ISA variant
(:data:`VARIANTS`: AVX-512 with VNNI, and AVX2) and the best one the CPU runs is loaded
(``PLINTH_CPU_ISA=avx2`` forces the AVX2 build on an AVX-512 host, so one machine tests both).
``PLINTH_CPU_EMULATE=1`` builds the AVX-512 variant with its AVX-512 and AMX instructions emulated in
portable code (``csrc/emulate.h``: SIMDe's headers from the simde-py package, and AMX tiles of its
own) and loads it on any host with AVX2: a test build that runs those paths, several times slower,
on a CPU that lacks them, so a CI run on an AVX2 host covers them too.
Elsewhere, or without a compiler, or with ``PLINTH_CPU_NATIVE=0``, :func:`native` returns ``None``
and the backend runs its torch kernels; :func:`native_status` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from ctypes import c_float
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from plinth_cpu.abi import ABI_VERSION, FUNCTIONS, GRAPH_OPS, HEADER, RecordedOp
from plinth_cpu.host_memory import huge_page_tensor
from plinth_cpu.preflight import REQUIRED_CPU_FLAGS, _cpu_flags, build_check

SOURCE = Path(__file__).with_name("csrc") / "kernels.c"
#: The header that stands in for <immintrin.h> in the emulated build (``-DPLINTH_EMULATE``).
EMULATION_HEADER = SOURCE.with_name("emulate.h")
#: Compiler flags of every build; each :class:`IsaVariant` adds its own ``-m`` flags.
FLAGS = ("-O3", "-pthread", "-shared", "-fPIC", "-fno-math-errno")
#: ``auto`` (default: the best variant the CPU runs) or a variant's name, forced.
ISA_ENV = "PLINTH_CPU_ISA"


@dataclass(frozen=True, slots=True)
class IsaVariant:
    """One build of the library: its compiler flags and what it needs of the CPU.

    ``level`` is what the built library's ``plinth_isa()`` returns, so a library loaded from the
    cache is checked to be the build it claims to be."""

    name: str
    label: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    level: int


AVX2 = IsaVariant("avx2", "AVX2/FMA", ("-mavx2", "-mfma", "-mf16c"), REQUIRED_CPU_FLAGS, 2)
AVX512 = IsaVariant(
    "avx512",
    "AVX-512 (F/BW/VL/DQ/VNNI)",
    (*AVX2.flags, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
    REQUIRED_CPU_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
    3,
)
#: The builds, best first: the first whose ``cpu_flags`` the CPU has is loaded.
VARIANTS: tuple[IsaVariant, ...] = (AVX512, AVX2)

#: "1": the AVX-512 variant is built emulated (:data:`EMULATED_AVX512`) and chosen on any AVX2 host.
EMULATE_ENV = "PLINTH_CPU_EMULATE"
#: What the emulated build gives the kernels' own probes (AVX512-BF16, AMX-BF16 and AMX-INT8 report present);
#: the native-kernel decisions read these as CPU flags (:func:`native_cpu_flags`), torch's never do.
EMULATED_CPU_FLAGS = frozenset(
    {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
)


def _emulation_flags() -> tuple[str, ...]:
    """The compiler flags of the emulated build: the AVX2 variant's, the emulation switch and SIMDe's
    headers (the simde-py package, a test dependency); NativeBuildError where they are missing."""
    try:
        import simde_py  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as e:
        raise NativeBuildError(
            f"{EMULATE_ENV}=1 needs SIMDe's headers: pip install simde-py (plinth's [test] extra has it)"
        ) from e
    # -O2 after FLAGS' -O3: SIMDe's inlined emulations take gcc 12 ~200 s to compile at -O3, 24 s at -O2
    return (*AVX2.flags, "-O2", "-DPLINTH_EMULATE", "-Wno-psabi", f"-I{simde_py.get_include()}")


def emulating() -> bool:
    """:data:`EMULATE_ENV` checked: True for "1", False when unset or "0"; another value is named."""
    mode = os.environ.get(EMULATE_ENV, "0").strip()
    if mode not in ("0", "1"):
        raise ValueError(f"{EMULATE_ENV}={mode!r} is not one of 0, 1")
    return mode == "1"


#: The AVX-512 variant built with :data:`EMULATE_ENV`: its paths (AVX-512, AVX512-BF16, AMX tiles) run on
#: any CPU with AVX2 (its compiler flags: :func:`_build_flags`, which finds SIMDe's include path).
EMULATED_AVX512 = IsaVariant(
    AVX512.name, f"{AVX512.label} + AVX512-BF16 + AMX-BF16, emulated (a test build)", (), REQUIRED_CPU_FLAGS, 103
)


def _build_flags(variant: IsaVariant) -> tuple[str, ...]:
    """The ``-m``/``-D``/``-I`` flags ``variant`` is compiled with (the emulated build's found here)."""
    return _emulation_flags() if variant is EMULATED_AVX512 else variant.flags


def variants() -> tuple[IsaVariant, ...]:
    """:data:`VARIANTS`, with the AVX-512 one emulated where :data:`EMULATE_ENV` asks."""
    return tuple(EMULATED_AVX512 if emulating() and v is AVX512 else v for v in VARIANTS)


def native_cpu_flags() -> set[str] | None:
    """The CPU flags the native kernels' decisions read: /proc/cpuinfo's, plus what the emulated build
    provides (:data:`EMULATED_CPU_FLAGS`) where :data:`EMULATE_ENV` asks for it. Never raises."""
    flags = _cpu_flags()
    try:
        emulated = emulating()
    except ValueError:
        emulated = False
    return flags | EMULATED_CPU_FLAGS if emulated and flags is not None else flags


#: ggml block formats the library multiplies natively: name -> (code, elements, bytes per block)
QUANT_FORMATS: dict[str, tuple[int, int, int]] = {"q4_1": (0, 32, 20), "q8_0": (1, 32, 34)}

#: The library's own layout of a q4_1 weight in 4-row groups (``csrc/kernels.c``, "Q4_1 in 4-row
#: groups"), made at load by :meth:`NativeKernels.pack_q4_1x4`, for int16 activations.
Q4_1X4 = "q4_1x4"
#: ... in 16-row panels (``csrc/kernels.c``, "q4_1 in 16-row panels"), made at load by
#: :meth:`NativeKernels.pack_q4_1p16`, for int16 activations (VNNI dot products in the AVX-512 build,
#: vpmaddwd in the AVX2 build).
Q4_1P16 = "q4_1p16"
#: ... and of a q8_0 weight in the same panels (made by :meth:`NativeKernels.pack_q8_0p16`).
Q8_0P16 = "q8_0p16"
#: The GGUF format each 16-row panel layout holds.
PANELS16_OF: dict[str, str] = {Q4_1P16: "q4_1", Q8_0P16: "q8_0"}
#: The library's own layouts, which take int16 activations only.
INT16_LAYOUTS = frozenset({Q4_1X4, Q4_1P16, Q8_0P16})

#: Weight layouts the quantized entry points take: name -> code (the ggml formats, and the library's).
BLOCK_LAYOUTS: dict[str, int] = {
    **{name: code for name, (code, _, _) in QUANT_FORMATS.items()},
    Q4_1X4: 2,
    Q4_1P16: 3,
    Q8_0P16: 4,
}

#: Activation handling of ``plinth_gemm_quant``: name -> code.
ACTIVATIONS: dict[str, int] = {"fp32": 0, "int8": 1, "int16": 2}

#: 16-bit panel dtypes -> their ``wt`` code in ``plinth_gemm_panels16``.
PANEL16_DTYPES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2}
#: The element kinds the kernels read and write (``W_F32``, ``W_BF16``, ``W_F16`` in ``kernels.c``).
ELEMENT_TYPES: dict[torch.dtype, int] = {torch.float32: 0, **PANEL16_DTYPES}
#: The KV-cache element kinds: those and fp8 e4m3fn (``W_F8``: a quarter of fp32's bytes, rounded as
#: torch casts, saturating at +-448).
CACHE_TYPES: dict[torch.dtype, int] = {**ELEMENT_TYPES, torch.float8_e4m3fn: 3}


def _cache_kind(cache: torch.Tensor) -> int:
    """The ``kt`` code of a KV cache's element type; ValueError for a dtype the kernels do not read."""
    kind = CACHE_TYPES.get(cache.dtype)
    if kind is None:
        raise ValueError(
            f"the native attention kernels take a {sorted(map(str, CACHE_TYPES))} KV cache, not {cache.dtype}"
        )
    return kind


class GraphError(RuntimeError):
    """A step graph could not be recorded or a replayed call failed."""


class NativeGraph:
    """Native calls recorded once, replayed in order by one ``plinth_graph_run`` call.

    Every pointer is the one the recorded call got: replaying reads and writes the same buffers,
    so whoever recorded keeps them alive and refills the inputs in place before :meth:`replay`.
    """

    def __init__(self, lib: ctypes.CDLL, calls: list[tuple[str, tuple[object, ...]]]) -> None:
        self._run = lib.plinth_graph_run
        self.names = [name for name, _ in calls]
        self._ops = (RecordedOp * len(calls))()
        for op, (name, args) in zip(self._ops, calls, strict=True):
            op.kind = GRAPH_OPS[name]
            ints = floats = 0
            for arg, kind in zip(args, FUNCTIONS[name].argtypes(), strict=True):
                if kind is c_float:
                    op.f[floats] = float(arg)  # type: ignore[arg-type]
                    floats += 1
                else:
                    op.a[ints] = 0 if arg is None else int(arg)  # type: ignore[call-overload]
                    ints += 1

    def __len__(self) -> int:
        return len(self._ops)

    def replay(self, rows: int | None = None, captured: int | None = None) -> None:
        """Run the recorded calls; raises :class:`GraphError` naming a call that failed.

        Recorded over ``captured`` rows (tokens), with ``rows`` < ``captured`` each call whose row
        count is ``captured`` runs over the first ``rows`` only (every recordable call works row by
        row); the other rows' outputs are left as they were."""
        if rows is not None and captured is not None and not 0 < rows <= captured:
            raise ValueError(f"replay of {rows} rows of a graph recorded with {captured}")
        status = self._run(ctypes.addressof(self._ops), len(self._ops), captured or 0, rows or 0)
        if status:
            i = abs(status) - 1
            what = "ran out of memory" if status > 0 else "is of a kind the library does not know"
            raise GraphError(f"step graph call {i} ({self.names[i]}) {what}")


class _RecordingLibrary:
    """Stands in for the library while a graph records: each call runs and is appended to ``calls``."""

    def __init__(self, lib: ctypes.CDLL, calls: list[tuple[str, tuple[object, ...]]]) -> None:
        self._lib = lib
        self._calls = calls

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._lib, name)
        if name not in GRAPH_OPS:
            raise GraphError(f"{name} cannot be recorded in a step graph")

        def record(*args: object) -> object:
            self._calls.append((name, args))
            return fn(*args)

        return record


class NativeBuildError(RuntimeError):
    """The kernel library could not be compiled or loaded."""


def cache_dir() -> Path:
    """Where compiled artefacts live: ``$PLINTH_CACHE_DIR`` or ``$XDG_CACHE_HOME/plinth``."""
    if root := os.environ.get("PLINTH_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plinth"


def library_path(compiler: str, variant: IsaVariant = AVX2) -> Path:
    """The cached library's path for this source, ``variant``'s flags and ``compiler``."""
    sources = SOURCE.read_bytes() + HEADER.read_bytes() + EMULATION_HEADER.read_bytes()
    key = hashlib.sha256(sources + " ".join((compiler, *FLAGS, *_build_flags(variant))).encode()).hexdigest()[:16]
    suffix = "_emulated" if variant is EMULATED_AVX512 else ""
    return cache_dir() / "cpu-kernels" / key / f"libplinth_cpu_{variant.name}{suffix}.so"


def build(compiler: str, variant: IsaVariant = AVX2) -> Path:
    """Compile ``variant`` into the cache (atomically) unless it is there; return its path.

    Compiling needs only a compiler that knows the ISA, not a CPU that runs it."""
    target = library_path(compiler, variant)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, *_build_flags(variant), str(SOURCE), "-o", tmp, "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
    os.replace(tmp, target)
    return target


#: "auto" (default): the bf16 pair-panel GEMM, and a bf16 model's attention scores over a bf16 cache, run
#: on AMX tiles where the CPU has AMX-TILE and AMX-BF16 and Linux grants this process the tile data; "0":
#: never (the AVX512-BF16 dot products and the fp32 attention path only).
AMX_ENV = "PLINTH_CPU_AMX"
AMX_MODES = ("auto", "0")


def amx_mode() -> str:
    """:data:`AMX_ENV` checked; a value other than those of :data:`AMX_MODES` is named."""
    mode = os.environ.get(AMX_ENV, "auto")
    if mode not in AMX_MODES:
        raise ValueError(f"{AMX_ENV}={mode!r} is not one of {', '.join(AMX_MODES)}")
    return mode


#: "1": q4_1/q8_0 products of 16 rows or more on the 16-row panels run on AMX-INT8 tiles where the CPU
#: has AMX-TILE and AMX-INT8 (and :data:`AMX_ENV` is not "0"): the int16 activations split into a signed
#: high and an unsigned low byte, two int8 tile products per 32-block, scaled as the VNNI kernel scales
#: them, so the outputs are that kernel's bit for bit. "0" (default): the VNNI kernel at every row count.
#: Off by default until its speed against the VNNI kernel is measured on an AMX host (verified so far
#: under emulation only: ``PLINTH_CPU_EMULATE=1``).
AMX_INT8_ENV = "PLINTH_CPU_AMX_INT8"
AMX_INT8_MODES = ("0", "1")
#: The fewest rows a product takes the AMX-INT8 tiles with (``AMX_I8_MIN_ROWS`` in ``csrc/kernels.c``: a
#: tile holds 16 rows, fewer are padded with zero rows).
AMX_I8_MIN_ROWS = 16


def amx_int8_mode() -> str:
    """:data:`AMX_INT8_ENV` checked; a value other than those of :data:`AMX_INT8_MODES` is named."""
    mode = os.environ.get(AMX_INT8_ENV, "0")
    if mode not in AMX_INT8_MODES:
        raise ValueError(f"{AMX_INT8_ENV}={mode!r} is not one of {', '.join(AMX_INT8_MODES)}")
    return mode


class NativeKernels:
    """The loaded library, with tensor-level wrappers (fp32, contiguous, on the CPU)."""

    def __init__(self, path: Path, variant: IsaVariant = AVX2) -> None:
        self.path = path
        self.variant = variant
        lib = ctypes.CDLL(str(path))
        for name, signature in FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.restype = signature.restype()
            fn.argtypes = signature.argtypes()
        if lib.plinth_abi_version() != ABI_VERSION:
            raise NativeBuildError(f"{path}: ABI {lib.plinth_abi_version()}, expected {ABI_VERSION}")
        if lib.plinth_isa() != variant.level:
            raise NativeBuildError(f"{path}: built for ISA level {lib.plinth_isa()}, expected {variant.name}'s")
        self.lib = lib
        self._lib = lib  # the library itself while self.lib records
        #: whether :meth:`gemm_bf16_pairs` runs here: the AVX-512 build on a CPU with AVX512-BF16
        self.bf16_dot = bool(lib.plinth_bf16_dot())
        #: ... and on AMX tiles from 2 rows (AMX-TILE and AMX-BF16, granted by Linux; :data:`AMX_ENV`)
        self.amx_bf16 = bool(lib.plinth_amx_bf16(1 if amx_mode() == "auto" else 0))
        #: whether q4_1/q8_0 16-row panels run on AMX-INT8 tiles from 16 rows (:data:`AMX_INT8_ENV`)
        self.amx_int8 = self.set_amx_int8(amx_int8_mode() == "1" and amx_mode() == "auto")
        self._calls: list[tuple[str, tuple[object, ...]]] = []
        self.set_num_threads(torch.get_num_threads())

    def set_amx_int8(self, on: bool) -> bool:
        """Turn the AMX-INT8 path of :meth:`gemm_quant` on or off (for this process); returns whether it
        is on, which needs a CPU with AMX-INT8 (or the emulated build)."""
        self.amx_int8 = bool(self._lib.plinth_amx_int8(1 if on else 0))
        return self.amx_int8

    def begin_recording(self) -> None:
        """Record every kernel call from now on (they still run) until :meth:`end_recording`."""
        if isinstance(self.lib, _RecordingLibrary):
            raise GraphError("a step graph is already recording")
        self._lib, self._calls = self.lib, []
        self.lib = _RecordingLibrary(self._lib, self._calls)  # type: ignore[assignment]

    def end_recording(self) -> NativeGraph:
        """Stop recording; the calls made since :meth:`begin_recording` as a graph."""
        if not isinstance(self.lib, _RecordingLibrary):
            raise GraphError("no step graph is recording")
        self.lib = self._lib
        return NativeGraph(self.lib, self._calls)

    def cancel_recording(self) -> None:
        """Stop recording and drop what was recorded (no-op when not recording)."""
        if isinstance(self.lib, _RecordingLibrary):
            self.lib = self._lib

    def set_num_threads(self, n: int) -> None:
        """Threads the kernels use, the calling thread included."""
        self.lib.plinth_set_num_threads(n)

    def num_threads(self) -> int:
        """Threads the kernels use, the calling thread included."""
        return int(self.lib.plinth_get_num_threads())

    def read_probe(self, x: torch.Tensor) -> float:
        """Sum of ``x`` (fp32, contiguous, numel a multiple of 4096), read like a weight stream."""
        partial = torch.empty(x.numel() // 4096, dtype=torch.float32)
        self.lib.plinth_read_probe(x.data_ptr(), partial.data_ptr(), x.numel())
        return float(partial.sum())

    def gemm_f32(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [M, K] @ ``w`` [N, K]^T (+ ``bias``) for small M; K a multiple of 8."""
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty(M, N, dtype=torch.float32)
        self.lib.plinth_gemm_f32(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(),
                                 y.data_ptr(), M, N, K)  # fmt: skip
        return y

    def pack_f32(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` [N, K] (fp32, contiguous, K a multiple of 8) as 8-row panels ``[ceil(N/8), K, 8]``.

        Panel ``p`` holds rows ``8p..8p+7`` k-major; the last panel's missing rows are zeros. The
        layout :meth:`gemm_f32_panels` multiplies."""
        N, K = w.shape
        panels = huge_page_tensor(((N + 7) // 8, K, 8), torch.float32)  # streamed every step: huge pages
        self.lib.plinth_pack_f32_panels(w.data_ptr(), panels.data_ptr(), N, K)
        return panels

    def gemm_f32_panels(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """``x`` [M, K] @ w^T (+ ``bias``) for a weight of ``n`` rows laid out by :meth:`pack_f32`."""
        M, K = x.shape
        y = torch.empty(M, n, dtype=torch.float32)
        self.lib.plinth_gemm_f32_panels(x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                                        y.data_ptr(), M, n, K)  # fmt: skip
        return y

    def pack_16(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` [N, K] (bf16 or fp16, K a multiple of 8) as 8-row panels ``[ceil(N/8), K, 8]`` of its
        own dtype: :meth:`pack_f32`'s layout with 2-byte elements, for :meth:`gemm_panels16`."""
        if w.dtype not in PANEL16_DTYPES:
            raise ValueError(f"16-bit panels hold bf16 or fp16, not {w.dtype}")
        N, K = w.shape
        panels = huge_page_tensor(((N + 7) // 8, K, 8), w.dtype)
        full, rest = divmod(N, 8)
        panels[:full].copy_(w[: full * 8].view(full, 8, K).transpose(1, 2))
        if rest:
            panels[full].zero_()
            panels[full, :, :rest].copy_(w[full * 8 :].t())
        return panels

    def gemm_rows16(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [M, K] (fp32, contiguous) @ ``w``^T (+ ``bias``, fp32) for a bf16/fp16 ``w`` [N, K] as
        stored (contiguous, K a multiple of 8) -> fp32 [M, N]: the row tiles of :meth:`gemm_f32`, the
        weights widened exactly as they are read (the sums of ``gemm_f32`` over ``w.float()``)."""
        if w.dtype not in PANEL16_DTYPES:
            raise ValueError(f"gemm_rows16 takes bf16 or fp16 weights, not {w.dtype}")
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty(M, N, dtype=torch.float32)
        self.lib.plinth_gemm_rows16(PANEL16_DTYPES[w.dtype], x.data_ptr(), w.data_ptr(),
                                    None if bias is None else bias.data_ptr(), y.data_ptr(), M, N, K)  # fmt: skip
        return y

    def gemm_panels16(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """``x`` [M, K] (fp32) @ w^T (+ ``bias``) for a weight of ``n`` rows laid out by :meth:`pack_16`:
        the weights widened to fp32 as they are read, the sums those of :meth:`gemm_f32_panels` over the
        same values, bit for bit."""
        M, K = x.shape
        y = torch.empty(M, n, dtype=torch.float32)
        if self.lib.plinth_gemm_panels16(PANEL16_DTYPES[panels.dtype], x.data_ptr(), panels.data_ptr(),
                                         None if bias is None else bias.data_ptr(), y.data_ptr(), M, n, K):  # fmt: skip
            raise ValueError(f"the library took no {panels.dtype} panels")
        return y

    def pack_bf16_pairs(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` [N, K] (bf16, contiguous, K even) as 16-column pair panels ``[ceil(N/16), K/2, 16, 2]``:
        panel ``p``, pair ``kp`` holds ``w[16p + j, 2kp + t]`` at ``[p, kp, j, t]`` (missing columns
        zero), the layout :meth:`gemm_bf16_pairs` multiplies."""
        if w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] % 2 or not w.is_contiguous():
            raise ValueError(f"pair panels take a contiguous bf16 [N, K] with K even, not {w.dtype} {tuple(w.shape)}")
        N, K = w.shape
        panels = huge_page_tensor(((N + 15) // 16, K // 2, 16, 2), torch.bfloat16)  # streamed every step
        self.lib.plinth_pack_bf16_pairs(w.data_ptr(), panels.data_ptr(), N, K)
        return panels

    def gemm_bf16_pairs(
        self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """``x`` [M, K] (bf16, dense rows of any stride) @ w^T (+ ``bias``, fp32) for a weight of ``n``
        rows laid out by :meth:`pack_bf16_pairs`, by AVX512-BF16 dot products -> [M, n] in ``dtype``
        (fp32, or bf16: each fp32 sum rounded once). ValueError where the CPU lacks them (:attr:`bf16_dot`)."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
            raise ValueError(f"gemm_bf16_pairs takes bf16 [M, K] with dense rows, not {x.dtype} {tuple(x.shape)}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"gemm_bf16_pairs writes fp32 or bf16, not {dtype}")
        M, K = x.shape
        if panels.numel() != (n + 15) // 16 * 16 * K:
            raise ValueError(f"pair panels of {panels.numel()} elements do not hold a {n} x {K} weight")
        y = torch.empty(M, n, dtype=dtype)
        if self.lib.plinth_gemm_bf16_pairs(x.data_ptr(), x.stride(0), panels.data_ptr(),
                                           None if bias is None else bias.data_ptr(), ELEMENT_TYPES[dtype],
                                           y.data_ptr(), M, n, K):  # fmt: skip
            raise ValueError("gemm_bf16_pairs: this CPU or build has no AVX512-BF16 dot products")
        return y

    @property
    def recording(self) -> bool:
        """Whether a step graph is recording (only native calls replay: torch ops in between do not)."""
        return isinstance(self.lib, _RecordingLibrary)

    def pack_bf16x3(self, w: torch.Tensor) -> torch.Tensor:
        """An fp32 ``w`` [N, K] split into bf16 parts, ``w = hi + lo`` (``hi`` the nearest bf16, ``lo`` the
        rest rounded to bf16; ``lo`` zero where ``w`` is not finite), laid out as the pair panels of
        ``[hi | lo | hi]`` ([N, 3K]; the second ``hi`` zero where it is not finite, so an infinite weight
        meets the activations once, as in fp32) for :meth:`gemm_bf16x3`: 6 bytes a weight."""
        if w.dtype != torch.float32 or w.dim() != 2:
            raise ValueError(f"bf16x3 panels split an fp32 [N, K] weight, not {w.dtype} {tuple(w.shape)}")
        hi, lo = _split_bf16(w)
        return self.pack_bf16_pairs(torch.cat((hi, lo, _finite(hi)), dim=1).contiguous())

    def gemm_bf16x3(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """``x`` [M, K] (fp32) @ w^T (+ ``bias``) -> fp32 [M, n] from :meth:`pack_bf16x3`'s panels: ``x``
        split as the weight is, the three products ``x_hi w_hi + x_hi w_lo + x_lo w_hi`` as one bf16
        product over 3K (``[x_hi | x_hi | x_lo]``, the second ``x_hi`` zero where it is not finite: an
        infinite activation meets the weight once, as in fp32), summed in fp32 (on AMX tiles where the build has
        them). Each term is exact in fp32; what is left out (``x_lo w_lo`` and the parts' own
        rounding) is below 2^-16 of ``|x| |w|``: near-fp32 products at bf16 speed, three times over.
        Torch ops split ``x``: not for a step graph (see :attr:`recording`)."""
        hi, lo = _split_bf16(x.to(torch.float32))
        return self.gemm_bf16_pairs(torch.cat((hi, _finite(hi), lo), dim=1), panels, bias, n, torch.float32)

    def dequant_panels(self, fmt: str, blocks: torch.Tensor, n: int, k: int, out: torch.Tensor) -> torch.Tensor:
        """The fp32 values of a ggml ``fmt`` weight [n, k] in the panels of :meth:`pack_f32`, into
        ``out`` (at least ``ceil(n/8) * 8 * k`` floats); returns the panels as ``[ceil(n/8), k, 8]``."""
        panels = out.view(-1)[: (n + 7) // 8 * 8 * k].view((n + 7) // 8, k, 8)
        if self.lib.plinth_dequant_panels(BLOCK_LAYOUTS[fmt], blocks.data_ptr(), panels.data_ptr(), n, k):
            raise MemoryError(f"no memory to dequantize a {n} x {k} weight into panels")
        return panels

    def gemm_quant(
        self,
        fmt: str,
        x: torch.Tensor,
        blocks: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        activations: str = "fp32",
    ) -> torch.Tensor:
        """``x`` [M, K] @ dequant(``blocks``)^T for a ggml ``fmt`` weight of ``n`` rows (few rows M).

        ``activations``: "fp32" multiplies them as given; "int16" and "int8" round them per
        32-block first (relative error at most 2^-16 and 2^-8 of the block's largest magnitude)
        and multiply in integers: both about 1.5x faster than fp32 here; int8 is llama.cpp's scheme."""
        M, K = x.shape
        y = torch.empty(M, n, dtype=torch.float32)
        if fmt in INT16_LAYOUTS and activations != "int16":
            raise ValueError(f"a {fmt} weight takes int16 activations, not {activations}")
        code = BLOCK_LAYOUTS[fmt]
        bias_ptr = None if bias is None else bias.data_ptr()
        if self.lib.plinth_gemm_quant(
            code, ACTIVATIONS[activations], x.data_ptr(), blocks.data_ptr(), bias_ptr, y.data_ptr(), M, n, K
        ):
            raise MemoryError(f"no memory to quantize {M} x {K} activations (or split them for AMX-INT8 tiles)")
        return y

    def pack_q4_1x4(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """A q4_1 weight [n, k] (its GGUF blocks, row after row) laid out in 4-row groups for the
        int16 few-row kernel (format ``"q4_1x4"``; every other quantized entry point takes it too):
        the same bytes, plus at most 48 of padding per group and a zero fourth row where n is not a
        multiple of 4. ``blocks`` may be freed afterwards."""
        if k % 32 or blocks.numel() * blocks.element_size() != n * (k // 32) * QUANT_FORMATS["q4_1"][2]:
            raise ValueError(f"{blocks.numel() * blocks.element_size()} bytes are not the q4_1 blocks of {n} x {k}")
        src = blocks.contiguous()
        out = torch.empty(int(self.lib.plinth_q4_1x4_bytes(n, k)), dtype=torch.uint8)
        if out.data_ptr() % 64:  # the kernel's aligned loads; torch's CPU allocator aligns to 64 bytes
            raise MemoryError("the allocator gave a q4_1x4 weight memory not aligned to 64 bytes")
        self.lib.plinth_pack_q4_1x4(src.data_ptr(), out.data_ptr(), n, k)
        return out

    def pack_q4_1p16(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """A q4_1 weight [n, k] (its GGUF blocks, row after row) laid out in 16-row panels for the
        int16 panel kernel (format ``"q4_1p16"``, any row count; both builds; every other quantized
        entry point takes it too): the same 20 bytes per 32 values, zero rows filling a last panel
        where n is not a multiple of 16. ``blocks`` may be freed afterwards."""
        return self._pack_panels16(Q4_1P16, blocks, n, k)

    def pack_q8_0p16(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """A q8_0 weight [n, k] in the same 16-row panels (format ``"q8_0p16"``; 34 bytes per 32
        values, as GGUF), for the same kernel: the quants sign-extended to int16 lanes as read."""
        return self._pack_panels16(Q8_0P16, blocks, n, k)

    def _pack_panels16(self, layout: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        fmt = PANELS16_OF[layout]
        if k % 32 or blocks.numel() * blocks.element_size() != n * (k // 32) * QUANT_FORMATS[fmt][2]:
            raise ValueError(f"{blocks.numel() * blocks.element_size()} bytes are not the {fmt} blocks of {n} x {k}")
        src = blocks.contiguous()
        out = torch.empty(int(getattr(self.lib, f"plinth_{layout}_bytes")(n, k)), dtype=torch.uint8)
        if out.data_ptr() % 64:  # the kernel's aligned loads
            raise MemoryError(f"the allocator gave a {layout} weight memory not aligned to 64 bytes")
        getattr(self.lib, f"plinth_pack_{layout}")(src.data_ptr(), out.data_ptr(), n, k)
        return out

    def gemm_dequant(
        self, fmt: str, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """``x`` [M, K] @ dequant(``blocks``)^T with fp32 activations as given (many-row path)."""
        M, K = x.shape
        y = torch.empty(M, n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        code = BLOCK_LAYOUTS[fmt]
        if self.lib.plinth_gemm_dequant(code, x.data_ptr(), blocks.data_ptr(), bias_ptr, y.data_ptr(), M, n, K):
            raise MemoryError("no memory for dequantized weight rows")
        return y

    def dequant(
        self,
        fmt: str,
        blocks: torch.Tensor,
        n: int,
        k: int,
        out: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The [n, k] values of a ggml ``fmt`` weight in ``dtype``: fp32, or bf16/fp16 (the fp32 values
        rounded as ``Tensor.to`` rounds them). ``out``: a contiguous ``[n, k]`` tensor of ``dtype``."""
        kind = ELEMENT_TYPES.get(dtype)
        if kind is None:
            raise ValueError(f"dequantizes to {sorted(map(str, ELEMENT_TYPES))}, not {dtype}")
        if out is None:
            out = torch.empty(n, k, dtype=dtype)
        if self.lib.plinth_dequant(BLOCK_LAYOUTS[fmt], blocks.data_ptr(), out.data_ptr(), kind, n, k):
            raise MemoryError(f"no memory to dequantize a {n} x {k} weight")
        return out

    def round_trip_q8(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] as the int8-per-32-block values the quantized GEMMs multiply."""
        out = torch.empty_like(x)
        self.lib.plinth_round_trip_q8(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of ``x`` [T, H]; with ``residual``, of ``residual += x`` (updated in place). Every
        tensor fp32, bf16 or fp16 alike (16-bit values computed in fp32, each result rounded once)."""
        T, H = x.shape
        out = torch.empty_like(x)
        res = None if residual is None else residual.data_ptr()
        dt = ELEMENT_TYPES[x.dtype]
        self.lib.plinth_rms_norm(dt, x.data_ptr(), res, weight.data_ptr(), out.data_ptr(), T, H, eps)
        return out

    def rms_norm_heads(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of ``x`` [T, H, D] (heads dense, any token stride; D a multiple of 8)
        over its D values times ``weight`` [D] (of ``x``'s dtype) -> a new contiguous [T, H, D]."""
        T, H, D = x.shape
        out = torch.empty(T, H, D, dtype=x.dtype)
        self.lib.plinth_rms_norm_heads(ELEMENT_TYPES[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(),
                                       out.data_ptr(), T, H, D, eps)  # fmt: skip
        return out

    def convert(self, x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [T, H] (fp32, bf16 or fp16; elements dense, rows any stride) as ``dtype`` [T, H]
        contiguous (into ``out`` when given): widened exactly, or rounded as torch rounds
        (``x.to(dtype)`` bit for bit, a NaN as some NaN). One native call, which a step graph records."""
        if x.dtype not in ELEMENT_TYPES or dtype not in ELEMENT_TYPES:
            raise ValueError(f"the kernels convert between {sorted(map(str, ELEMENT_TYPES))}, not {x.dtype} -> {dtype}")
        if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
            raise ValueError(f"convert takes [T, H] with dense rows, not shape {tuple(x.shape)} strides {x.stride()}")
        T, H = x.shape
        if out is None:
            out = torch.empty(T, H, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != (T, H) or not out.is_contiguous():
            raise ValueError(f"convert's out must be a contiguous {dtype} [{T}, {H}]")
        self.lib.plinth_convert(ELEMENT_TYPES[x.dtype], x.data_ptr(), x.stride(0), ELEMENT_TYPES[dtype],
                                out.data_ptr(), T, H)  # fmt: skip
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :I]) * x[:, I:]`` for ``x`` [T, 2I]."""
        T, I2 = x.shape
        out = torch.empty(T, I2 // 2, dtype=x.dtype)
        self.lib.plinth_silu_and_mul(ELEMENT_TYPES[x.dtype], x.data_ptr(), out.data_ptr(), T, I2 // 2)
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(x[:, :I]) * x[:, I:]`` for ``x`` [T, 2I] (GELU's tanh form, as sigmoid)."""
        T, I2 = x.shape
        out = torch.empty(T, I2 // 2, dtype=x.dtype)
        self.lib.plinth_gelu_tanh_and_mul(ELEMENT_TYPES[x.dtype], x.data_ptr(), out.data_ptr(), T, I2 // 2)
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of ``x`` [S, V] fp32 (unit column stride, V >= 1): the first index of each
        row's maximum, a NaN counting as the maximum, as torch's; int64 [S]."""
        S, V = x.shape
        out = torch.empty(S, dtype=torch.int64)
        self.lib.plinth_argmax_rows(x.data_ptr(), x.stride(0), S, V, out.data_ptr())
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """``logits`` [S, V] fp32 (unit column stride) set to -inf where ``bitmask`` [S, W] int32
        (contiguous) has the token's bit clear."""
        S, V = logits.shape
        self.lib.plinth_apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), S, V,
                                            bitmask.shape[1])  # fmt: skip

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """NeoX rotary of ``x`` [T, H, D] (heads dense, any token stride; fp32, bf16 or fp16) at
        ``positions`` from the fp32 ``cos_sin`` -> a new contiguous tensor of ``x``'s dtype."""
        T, H, D = x.shape
        out = torch.empty(T, H, D, dtype=x.dtype)
        self.lib.plinth_rotary(ELEMENT_TYPES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), positions.data_ptr(),
                               cos_sin.data_ptr(), T, H, D, rotary_dim)  # fmt: skip
        return out

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store fp32 ``key``/``value`` [T, Hk, D] (heads dense) into the contiguous head-major ``cache``
        (fp32, bf16 or fp16: stored as ``key.to(cache.dtype)`` bit for bit) at int64 ``slot_mapping``
        [T]; slots < 0 are skipped."""
        T, Hk, D = key.shape
        self.lib.plinth_write_kv(_cache_kind(cache), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                 cache.data_ptr(), slot_mapping.data_ptr(), T, Hk, D, cache.shape[1],
                                 cache.shape[3])  # fmt: skip

    def decode_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None,
        soft_cap: float | None,
    ) -> torch.Tensor:
        """One query token per sequence: fp32 ``q`` [B, H, D] (heads dense) over the head-major
        ``cache`` (fp32, bf16 or fp16, widened exactly as it is read) with int32 ``block_tables``
        [B, max_blocks] and ``seq_lens`` [B] -> fp32 [B, H, D]."""
        B, H, D = q.shape
        _, num_blocks, Hk, bs, _ = cache.shape
        if q.stride(2) != 1 or q.stride(1) != D:
            q = q.contiguous()
        out = torch.empty(B, H, D, dtype=torch.float32)
        failed = self.lib.plinth_decode_attention(
            _cache_kind(cache), q.data_ptr(), q.stride(0), cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), B, H, Hk, D, bs, num_blocks, scale,
            window or 0, soft_cap or 0.0,
        )  # fmt: skip
        if failed:
            raise MemoryError("no memory for decode attention scores")
        return out

    def prefill_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        q_start: torch.Tensor,
        q_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        soft_cap: float | None,
    ) -> None:
        """Causal attention of prefill chunks into ``out``: chunk ``g``'s ``q_lens[g]`` query rows
        start at row ``q_start[g]`` of ``q`` [T, H, D] (heads dense) and are the last of its
        ``seq_lens[g]`` positions, whose K/V are in the head-major ``cache`` (fp32, bf16 or fp16);
        each row sees the positions up to its own. ``block_tables`` [G, max_blocks] int32,
        ``q_start`` int64, ``q_lens``/``seq_lens`` int32 [G]; ``out`` [>= T, H, D] contiguous gets
        the same rows."""
        _, H, D = q.shape
        _, num_blocks, Hk, bs, _ = cache.shape
        if q.stride(2) != 1 or q.stride(1) != D:
            q = q.contiguous()
        failed = self.lib.plinth_prefill_attention(
            _cache_kind(cache), q.data_ptr(), q.stride(0), cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), q_start.data_ptr(), q_lens.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
            q_lens.numel(), H, Hk, D, bs, num_blocks, scale, window or 0, soft_cap or 0.0,
        )  # fmt: skip
        if failed:
            raise MemoryError("no memory for prefill attention scores")


def _split_bf16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``v`` as bf16 ``(hi, lo)``: ``hi`` the nearest bf16, ``lo`` the rest rounded (zero where ``hi``
    is infinite or NaN, so ``hi`` alone carries it)."""
    hi = v.to(torch.bfloat16)
    wide = hi.to(torch.float32)
    return hi, torch.where(torch.isfinite(wide), v - wide, 0.0).to(torch.bfloat16)


def _finite(v: torch.Tensor) -> torch.Tensor:
    """``v`` with its infinite and NaN elements zero."""
    return torch.where(torch.isfinite(v), v, 0.0).to(v.dtype)


def runnable_variants(flags: set[str] | None = None) -> list[IsaVariant]:
    """The variants this CPU runs (``flags``: its /proc/cpuinfo flags), best first."""
    flags = _cpu_flags() if flags is None else flags
    return [v for v in variants() if flags is not None and v.cpu_flags <= flags]


def _wanted_isa() -> str:
    """:data:`ISA_ENV` normalised: ``auto`` when unset or empty."""
    return os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"


def choose_variant(flags: set[str] | None = None) -> tuple[IsaVariant, str]:
    """The variant to load on a CPU with ``flags``, and why; :data:`ISA_ENV` can force one.

    Raises ValueError for an unknown :data:`ISA_ENV` value or a forced variant the CPU cannot run
    (its instructions would kill the process). Call where :func:`build_check` found a compiler."""
    flags = _cpu_flags() if flags is None else flags
    have = flags or set()
    wanted = _wanted_isa()
    names = {v.name: v for v in variants()}
    if wanted != "auto":
        if wanted not in names:
            raise ValueError(f"{ISA_ENV}={wanted!r}: expected auto or one of {', '.join(names)}")
        variant = names[wanted]
        if missing := variant.cpu_flags - have:
            raise ValueError(f"{ISA_ENV}={wanted}: this CPU lacks {', '.join(sorted(missing))}")
        return variant, f"forced by {ISA_ENV}={wanted}"
    best = runnable_variants(have)[0]
    if best is EMULATED_AVX512:
        return best, f"{EMULATE_ENV}=1 (AVX-512 and AMX emulated: correct, not fast)"
    skipped = list(VARIANTS[: VARIANTS.index(best)])
    if not skipped:
        extra = sorted(best.cpu_flags - AVX2.cpu_flags)
        return best, f"this CPU has {', '.join(extra)}" if extra else "the best build for this CPU"
    lacks = "; ".join(f"{v.name} needs {', '.join(sorted(v.cpu_flags - have))}" for v in skipped)
    return best, f"this CPU lacks what the better builds need ({lacks})"


@cache
def _load() -> tuple[NativeKernels | None, str]:
    compiler, why_not = build_check()
    if compiler is None:
        return None, why_not
    variant, why = choose_variant()
    try:
        kernels = NativeKernels(build(compiler, variant), variant)
    except (NativeBuildError, OSError) as e:
        if variant is not AVX512 or _wanted_isa() != "auto":  # nothing to fall back to, or asked for
            return None, f"native kernels failed to build or load: {e}"
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        try:  # an older compiler without the ISA: the AVX2 build still runs
            kernels = NativeKernels(build(compiler, AVX2), AVX2)
        except (NativeBuildError, OSError) as e2:
            return None, f"native kernels failed to build or load: {e2}"
        return kernels, f"native kernels: {AVX2.label} ({compiler}): the {variant.name} build failed ({first})"
    return kernels, f"native kernels: {variant.label} ({compiler}): {why}"


def native() -> NativeKernels | None:
    """The loaded kernels, compiled on first use where the cache has none (about a second; ``make
    install`` builds ahead); ``None`` where they cannot run here. Called when a kernel is first
    asked for, never while plugins are discovered or probed. Raises ValueError when
    :data:`ISA_ENV` names a build this CPU cannot run."""
    return _load()[0]


def native_loaded() -> bool:
    """True once :func:`native` has run (whatever it found): asking again then costs nothing."""
    return bool(_load.cache_info().currsize)


def native_status() -> str:
    """One line: which native kernels run, or why none do. Compiles and loads nothing (and never
    raises): before the kernels are first asked for it says which build would load and whether it
    is built (cached on disk) or will be."""
    if native_loaded():
        return _load()[1]
    compiler, why_not = build_check()
    if compiler is None:
        return why_not
    try:
        variant, why = choose_variant()
    except ValueError as e:
        return f"native kernels refused: {e}"
    try:
        path = library_path(compiler, variant)
    except NativeBuildError as e:  # the emulated build without SIMDe's headers
        return f"native kernels refused: {e}"
    if path.exists():
        return f"native kernels: {variant.label} ({compiler}): {why}; built ({path}), loaded on first kernel request"
    return (
        f"native kernels: {variant.label} ({compiler}): {why}; not built yet: compiled on first kernel request "
        "(python -m plinth_cpu.native builds ahead)"
    )


def build_all() -> list[str]:
    """Build every variant the compiler supports (whatever this CPU runs: a cache built here also
    serves other hosts' kinds); one line per variant, built or why not."""
    compiler, why_not = build_check()
    if compiler is None:
        return [why_not]
    lines = []
    for variant in variants():
        try:
            lines.append(f"{variant.name}: {build(compiler, variant)}")
        except NativeBuildError as e:
            lines.append(f"{variant.name}: not built, the compiler lacks it ({str(e).strip().splitlines()[-1]})")
    return lines


if __name__ == "__main__":  # `python -m plinth_cpu.native`: build ahead (make install does this)
    for line in build_all():
        print(line)
    try:
        kernels = native()
    except ValueError as e:  # a bad PLINTH_CPU_ISA: every build is there, none is loaded here
        print(f"native kernels refused: {e}")
        sys.exit(1)
    print(native_status() + (f" -> {kernels.path}" if kernels else ""))
    sys.exit(0)
