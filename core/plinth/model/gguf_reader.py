"""A fast reader for GGUF headers and tensors, on top of the ``gguf`` package's type tables.

``gguf.GGUFReader`` builds a numpy view per metadata string, which takes seconds for a vocabulary of
50k tokens plus 50k merges. This reader walks the header once with ``struct`` over an ``mmap``
(tens of milliseconds), and leaves tensor data in the map until :meth:`GGUFFile.tensor` asks for
it; dequantization is ``gguf.quants.dequantize``, with torch fast paths for Q8_0/Q4_0/Q4_1.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from plinth.quant import QUANT_BLOCKS, QuantizedWeight, dequantize_blocks

_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_DEFAULT_ALIGNMENT = 32


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte ``start`` of every block, as fp32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] 4-bit values: low nibbles are elements 0-15, high 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 scale d, 16 bytes of nibbles; value = d * (q - 8)
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()




# The commonest small-model formats, in torch: several times faster than gguf's numpy code and
# bit-identical to it (same fp32 operations in the same order). Other formats go through gguf.
_TORCH_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: lambda blocks: dequantize_blocks("q8_0", blocks),
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: lambda blocks: dequantize_blocks("q4_1", blocks),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """Where a tensor lives in the file. ``shape`` is in torch order (GGUF stores it reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata (a plain dict) and tensor table, with tensors read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != b"GGUF":
            raise GGUFFormatError(f"{self.path} is not a GGUF file (bad magic {bytes(self._map[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._map, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I", 4)
            self.metadata[key] = self._value(vtype)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, qtype, rel in infos:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            nbytes = prod(shape) // block * block_bytes
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + rel, nbytes)
            if data_start + rel + nbytes > len(self._map):
                raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")

    # -- header parsing ----------------------------------------------------------------------------

    def _unpack(self, fmt: str, size: int) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q", 8)
        start = self._pos
        self._pos += length
        return self._map[start : self._pos].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self._unpack(fmt, size)[0]
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype != GGUFValueType.ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype}")
        elem_type, count = self._unpack("<IQ", 12)
        if elem_type in _SCALARS:
            # numeric arrays (token types, scores) in one numpy read instead of a Python loop
            fmt, size = _SCALARS[elem_type]
            values = np.frombuffer(self._map, dtype=np.dtype(fmt), count=count, offset=self._pos).tolist()
            self._pos += size * count
            return values
        if elem_type == GGUFValueType.STRING:
            return self._strings(count)
        return [self._value(elem_type) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        # the vocabulary and merges (~50k strings each): one tight loop, ~2x faster than _value per item
        buf, pos, unpack, out = self._map, self._pos, struct.unpack_from, []
        for _ in range(count):
            (length,) = unpack("<Q", buf, pos)
            pos += 8
            out.append(buf[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I", 4)
        dims = self._unpack(f"<{n_dims}Q", 8 * n_dims)
        qtype, offset = self._unpack("<IQ", 12)
        try:
            gtype = GGMLQuantizationType(qtype)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: tensor {name} has unknown ggml type {qtype}") from None
        return name, tuple(int(d) for d in reversed(dims)), gtype, int(offset)

    # -- tensors -----------------------------------------------------------------------------------

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized to fp32 (a fresh tensor, not a view of the file)."""
        info = self.tensors[name]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if info.qtype == GGMLQuantizationType.F32:
            out = raw.view(np.float32).copy()
        elif info.qtype == GGMLQuantizationType.F16:
            out = raw.view(np.float16).astype(np.float32)
        elif info.qtype in _TORCH_DEQUANT:
            block, block_bytes = GGML_QUANT_SIZES[info.qtype]
            blocks = torch.from_numpy(raw.reshape(-1, block_bytes).copy())  # [n_blocks, block_bytes]
            return _TORCH_DEQUANT[info.qtype](blocks).reshape(info.shape)
        else:
            block, block_bytes = GGML_QUANT_SIZES[info.qtype]
            rows = prod(info.shape[:-1])
            try:
                out = dequantize(raw.reshape(rows, info.shape[-1] // block * block_bytes), info.qtype)
            except NotImplementedError:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name} is {info.qtype.name}, which gguf cannot dequantize"
                ) from None
        return torch.from_numpy(out.reshape(info.shape))

    def quantized(self, name: str) -> QuantizedWeight | None:
        """Tensor ``name`` as its raw blocks, if it is a 2-D tensor in a format of :mod:`plinth.quant`."""
        info = self.tensors[name]
        fmt = info.qtype.name.lower()
        if fmt not in QUANT_BLOCKS or len(info.shape) != 2:
            return None
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        blocks = torch.from_numpy(raw.reshape(info.shape[0], -1).copy())  # [N, K / 32 * bytes]
        return QuantizedWeight(fmt, info.shape[0], info.shape[1], blocks)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(gguf_name, fp32 tensor)`` in file order, one dequantized at a time."""
        for name in self.tensors:
            yield name, self.tensor(name)
