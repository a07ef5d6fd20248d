"""KV-cache writes: bit-exact where the dtypes agree, padding tokens (slot -1) skipped, and not one
bit changed in a slot the call was not given.

The cache starts as NaN everywhere; padding tokens carry a loud finite value (so writing one
anywhere shows); the first and last slots of the cache are never given, so a ``-1`` used as an
index (Python's "last element") is caught.
"""

from __future__ import annotations

import torch

from plinth.platform.backend import AttentionSpec, Backend, torch_dtype
from plinth_conformance.cases import KVWriteCase
from plinth_conformance.checks import declared_attention, kernel_call
from plinth_conformance.paged import canonical_view
from plinth_conformance.tolerance import bits

#: Pages in the test cache; tokens written: two pages and a bit, three of them padding.
NUM_BLOCKS = 12
PADDING_VALUE = 12345.0


def _inputs(case: KVWriteCase, spec: AttentionSpec, num_tokens: int, gen: torch.Generator):  # noqa: ANN202
    """key, value [T, Hkv, D]: views into a fused qkv projection where ``case.layout`` says so
    (both, or only one of them: each operand's layout varies on its own)."""
    dtype = torch_dtype(case.dtype)
    hkv, d, heads = spec.num_kv_heads, spec.head_size, spec.num_heads
    if case.layout == "strided":
        qkv = torch.randn(num_tokens, (heads + 2 * hkv) * d, generator=gen).to(dtype)  # [T, (H+2Hkv)*D]
        key = qkv[:, heads * d : (heads + hkv) * d].view(num_tokens, hkv, d)
        value = qkv[:, (heads + hkv) * d :].view(num_tokens, hkv, d)
        return key, value
    key = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    value = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
    if case.layout in ("k-strided", "v-strided"):
        # the strided one lives in a wider buffer ([T, Hkv + 1, D + 8]: row and head strides differ)
        wide = torch.full((num_tokens, hkv + 1, d + 8), float("nan"), dtype=dtype)
        which = key if case.layout == "k-strided" else value
        wide[:, 1:, 4 : d + 4] = which
        view = wide[:, 1:, 4 : d + 4]
        return (view, value) if case.layout == "k-strided" else (key, view)
    return key, value


def test_kv_write(plinth_backend: Backend, kv_write_case: KVWriteCase) -> None:
    """Given slots hold exactly the input (cast to the cache dtype); every other bit is unchanged."""
    case = kv_write_case
    spec = case.spec
    gen = torch.Generator().manual_seed(case.seed)
    kernels = declared_attention(plinth_backend, spec, case.id)
    layout = plinth_backend.capabilities().kv_cache_layout
    device = plinth_backend.device_services().device
    block = case.block_size
    total = NUM_BLOCKS * block
    num_tokens = 2 * block + 5
    pad_at = sorted({0, num_tokens // 2, num_tokens - 1})  # first, middle and last token are padding
    real = num_tokens - len(pad_at)
    # distinct random slots, never the cache's first or last one
    chosen = (torch.randperm(total - 2, generator=gen)[:real] + 1).tolist()
    it = iter(chosen)
    slots = [-1 if t in pad_at else next(it) for t in range(num_tokens)]
    key, value = _inputs(case, spec, num_tokens, gen)
    key[pad_at] = PADDING_VALUE
    value[pad_at] = -PADDING_VALUE

    with kernel_call(case.id, "allocate_kv_cache()"):
        cache = plinth_backend.allocate_kv_cache(spec, NUM_BLOCKS)
    cache.fill_(float("nan"))
    expected = cache.cpu().clone()
    canon = canonical_view(expected, layout, spec)  # [2, NB, B, Hkv, D]
    real_t = torch.tensor([t for t in range(num_tokens) if t not in pad_at])
    given = torch.tensor(chosen)
    canon[0, given // block, given % block] = key[real_t].to(expected.dtype)
    canon[1, given // block, given % block] = value[real_t].to(expected.dtype)
    key_bits, value_bits = bits(key).clone(), bits(value).clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)

    with kernel_call(case.id, "write_kv()"):
        kernels.write_kv(key.to(device), value.to(device), cache, slot_mapping)
        plinth_backend.device_services().synchronize()

    assert torch.equal(bits(key), key_bits) and torch.equal(bits(value), value_bits), (
        f"[{case.id}] write_kv() modified its key/value inputs"
    )
    differs = canonical_view(bits(cache.cpu()) != bits(expected), layout, spec)  # [2, NB, B, Hkv, D]
    slot_differs = differs.any(dim=-1).any(dim=-1).any(dim=0).flatten()  # [NB * B]
    wrong = slot_differs.nonzero().flatten().tolist()
    given_set = set(chosen)
    wrong_given = [s for s in wrong if s in given_set]
    foreign = [s for s in wrong if s not in given_set]
    problems = []
    if wrong_given:
        problems.append(
            f"{len(wrong_given)} of {real} written slots are not bit-exact copies of the input "
            f"(cast to {case.kv_dtype}), e.g. slots {wrong_given[:5]}"
        )
    if foreign:
        hint = " (the cache's last slot: a padding token's -1 was used as an index)" if total - 1 in foreign else ""
        problems.append(f"{len(foreign)} slots it was not given were changed, e.g. {foreign[:5]}{hint}")
    assert not problems, f"[{case.id}] " + "; ".join(problems)
