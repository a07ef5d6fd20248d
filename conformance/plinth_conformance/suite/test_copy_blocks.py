"""Copy-on-write of KV blocks: ``copy_blocks(kv_caches, pairs)`` over every layer's cache.

The scheduler asks for it when a shared block (an ``n > 1`` fork or a prefix hit) is about to be
written. Each layer's cache is filled with distinct random values; the pairs copy one source to
two targets (a fork) and two more sources to one target each. The targets must then hold the
sources' K *and* V bit for bit in every layer, and not one other bit may change.
"""

from __future__ import annotations

import torch

from plinth.platform.backend import Backend, torch_dtype
from plinth_conformance.checks import declared_attention, kernel_call
from plinth_conformance.coverage import CopyBlocksCase
from plinth_conformance.paged import canonical_view
from plinth_conformance.tolerance import bits

NUM_BLOCKS = 10


def test_copy_blocks(plinth_backend: Backend, copy_blocks_case: CopyBlocksCase) -> None:
    """Targets equal their sources (K and V, every layer); everything else is unchanged."""
    case = copy_blocks_case
    spec = case.spec
    gen = torch.Generator().manual_seed(case.seed)
    kernels = declared_attention(plinth_backend, spec, case.id)
    layout = plinth_backend.capabilities().kv_cache_layout
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    # a fork (one source, two targets), then two plain copies; no target is also a source
    pairs = [(order[0], order[1]), (order[0], order[2]), (order[3], order[4]), (order[5], order[6])]
    caches, expected = [], []
    for _ in range(case.layers):
        with kernel_call(case.id, "allocate_kv_cache()"):
            cache = plinth_backend.allocate_kv_cache(spec, NUM_BLOCKS)
        host = torch.randn(tuple(cache.shape), generator=gen).to(torch_dtype(case.kv_dtype))
        cache.copy_(host)
        want = host.clone()
        view = canonical_view(want, layout, spec)  # [2, NB, B, Hkv, D]
        for src, dst in pairs:
            view[:, dst] = canonical_view(host, layout, spec)[:, src]
        caches.append(cache)
        expected.append(want)

    with kernel_call(case.id, "copy_blocks()"):
        kernels.copy_blocks(caches, pairs)
        plinth_backend.device_services().synchronize()

    problems = []
    for layer, (cache, want) in enumerate(zip(caches, expected, strict=True)):
        differs = canonical_view(bits(cache.cpu()) != bits(want), layout, spec)  # [2, NB, B, Hkv, D]
        for half, name in ((0, "K"), (1, "V")):
            wrong = differs[half].flatten(1).any(dim=1).nonzero().flatten().tolist()
            targets = [b for b in wrong if b in {d for _, d in pairs}]
            others = [b for b in wrong if b not in targets]
            if targets:
                problems.append(f"layer {layer}: {name} of target blocks {targets} is not a copy of its source")
            if others:
                problems.append(f"layer {layer}: {name} of blocks {others} changed, though no pair targets them")
    assert not problems, f"[{case.id}] copy_blocks({pairs}): " + "; ".join(problems)
