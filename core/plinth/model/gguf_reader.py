"""A fast reader for GGUF headers and tensors.

``gguf.GGUFReader`` builds a numpy view per metadata string, which takes seconds for a vocabulary of
50k tokens plus 50k merges. This reader walks the header once with ``struct`` over an ``mmap``
(tens of milliseconds), and leaves tensor data in the map until :meth:`GGUFFile.tensor` asks for
it. F32, F16, Q8_0, Q4_0 and Q4_1 are decoded here (in torch); other types are dequantized by
``gguf.quants.dequantize``. The ``gguf`` package is imported only for those (about 0.1 s of a cold
start), and for type ids missing from :data:`GGML_TYPES`.
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

from plinth.platform.quant import QUANT_BLOCKS, QuantizedWeight, dequantize_blocks

# GGUF metadata value types (the GGUF specification): the scalars' struct formats, and the two others
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),  # UINT8
    1: ("<b", 1),  # INT8
    2: ("<H", 2),  # UINT16
    3: ("<h", 2),  # INT16
    4: ("<I", 4),  # UINT32
    5: ("<i", 4),  # INT32
    6: ("<f", 4),  # FLOAT32
    7: ("<?", 1),  # BOOL
    10: ("<Q", 8),  # UINT64
    11: ("<q", 8),  # INT64
    12: ("<d", 8),  # FLOAT64
}
_STRING, _ARRAY = 8, 9

#: ggml tensor types by id: (name, elements per block, bytes per block), as in ggml.h. Ids not here
#: are looked up in the ``gguf`` package (newer types).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    30: ("BF16", 1, 2),
}


def _ggml_type(type_id: int) -> tuple[str, int, int] | None:
    """(name, block elements, block bytes) of a ggml type id, or None if neither table knows it."""
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(type_id)
    except ValueError:
        return None
    block, block_bytes = GGML_QUANT_SIZES[kind]
    return kind.name, block, block_bytes


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
_TORCH_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": lambda blocks: dequantize_blocks("q8_0", blocks),
    "Q4_0": _dequant_q4_0,
    "Q4_1": lambda blocks: dequantize_blocks("q4_1", blocks),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """Where a tensor lives in the file. ``shape`` is in torch order (GGUF stores it reversed);
    ``qtype`` is the ggml type id, ``type_name`` its name ("F32", "Q4_1", ...)."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    type_name: str
    block: int  # elements per block
    block_bytes: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata (a plain dict) and tensor table, with tensors read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            # private (copy-on-write): quantized weights are views of the map, and a write to one
            # (none is expected) would change this process's copy, never the file
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
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
        for name, shape, qtype, (type_name, block, block_bytes), rel in infos:
            nbytes = prod(shape) // block * block_bytes
            offset = data_start + rel
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, type_name, block, block_bytes, offset, nbytes)
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
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype}")
        elem_type, count = self._unpack("<IQ", 12)
        if elem_type in _SCALARS:
            # numeric arrays (token types, scores) in one numpy read instead of a Python loop
            fmt, size = _SCALARS[elem_type]
            values = np.frombuffer(self._map, dtype=np.dtype(fmt), count=count, offset=self._pos).tolist()
            self._pos += size * count
            return values
        if elem_type == _STRING:
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

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, tuple[str, int, int], int]:
        name = self._string()
        (n_dims,) = self._unpack("<I", 4)
        dims = self._unpack(f"<{n_dims}Q", 8 * n_dims)
        qtype, offset = self._unpack("<IQ", 12)
        kind = _ggml_type(qtype)
        if kind is None:
            raise GGUFFormatError(f"{self.path}: tensor {name} has unknown ggml type {qtype}")
        return name, tuple(int(d) for d in reversed(dims)), int(qtype), kind, int(offset)

    # -- tensors -----------------------------------------------------------------------------------

    def tensor(self, name: str, *, as_stored: bool = False) -> torch.Tensor:
        """Tensor ``name`` dequantized to fp32 (a fresh tensor, not a view of the file).

        ``as_stored``: an F16 or BF16 tensor comes in its own dtype instead (the same values, half
        the bytes), for a GEMM that takes 16-bit weights as stored (plugin API 1.14)."""
        info = self.tensors[name]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if as_stored and info.type_name == "F16":
            return torch.from_numpy(raw.view(np.float16).copy()).reshape(info.shape)
        if as_stored and info.type_name == "BF16":
            return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).reshape(info.shape)
        if info.type_name == "F32":
            out = raw.view(np.float32).copy()
        elif info.type_name == "F16":
            out = raw.view(np.float16).astype(np.float32)
        elif info.type_name in _TORCH_DEQUANT:
            blocks = torch.from_numpy(raw.reshape(-1, info.block_bytes).copy())  # [n_blocks, block_bytes]
            return _TORCH_DEQUANT[info.type_name](blocks).reshape(info.shape)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            rows = prod(info.shape[:-1])
            try:
                row_bytes = info.shape[-1] // info.block * info.block_bytes
                out = dequantize(raw.reshape(rows, row_bytes), GGMLQuantizationType(info.qtype))
            except NotImplementedError:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name} is {info.type_name}, which gguf cannot dequantize"
                ) from None
        return torch.from_numpy(out.reshape(info.shape))

    def quantized(self, name: str) -> QuantizedWeight | None:
        """Tensor ``name`` as its raw blocks, if it is a 2-D tensor in a format of :mod:`plinth.platform.quant`.

        The blocks are a view of the file's map (no copy: the page cache backs them)."""
        info = self.tensors[name]
        fmt = info.type_name.lower()
        if fmt not in QUANT_BLOCKS or len(info.shape) != 2:
            return None
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        blocks = torch.from_numpy(raw.reshape(info.shape[0], -1))  # [N, K / 32 * bytes]
        return QuantizedWeight(fmt, info.shape[0], info.shape[1], blocks)

    def quantized_experts(self, name: str) -> list[QuantizedWeight] | None:
        """A 3-D expert tensor ``name`` [E, N, K] as E raw-block weights [N, K], if its format is one of
        :mod:`plinth.platform.quant` (views of the file's map, like :meth:`quantized`)."""
        info = self.tensors[name]
        fmt = info.type_name.lower()
        if fmt not in QUANT_BLOCKS or len(info.shape) != 3:
            return None
        experts, rows, cols = info.shape
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        blocks = torch.from_numpy(raw.reshape(experts, rows, -1))  # [E, N, K / 32 * bytes]
        return [QuantizedWeight(fmt, rows, cols, blocks[e]) for e in range(experts)]

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(gguf_name, fp32 tensor)`` in file order, one dequantized at a time."""
        for name in self.tensors:
            yield name, self.tensor(name)
