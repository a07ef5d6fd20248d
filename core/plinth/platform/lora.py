"""The batched LoRA op of the contract (plugin API 1.11): shrink and expand over a step's tokens.

A LoRA-enabled engine keeps every adapter's low-rank matrices in pre-allocated stacks, one slot per
resident adapter: ``A`` ``[max_loras, rank, in]`` and ``B`` ``[max_loras, out, rank]`` for each
adapted projection (the scale folded into ``B``). Each step, every token names the slot of its
request's adapter (-1: none), and each adapted projection adds ``(x @ A[slot].T) @ B[slot].T`` to
the base layer's output for those tokens: a *shrink* to the rank, then an *expand* back. The tokens
of different adapters (and of none) run in one batch.

The op is obtained once, when the engine enables LoRA (``Backend.lora_kernels(LoRASpec)`` or a
``KernelProvider``'s; the reference :class:`plinth.platform.reference.ReferenceLoRA` otherwise),
and the step loop calls only its methods: :meth:`LoRAKernels.prepare_batch` once per step, then
:meth:`~LoRAKernels.shrink` and :meth:`~LoRAKernels.expand` per adapted projection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plinth.platform.values import LoRASpec


@dataclass(slots=True)
class LoRABatch:
    """Which adapter slot each token of one step uses, as the op prepared it for the step.

    ``token_slots`` is ``[T]`` int64 on the device, -1 for a token whose request has no adapter;
    ``slots`` the same values on the host. ``data`` holds what the op precomputed once for the step
    (token groups, index tensors), so that its per-projection calls do not recompute it.

    .. versionadded:: 1.11
    """

    token_slots: torch.Tensor
    slots: Sequence[int]
    data: dict[str, Any] = field(default_factory=dict)


class LoRAKernels(ABC):
    """A batched LoRA op for one :class:`LoRASpec`.

    Semantics, for every token ``t`` whose slot ``s = token_slots[t]`` is not -1::

        shrink:  out[t] = x[t] @ a[s].T                      # [in] -> [rank]
        expand:  y[t]  += s_in[t] @ b[s].T                   # [rank] -> [out], in place

    Rows of tokens with slot -1: ``shrink`` may leave anything there (``expand`` ignores them) and
    ``expand`` leaves ``y`` untouched. A fast implementation groups the step's tokens by adapter, so
    each adapter's matrices are read once per step. The reference
    (:class:`plinth.platform.reference.ReferenceLoRA`) is the oracle and the per-op fallback.

    ``y`` and ``s_in`` may be column slices of wider tensors (the fused q/k/v and gate/up outputs:
    each adapted module is a slice of the fused output): an implementation must honour their strides.
    No method may allocate per-step state the next step relies on, nor keep ``y``.

    .. versionadded:: 1.11
    """

    def __init__(self, spec: LoRASpec) -> None:
        self.spec = spec

    def prepare_batch(self, token_slots: Sequence[int], device: torch.device) -> LoRABatch:
        """The step's :class:`LoRABatch` from each token's slot (-1: none); called once per step
        that has any adapter token, before the forward. The default keeps the slots only."""
        return LoRABatch(torch.tensor(list(token_slots), dtype=torch.long, device=device), token_slots)

    @abstractmethod
    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """``x`` [T, in] and ``a`` [max_loras, rank, in] -> ``x[t] @ a[slot[t]].T`` [T, rank]."""

    @abstractmethod
    def expand(self, y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
        """``y[t] += s[t] @ b[slot[t]].T`` in place for the tokens with a slot; ``y`` [T, out] (maybe
        a column slice), ``s`` [T, rank] (maybe a column slice), ``b`` [max_loras, out, rank]."""
