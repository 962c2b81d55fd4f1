"""A fast, torch-free GGUF reader: metadata, tensor infos and memory-mapped data.

`gguf.GGUFReader` builds a numpy view per metadata array item (~50k vocabulary
strings), which takes ~5 s for the default model; parsing with `struct` takes a
fraction of that. Dequantization still uses the `gguf` package's own kernels.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# struct formats of GGUF's scalar value types (gguf.GGUFValueType); 8 is STRING, 9 is ARRAY.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the file


class GGUFFile:
    """Parse a little-endian GGUF v2/v3 file; `metadata_prefix` keeps only matching keys."""

    def __init__(self, path: str | os.PathLike[str], metadata_prefix: str = "", read_tensors: bool = True) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as file:
            self._data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        parser = _Parser(self._data)
        magic, version, tensor_count, kv_count = parser.unpack("4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{self.path!r} is not a little-endian GGUF v2/v3 file")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = parser.string()
            value = parser.value(parser.unpack("I")[0])
            if key.startswith(metadata_prefix) or key == "general.alignment":
                self.metadata[key] = value
        self.tensors: list[GGUFTensorInfo] = []
        if read_tensors:
            self.tensors = self._tensor_infos(parser, tensor_count)

    def _tensor_infos(self, parser: _Parser, count: int) -> list[GGUFTensorInfo]:
        raw = []
        for _ in range(count):
            name = parser.string()
            (n_dims,) = parser.unpack("I")
            shape = parser.unpack(f"{n_dims}Q")
            ggml_type, offset = parser.unpack("IQ")
            raw.append((name, shape, ggml_type, offset))
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = -(-parser.offset // alignment) * alignment
        return [GGUFTensorInfo(n, tuple(int(d) for d in s), t, data_start + o) for n, s, t, o in raw]

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop the tensor's file pages from this process's resident memory once it has been
        read (they stay in the page cache; a later read faults them back in): the whole file
        otherwise stayed resident through the load beside the weights made of it (an 8B Q4_0
        model's load peaked 4 GB higher)."""
        raw, _, _ = self._raw_rows(info)
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
        self._data.madvise(mmap.MADV_DONTNEED, start, info.offset + raw.nbytes - start)

    def blocks(self, info: GGUFTensorInfo, part: tuple[int, int, int] | None = None) -> np.ndarray:
        """The tensor's raw bytes as rows of blocks, uint8 [rows, row_bytes] (a view of the
        file where possible). `part` = (dim, start, length) of a 2-D tensor keeps only those
        rows (dim 0) or columns (dim 1, cut at block boundaries: start and length must be
        multiples of the block size)."""
        raw, block_size, type_size = self._raw_rows(info)
        if part is None:
            return raw
        dim, start, length = self._check_part(info, part)
        if dim == 0:
            return raw[start : start + length]
        if start % block_size or length % block_size:
            raise ValueError(f"GGUF tensor {info.name!r}: columns [{start}, {start + length}) are not on "
                             f"{block_size}-column block boundaries")
        cut = raw.reshape(raw.shape[0], -1, type_size)[:, start // block_size : (start + length) // block_size]
        return np.ascontiguousarray(cut).reshape(raw.shape[0], -1)

    def dequantize(self, info: GGUFTensorInfo, part: tuple[int, int, int] | None = None) -> np.ndarray:
        """The tensor as float32, shaped in PyTorch order (slowest dimension first).

        `part` = (dim, start, length) of a 2-D tensor reads only those rows (dim 0) or
        columns (dim 1): rows are contiguous runs of blocks and columns are cut at block
        boundaries, so only the part is dequantized (a tensor-parallel rank's share).
        Columns that do not fall on block boundaries are cut after dequantizing."""
        import gguf

        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block_size = self.block_size(info)
        cut_after = None
        if part is not None and part[0] == 1 and (part[1] % block_size or part[2] % block_size):
            cut_after, part = (part[1], part[2]), None
        values = self._decode(self.blocks(info, part), qtype)
        if cut_after is not None:
            values = np.ascontiguousarray(values[:, cut_after[0] : cut_after[0] + cut_after[1]])
        return values

    def _raw_rows(self, info: GGUFTensorInfo) -> tuple[np.ndarray, int, int]:
        import gguf

        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
        rows_shape = tuple(reversed(info.shape[1:]))
        row_bytes = info.shape[0] // block_size * type_size
        count = int(np.prod(rows_shape, dtype=np.int64)) * row_bytes
        raw = np.frombuffer(self._data, dtype=np.uint8, count=count, offset=info.offset)
        return raw.reshape(*rows_shape, row_bytes), block_size, type_size

    @staticmethod
    def _check_part(info: GGUFTensorInfo, part: tuple[int, int, int]) -> tuple[int, int, int]:
        if len(info.shape) != 2 or part[0] not in (0, 1):
            raise ValueError(f"GGUF tensor {info.name!r}: parts are rows or columns of a 2-D tensor")
        return part

    @staticmethod
    def decode(raw: np.ndarray, ggml_type: int) -> np.ndarray:
        """Rows of raw blocks of a GGML type [..., row_bytes] (e.g. one expert of `blocks`'
        [experts, rows, row_bytes]) -> float32 [..., columns]."""
        import gguf

        return GGUFFile._decode(raw, gguf.GGMLQuantizationType(ggml_type))

    @staticmethod
    def _decode(raw: np.ndarray, qtype) -> np.ndarray:
        """Rows of raw blocks [..., row_bytes] -> float32 [..., columns]."""
        import gguf

        if qtype == gguf.GGMLQuantizationType.F32:
            return np.ascontiguousarray(raw).view(np.float32).copy()
        if qtype == gguf.GGMLQuantizationType.F16:
            return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
        return gguf.quants.dequantize(raw, qtype)

    def block_size(self, info: GGUFTensorInfo) -> int:
        """Columns per quantization block of a tensor (1 for float tensors)."""
        import gguf

        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)][0]


def read_gguf_metadata(path: str | os.PathLike[str], prefix: str = "") -> dict[str, Any]:
    """Only the metadata key/values whose key starts with `prefix`."""
    return GGUFFile(path, metadata_prefix=prefix, read_tensors=False).metadata


class _Parser:
    """Reads GGUF values one after another from a buffer."""

    def __init__(self, data: mmap.mmap) -> None:
        self._data = data
        self.offset = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        layout = struct.Struct("<" + fmt)
        values = layout.unpack_from(self._data, self.offset)
        self.offset += layout.size
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start, self.offset = self.offset, self.offset + length
        return self._data[start : self.offset].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[item_type]}"))
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.unpack(_SCALAR_FORMATS[value_type])[0]
