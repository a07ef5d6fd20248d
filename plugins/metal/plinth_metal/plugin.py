"""Entry point of the ``plinth-metal`` distribution (group ``plinth.backends``, name ``metal``).

Importing this module initialises no MPS device and never imports MLX (the provider imports it on
first use): a machine without Apple Silicon or MLX still loads the plugin and lists ``metal`` with
score 0 and the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend, KernelProvider
from plinth_metal.backend import MetalBackend
from plinth_metal.mlx_provider import MLX_ENV, MlxProvider, mlx_available, mlx_requested


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The metal backend: one object, cheap to build, touches no hardware."""
    return [MetalBackend()]


@hookimpl
def plinth_register_kernels(backend_name: str) -> Sequence[KernelProvider]:
    """The MLX provider, for ``metal`` only, and only when MLX is installed and ``PLINTH_METAL_MLX=1``
    (imported only then: the plugin never needs MLX)."""
    if backend_name != "metal" or not mlx_requested():
        return []
    if not mlx_available():
        raise RuntimeError(
            f"{MLX_ENV}=1, but mlx is not installed (pip install 'plinth-metal[mlx]', or 'mlx[cpu]' off a Mac)"
        )
    return [MlxProvider()]
