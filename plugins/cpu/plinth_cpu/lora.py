"""The cpu backend's batched LoRA op: the step's tokens grouped by adapter, one GEMM per group.

The reference op multiplies token by token. Here :meth:`CpuLoRA.prepare_batch` groups the step's
tokens once per step, and each shrink/expand is one torch GEMM per adapter present: on a run of
consecutive tokens (a sequence's chunk, or neighbouring sequences with the same adapter) a slice, no
copy; where an adapter's tokens are scattered over many runs, a gather and a scatter-add.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plinth.platform.backend import LoRABatch, LoRAKernels


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(slot, start, end)`` of every run of equal consecutive slots other than -1."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for t in range(1, len(slots) + 1):
        if t == len(slots) or slots[t] != slots[start]:
            if slots[start] >= 0:
                runs.append((slots[start], start, t))
            start = t
    return runs


class CpuLoRA(LoRAKernels):
    """Batched LoRA with torch GEMMs over the step's adapter groups (see the module docstring)."""

    def prepare_batch(self, token_slots: Sequence[int], device: torch.device) -> LoRABatch:
        """Group the step's tokens: runs of one adapter as slices, or, where an adapter's tokens are
        spread over more runs than there are adapters, one index tensor per adapter."""
        slots = list(token_slots)
        batch = LoRABatch(torch.tensor(slots, dtype=torch.long, device=device), slots)
        runs = _runs(slots)
        adapters = sorted({s for s, _, _ in runs})
        if len(runs) <= len(adapters):  # every adapter's tokens are contiguous: slices, no copies
            batch.data["runs"] = runs
        else:  # many short runs (a decode batch of mixed adapters): one gather per adapter
            # the indices from the host list: torch.nonzero took ~0.2 ms a call here, the list ~10 us
            batch.data["groups"] = [
                (a, torch.tensor([t for t, s in enumerate(slots) if s == a], dtype=torch.long, device=device))
                for a in adapters
            ]  # [(slot, token indices [n])]
        return batch

    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        # rows of tokens without an adapter stay unwritten: expand never reads them
        out = torch.empty(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)  # [T, rank]
        runs = batch.data.get("runs")
        if runs is not None:
            for slot, start, end in runs:
                torch.mm(x[start:end], a[slot].t(), out=out[start:end])
            return out
        for slot, idx in batch.data["groups"]:
            out.index_copy_(0, idx, x.index_select(0, idx) @ a[slot].t())
        return out

    def expand(self, y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
        runs = batch.data.get("runs")
        if runs is not None:
            for slot, start, end in runs:
                y[start:end].addmm_(s[start:end], b[slot].t())
            return
        for slot, idx in batch.data["groups"]:
            y.index_add_(0, idx, s.index_select(0, idx) @ b[slot].t())
