"""Huge-page host buffers (plinth_cpu.host_memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from smaps import mapping_field

from plinth_cpu.host_memory import HUGE_PAGE, huge_page_tensor

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _thp_eligible(address: int) -> bool | None:
    """The THPeligible flag of the mapping holding ``address`` (None if smaps does not say)."""
    flag = mapping_field(address, "THPeligible")
    return None if flag is None else flag == "1"


def test_a_large_buffer_is_zeroed_aligned_and_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLINTH_HUGE_PAGES", raising=False)
    t = huge_page_tensor((3, HUGE_PAGE // 4), torch.float32)
    assert t.shape == (3, HUGE_PAGE // 4) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel()
    if _thp_mode() == "madvise":
        assert _thp_eligible(t.data_ptr()) is not False


def test_the_switch_turns_advice_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLINTH_HUGE_PAGES", "0")
    t = huge_page_tensor((HUGE_PAGE,), torch.uint8)
    assert not t.any() and t.numel() == HUGE_PAGE
    if _thp_mode() == "madvise":
        assert _thp_eligible(t.data_ptr()) is not True


def test_small_and_empty_buffers() -> None:
    assert huge_page_tensor((0, 4), torch.float32).shape == (0, 4)
    small = huge_page_tensor((5, 7), torch.float16)
    assert small.shape == (5, 7) and not small.any()
