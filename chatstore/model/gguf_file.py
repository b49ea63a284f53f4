"""A GGUF file's tensors, read without its metadata: what the server needs at start.

gguf-py's `GGUFReader` builds a numpy view of every metadata value first, the tokenizer's too
(SmolLM2: ~49,000 tokens and ~48,000 merges), which took 2.3 s of a 6.4 s server start on
this machine. The projections need only the tensors (name, dims, ggml type, data) and
`general.architecture`, so this reads the header, steps over the metadata values (an array
of strings is stepped over string by string, nothing built), then maps the tensor infos'
data straight from the file. Layout (GGUF v2/v3, little-endian):

    magic "GGUF" | version u32 | tensors u64 | metadata pairs u64
    pairs        key (u64 length + bytes) | type u32 | value (arrays: type u32, count u64, items)
    tensor infos name | dims u32 | dim u64 × dims (innermost first) | ggml type u32 | offset u64
    data         from the infos' end rounded up to `general.alignment` (32 when absent)

Tensor data is shaped as gguf-py maps it (dims outermost first; a quantized type's last dim in
bytes), so the repacking code reads both the same; tests/engine compare the two readers.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# Metadata value types: fixed sizes (bytes); 8 is a string, 9 an array.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF's dims, innermost first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # read-only view of the file


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._map.data  # a memoryview of the mapped bytes
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_pairs = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        at = 24
        self.metadata: dict[str, object] = {}
        for _ in range(n_pairs):
            key, at = _string(buf, at)
            (kind,) = struct.unpack_from("<I", buf, at)
            value, at = _value(buf, at + 4, kind)
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name, at = _string(buf, at)
            (dims,) = struct.unpack_from("<I", buf, at)
            shape = struct.unpack_from(f"<{dims}Q", buf, at + 4)
            kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            infos.append((name, tuple(int(d) for d in shape), GGMLQuantizationType(kind), offset))
        given = self.metadata.get("general.alignment", 32)
        align = given if isinstance(given, int) and given > 0 else 32
        start = -(-at // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def release_pages(self) -> None:
        """Drop the map's resident pages from this process (madvise DONTNEED; the file's bytes
        stay readable, read again on access). Once the weights are built from the file they are
        not read again, yet every page the load touched would count in the process's RSS: a
        GGUF's whole size."""
        mapped = getattr(self._map, "_mmap", None)  # np.memmap's mmap object
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def _tensor(
        self, start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType, offset: int
    ) -> GGUFTensor:
        dims = tuple(reversed(shape))  # outermost first, as numpy (and gguf-py) shape it
        count = int(np.prod(shape, dtype=np.int64))
        plain = _PLAIN.get(kind)
        if plain is not None:
            nbytes = count * np.dtype(plain).itemsize
            raw = self._map[start + offset : start + offset + nbytes]
            return GGUFTensor(name, shape, kind, raw.view(plain).reshape(dims))
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = count // block * size
        raw = self._map[start + offset : start + offset + nbytes]
        return GGUFTensor(name, shape, kind, raw.reshape((*dims[:-1], dims[-1] // block * size)))


def _string(buf: memoryview, at: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, at)
    return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n


def _value(buf: memoryview, at: int, kind: int) -> tuple[object, int]:
    """A metadata value and where the next begins; arrays are stepped over (None)."""
    if kind == _STRING:
        return _string(buf, at)
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item == _STRING:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, at)
                at += 8 + n
            return None, at
        if item == _ARRAY:
            for _ in range(count):
                _, at = _value(buf, at, _ARRAY)
            return None, at
        return None, at + count * _SIZES[item]
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
    code = fmt.get(kind, "d")
    (value,) = struct.unpack_from("<" + code, buf, at)
    return value, at + _SIZES[kind]
