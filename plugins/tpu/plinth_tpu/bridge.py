"""plinth's torch graph on JAX arrays: a torch tensor type whose data is a jax array.

The core's model is torch code; inside a compiled step (:mod:`plinth_tpu.compiled`) its tensors are
:class:`JaxTensor` objects wrapping jax tracers, so one ``jax.jit`` traces the whole step. The heavy
work never goes through torch's op set: the backend's kernels (attention, GEMM, norms, rotary,
activation) receive the tensors and run jax functions on their arrays (:func:`run_jax`). What the
model graph itself does between kernels is glue (views, splits, an embedding gather, a cast), and
only that glue is mapped here, op by op (:data:`_OPS`). An op outside it raises an error naming it.

Why not torchax: its newest release (0.0.13) does not import on torch 2.13 (its AMP table names
``aten.prod.dim_Dimname``, an overload torch 2.13 no longer has); torch-xla 2.9 pins torch 2.9. The
backend's README has the measurements.

Outside a trace, :func:`run_jax` takes ordinary torch tensors too (the conformance suite calls the
kernels eagerly): they cross to JAX by DLPack (:mod:`plinth_tpu.interop`) and the results back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch.utils._pytree import tree_map

from plinth_tpu.interop import to_jax, to_torch

_TO_TORCH: dict[Any, torch.dtype] = {
    jnp.dtype(jnp.float32): torch.float32,
    jnp.dtype(jnp.bfloat16): torch.bfloat16,
    jnp.dtype(jnp.float16): torch.float16,
    jnp.dtype(jnp.float64): torch.float64,
    jnp.dtype(jnp.int32): torch.int32,
    jnp.dtype(jnp.int64): torch.int64,
    jnp.dtype(jnp.int8): torch.int8,
    jnp.dtype(jnp.uint8): torch.uint8,
    jnp.dtype(jnp.bool_): torch.bool,
}
_TO_JAX: dict[torch.dtype, Any] = {t: j for j, t in _TO_TORCH.items()}


def jax_dtype(dtype: torch.dtype) -> Any:
    """The jax dtype of a torch dtype."""
    try:
        return _TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"plinth_tpu: no jax dtype for {dtype}") from None


class JaxTensor(torch.Tensor):
    """A torch tensor (shape and dtype only) whose data is ``value``, a jax array or tracer.

    Every torch op on it goes to :meth:`__torch_dispatch__`, which runs the op's jax equivalent
    from :data:`_OPS` on the arrays and wraps the results again.
    """

    value: Any

    @staticmethod
    def __new__(cls, value: Any) -> JaxTensor:
        dtype = _TO_TORCH.get(jnp.dtype(value.dtype))
        if dtype is None:
            raise TypeError(f"plinth_tpu: a jax array of dtype {value.dtype} has no torch dtype")
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(value.shape), dtype=dtype, device="meta")
        t.value = value
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"JaxTensor({tuple(self.shape)}, {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        impl = _OPS.get(func) or _OPS.get(func.overloadpacket)
        if impl is None:
            raise NotImplementedError(
                f"plinth_tpu: torch op {func} on a traced tensor is not mapped to jax; the model's glue may only "
                "view, split, gather and cast (compute belongs in the backend's kernels)"
            )
        jargs, jkwargs = tree_map(_unwrap, (tuple(args), dict(kwargs or {})))
        return tree_map(_wrap, impl(*jargs, **jkwargs))


def _unwrap(x: Any) -> Any:
    if isinstance(x, JaxTensor):
        return x.value
    if isinstance(x, torch.Tensor):  # a host constant the glue made: crosses once, at trace time
        return to_jax(x)
    return x


def _wrap(x: Any) -> Any:
    return JaxTensor(x) if isinstance(x, jax.Array | jax.core.Tracer) else x


def _dim(x: Any, d: int) -> int:
    return d % x.ndim if x.ndim else 0


def _view(x: Any, shape: Sequence[int]) -> Any:
    return jnp.reshape(x, tuple(shape))


def _split_with_sizes(x: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
    d = _dim(x, dim)
    out, start = [], 0
    for n in sizes:
        out.append(lax.slice_in_dim(x, start, start + n, axis=d))
        start += n
    return out


def _split(x: Any, size: int, dim: int = 0) -> list[Any]:
    d = _dim(x, dim)
    n = x.shape[d]
    return _split_with_sizes(x, [min(size, n - s) for s in range(0, n, size)], dim)


def _slice(x: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Any:
    d = _dim(x, dim)
    n = x.shape[d]
    s = 0 if start is None else (start + n if start < 0 else min(start, n))
    e = n if end is None else (end + n if end < 0 else min(end, n))
    return lax.slice_in_dim(x, s, max(s, e), stride=step, axis=d)


def _to_copy(x: Any, dtype: torch.dtype | None = None, **_: Any) -> Any:
    return x if dtype is None else x.astype(jax_dtype(dtype))


def _index_select(x: Any, dim: int, index: Any) -> Any:
    return jnp.take(x, index, axis=_dim(x, dim))


def _add(x: Any, y: Any, alpha: float = 1) -> Any:
    return x + (y if alpha == 1 else y * alpha)


def _cat(xs: Sequence[Any], dim: int = 0) -> Any:
    return jnp.concatenate(list(xs), axis=_dim(xs[0], dim))


def _identity(x: Any, *_: Any, **__: Any) -> Any:
    return x


aten = torch.ops.aten

#: The torch ops a traced model graph may run, and their jax equivalents.
_OPS: dict[Any, Callable[..., Any]] = {
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.split.Tensor: _split,
    aten.slice.Tensor: _slice,
    aten.index_select.default: _index_select,
    aten._to_copy.default: _to_copy,
    aten.to.dtype: lambda x, dtype, *_, **__: x.astype(jax_dtype(dtype)),
    aten.to.dtype_layout: _to_copy,
    aten.clone.default: _identity,
    aten.detach.default: _identity,
    aten.alias.default: _identity,
    aten.lift_fresh.default: _identity,
    aten.contiguous.default: _identity,
    aten.unsqueeze.default: lambda x, d: jnp.expand_dims(x, d if d >= 0 else x.ndim + 1 + d),
    aten.squeeze.dim: lambda x, d: jnp.squeeze(x, axis=_dim(x, d)),
    aten.t.default: lambda x: x.T,
    aten.transpose.int: lambda x, a, b: jnp.swapaxes(x, a, b),
    aten.permute.default: lambda x, dims: jnp.transpose(x, dims),
    aten.expand.default: lambda x, shape: jnp.broadcast_to(
        x, tuple(s if s != -1 else x.shape[i] for i, s in enumerate(shape))
    ),
    aten.mul.Tensor: lambda x, y: x * y,
    aten.add.Tensor: _add,
    aten.sub.Tensor: lambda x, y, alpha=1: x - (y if alpha == 1 else y * alpha),
    aten.div.Tensor: lambda x, y: x / y,
    aten.neg.default: lambda x: -x,
    aten.cat.default: _cat,
}


def is_traced(*tensors: Any) -> bool:
    """True when any argument is a :class:`JaxTensor` (the call runs inside a compiled step)."""
    return any(isinstance(t, JaxTensor) for t in tensors)


@functools.cache
def _jitted(fn: Callable[..., Any], static: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    return jax.jit(functools.partial(fn, **dict(static)))


def run_jax(fn: Callable[..., Any], *tensors: torch.Tensor | None, **static: Any) -> Any:
    """``fn(*arrays, **static)`` on the tensors' arrays; the result as tensors of the same kind.

    Inside a trace the tensors are :class:`JaxTensor` and ``fn`` joins the traced step. Eagerly
    (plain torch tensors) ``fn`` runs jitted per ``static`` configuration, and its arrays come back
    as torch tensors over the same buffers. ``None`` arguments pass through; ``static`` values must
    be hashable.
    """
    if is_traced(*tensors):
        args = [t.value if isinstance(t, JaxTensor) else (None if t is None else to_jax(t)) for t in tensors]
        return tree_map(_wrap, fn(*args, **static))
    args = [None if t is None else to_jax(t) for t in tensors]
    out = _jitted(fn, tuple(sorted(static.items())))(*args)
    return jax.tree_util.tree_map(lambda a: to_torch(a) if isinstance(a, jax.Array) else a, out)
