"""The default DeviceServices: the host's memory as the KV cache sizing sees it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from plinth.platform.backend import DeviceServices, host_memory_info


def test_host_memory_counts_what_the_kernel_can_reclaim() -> None:
    """Available memory is /proc/meminfo's MemAvailable (free pages plus reclaimable page cache: a
    checkpoint just read through the cache does not shrink the KV cache), never above the total; the
    default DeviceServices reports it."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("no /proc/meminfo on this host: the free pages are the figure")
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()}
    available, total = host_memory_info()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available <= total
    # read a moment apart: within 256 MiB of the kernel's own figure, and at least its free pages then
    assert abs(available - fields["MemAvailable"]) < 256 << 20
    assert available >= fields["MemFree"] - (256 << 20)
    free, total2 = DeviceServices(torch.device("cpu")).memory_info()
    assert total2 == total and abs(free - available) < 256 << 20
