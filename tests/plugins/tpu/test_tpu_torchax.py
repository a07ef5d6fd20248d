"""torchax on torch 2.13 (through plinth_tpu.torchax_compat) and the kernel called from torch code."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
import torch
from plinth_tpu.ragged_attention import ragged_paged_attention
from plinth_tpu.torchax_compat import RemovedOverload, import_torchax
from rpa_batches import make_batch

# not importorskip: a bare `import torchax` is exactly what fails on torch 2.13
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchax") is None, reason="torchax not installed")


def test_torchax_imports_on_this_torch_and_the_hook_is_gone() -> None:
    _torchax, env = import_torchax()
    assert env is import_torchax()[1]  # one environment
    with pytest.raises(AttributeError):
        torch.ops.aten.prod.dim_Dimname  # noqa: B018 - after loading, torch behaves as before
    assert not isinstance(torch.ops.aten.prod.dim_int, RemovedOverload)
    with env:
        x = torch.arange(6, dtype=torch.float32, device="jax").reshape(2, 3)
        got = (x.std(dim=-1) * 2).to("cpu").numpy()
    np.testing.assert_allclose(got, (torch.arange(6.0).reshape(2, 3).std(dim=-1) * 2).numpy(), rtol=1e-6)


def test_ragged_attention_called_from_a_jitted_torch_function() -> None:
    import_torchax()
    from torchax import interop

    b = make_batch([(1, 20), (6, 30)], num_heads=4, num_kv_heads=2, head_size=64, tokens_bucket=8)
    kernel = interop.torch_view(lambda *a: ragged_paged_attention(*a, scale=0.125, block_size=16, interpret=True))

    def layer(q: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, cache = kernel(q * 1.0, *rest)  # torch ops around the JAX kernel, traced together
        return out + 0.0, cache

    step = jax.jit(interop.jax_view(layer))  # a JAX function of JAX arrays: what the runner compiles
    out, cache = step(*b.args())
    want_out, want_cache = ragged_paged_attention(*b.args(), scale=0.125, block_size=16, interpret=True)
    assert isinstance(out, jax.Array) and out.shape == b.q.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))
