"""IPEX's prepacked linear as the cpu backend's GEMM for dense fp32/bf16 weights.

Each weight is packed once at load by ``ipex.optimize`` on a one-layer ``nn.Linear``, into one of
IPEX's three CPU GEMM kernels (a *variant*; ``benchmarks/ipex.py`` measures each and
``measured.json`` records the fastest per dtype and host kind):

* ``mkl``: MKL's packed SGEMM (``torch_ipex::ipex_MKLSGEMM``), IPEX's default for fp32 inference;
* ``onednn``: oneDNN's prepacked inner product (``torch_ipex::ipex_linear``), its bf16 default and
  fp32 with ``auto_kernel_selection``;
* ``tpp``: the libxsmm TPP blocked kernels ``ipex.llm.optimize`` uses for bf16 LLMs (weights
  re-blocked in 16 x 64 tiles; where N % 16 or K % 64 is not 0, IPEX packs that weight for MKL/oneDNN).

Quantized (GGUF block) weights are not IPEX's: they go to the cpu backend's own GEMM, which keeps
its native q4_1/q8_0 kernels (``prepare_quantized`` and ``linear`` of those formats delegate).
"""

from __future__ import annotations

from typing import Any

import torch

from plinth.platform.backend import GemmKernels, LinearWeight
from plinth.platform.quant import QuantizedWeight

#: The IPEX GEMM kernels a weight can be packed for (see the module docstring).
VARIANTS: tuple[str, ...] = ("mkl", "onednn", "tpp")
#: The variant used where nothing was measured (a forced op): IPEX's own default per dtype.
DEFAULT_VARIANT: dict[torch.dtype, str] = {torch.float32: "mkl", torch.bfloat16: "onednn"}
#: ``LinearWeight.format`` of a weight packed by IPEX (``ipex_mkl``, ...).
FORMAT_PREFIX = "ipex_"


def _ipex() -> Any:
    import intel_extension_for_pytorch as ipex

    return ipex


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, variant: str) -> torch.nn.Module:
    """A one-layer ``nn.Linear`` holding ``weight`` [N, K] (and ``bias`` [N]) in ``dtype``, packed by IPEX
    for ``variant``: the module IPEX's own model conversion would make of it."""
    if variant not in VARIANTS:
        raise ValueError(f"IPEX GEMM variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    if variant == "mkl" and dtype != torch.float32:
        raise ValueError(f"IPEX GEMM variant 'mkl' is fp32 only, not {dtype}")
    ipex = _ipex()
    n, k = weight.shape
    layer = torch.nn.Linear(k, n, bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.requires_grad_(False)
    # in a container: ipex.optimize swaps children for its packed modules
    model = torch.nn.Sequential(layer).eval()
    # Only the weight packing: its default folding passes trace the model with torch.fx, and the traced
    # copy calls plain torch.nn.functional.linear on an unpacked weight (found: no IPEX kernel ran).
    options: dict[str, Any] = dict(
        inplace=True,
        weights_prepack=True,
        conv_bn_folding=False,
        linear_bn_folding=False,
        concat_linear=False,
        replace_dropout_with_identity=False,
        graph_mode=False,
    )
    if variant == "tpp":
        # TPP is chosen by a process-wide switch inside IPEX (what ipex.llm.optimize flips for bf16);
        # it is read while packing only, so it is switched off again at once.
        from intel_extension_for_pytorch.cpu._auto_kernel_selection import _disable_tpp, _enable_tpp

        _enable_tpp()
        try:
            model = ipex.optimize(model, dtype=dtype, **options)
        finally:
            _disable_tpp()
    else:
        model = ipex.optimize(model, dtype=dtype, auto_kernel_selection=variant == "onednn", **options)
    packed: torch.nn.Module = model[0]
    # TPP blocks only N % 16 == 0 and K % 64 == 0: IPEX packs other shapes for MKL/oneDNN itself
    if type(packed).__name__ != "_IPEXLinear":
        raise RuntimeError(f"IPEX left a [{n}, {k}] {dtype} weight unpacked for {variant!r} ({type(packed).__name__})")
    return packed


_PACKABLE: dict[tuple[torch.dtype, str], str | None] = {}


def cannot_pack(dtype: torch.dtype, variant: str) -> str | None:
    """None where IPEX packs ``dtype`` weights for ``variant`` on this host; else why not (IPEX's own
    error: on AVX2 hosts it refuses bf16 prepacking, which needs avx_ne_convert or AVX-512). Tried
    once per process on a small weight."""
    key = (dtype, variant)
    if key not in _PACKABLE:
        try:
            pack_linear(torch.zeros(16, 64, dtype=dtype), None, dtype, variant)
            _PACKABLE[key] = None
        except (AssertionError, RuntimeError, ValueError) as err:
            _PACKABLE[key] = f"{type(err).__name__}: {err}"
    return _PACKABLE[key]


class IpexGemm(GemmKernels):
    """``x @ w.T + b`` through IPEX's packed linear, computing in one dtype (fp32 or bf16).

    :param dtype: the compute dtype.
    :param variant: which IPEX kernel dense weights are packed for (:data:`VARIANTS`).
    :param own: the cpu backend's GEMM for ``dtype``: quantized weights are its (prepared and
        multiplied there), so its native block kernels stay in use.
    """

    def __init__(self, dtype: torch.dtype, variant: str | None = None, own: GemmKernels | None = None) -> None:
        self.dtype = dtype
        self.variant = variant or DEFAULT_VARIANT[dtype]
        if self.variant not in VARIANTS:
            raise ValueError(f"IPEX GEMM variant {self.variant!r}: choose one of {', '.join(VARIANTS)}")
        self.own = own

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        """Pack ``weight`` [N, K] (cast to the compute dtype) for the variant's kernel."""
        w = weight.to(device="cpu", dtype=self.dtype).contiguous()  # [N, K]
        b = None if bias is None else bias.to(device="cpu", dtype=self.dtype).contiguous()  # [N]
        n, k = w.shape
        module = pack_linear(w, b, self.dtype, self.variant)
        return LinearWeight(n, k, weight=None, bias=b, format=FORMAT_PREFIX + self.variant, data={"module": module})

    def prepare_quantized(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearWeight:
        """The cpu backend's own preparation (its native block kernels); dequantize-and-pack without one."""
        if self.own is not None:
            return self.own.prepare_quantized(weight, bias)
        return super().prepare_quantized(weight, bias)

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``x`` [M, K] (any strides) -> [M, N] in ``x``'s dtype."""
        if not weight.format.startswith(FORMAT_PREFIX):
            if self.own is None:
                raise ValueError(f"IpexGemm got a {weight.format!r} weight and has no cpu GEMM to hand it to")
            return self.own.linear(x, weight)
        # IPEX's kernels read x densely: a view into a fused projection is copied (small next to the product)
        xc = x.to(self.dtype).contiguous()
        with torch.no_grad():
            y: torch.Tensor = weight.data["module"](xc)  # [M, N]
        return y if x.dtype == self.dtype else y.to(x.dtype)
