"""A GGUF file read within bounds: its header, metadata and tensor table checked as they are
read, before anything proportional to what they claim is done.

Contract:
- `read_gguf(path)` maps the file (read-only) and walks it once: the magic and version, the
  counts, each key (its length, UTF-8, no duplicate), each value's type and length, array
  nesting, then each tensor's name, dimensions, type and offset. Every count, length and
  offset is checked against the bytes that remain in the file and against the limits below
  before it is used; a file that breaks one is a `GGUFError` whose one-line message names the
  field, the value and the limit.
- Tensors (`GGUFFile.tensors`, in the file's order): a known ggml type, 1 to 4 positive
  dimensions whose first is a whole number of the type's blocks, an aligned offset, data
  inside the file, each tensor's data after the end of the one before (as llama.cpp reads
  them: an offset that wraps, or tensors that overlap, are refused). `TensorInfo.data` is a
  view of the map, shaped as the gguf package's reader shapes it.
- Metadata (`GGUFFile.metadata`, a read-only mapping): the walk records where each value is;
  a value is decoded when it is looked up. Scalars are Python values; numeric arrays numpy
  views of the map (no object per element); string arrays lists of str; arrays of arrays
  lists. A value whose bytes are not UTF-8 is decoded with replacement characters.
- Little-endian GGUF v2 and v3 only (llama.cpp's own), as the gguf package reads.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class GGUFError(ValueError):
    """A GGUF file Orchard cannot serve as it is; the message names what and why."""


# Limits, each far above what real files carry; the file's own size bounds the rest.
MAX_KV_COUNT = 1 << 16  # real files carry under a hundred keys
MAX_TENSOR_COUNT = 1 << 20  # the largest models carry a few thousand tensors
MAX_KEY_LENGTH = (1 << 16) - 1  # the GGUF specification's
MAX_TENSOR_NAME = 63  # ggml's GGML_MAX_NAME (64, with the NUL): llama.cpp loads no longer name
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # llama.cpp reads no array of arrays; one level for writers that nest
MAX_TENSOR_ELEMENTS = 1 << 40  # ~500x the largest real tensor, and exact in int64 arithmetic
SUPPORTED_VERSIONS = (2, 3)  # v1 had 32-bit counts; llama.cpp reads v2 and v3
DEFAULT_ALIGNMENT = 32  # GGUF's, when general.alignment is absent

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_NUMPY = {UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4", FLOAT32: "<f4",
          BOOL: "<u1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}
TYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32", INT32: "int32",
              FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array", UINT64: "uint64",
              INT64: "int64", FLOAT64: "float64"}
_STRING_MIN = 8  # a string's length field
_ARRAY_MIN = 12  # an array's item type and count
_KV_MIN = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
_TENSOR_MIN = 8 + 1 + 4 + 8 + 4 + 8  # name length, a 1-byte name, n_dims, one dim, type, offset


def shown(value, limit: int = 80) -> str:
    """A value as an error message shows it: its repr (one line), cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, weights per block, bytes per block), from the gguf package."""
    import gguf

    return {int(t): (t.name, block, size) for t, (block, size) in gguf.GGML_QUANT_SIZES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF lists ne[0] (columns) first
    offset: int  # of its data, from the start of the file
    nbytes: int
    block: int  # weights per block of its type
    block_bytes: int
    _map: object = None

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as the gguf package's reader shapes them: float and integer
        types by element, quantized types as rows of bytes."""
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}
        raw = np.frombuffer(self._map, dtype=np.uint8, count=self.nbytes, offset=self.offset)
        if self.type_name in plain:
            return raw.view(plain[self.type_name]).reshape(self.shape)
        return raw.reshape(*self.shape[:-1], self.shape[-1] // self.block * self.block_bytes)


class Metadata(Mapping):
    """Key -> value, decoded when looked up from where the walk found it (see the module)."""

    def __init__(self, buf, places: dict[str, tuple[int, int]]):
        self._buf, self._places = buf, places  # key -> (value type, offset of the value)

    def __getitem__(self, key: str):
        vtype, pos = self._places[key]
        return _decode(self._buf, vtype, pos)[0]

    def __iter__(self):
        return iter(self._places)

    def __len__(self) -> int:
        return len(self._places)

    def type_of(self, key: str) -> str:
        """The GGUF type of a key's value: "uint32", "string", "array of string", ..."""
        vtype, pos = self._places[key]
        if vtype != ARRAY:
            return TYPE_NAMES[vtype]
        (itype,) = struct.unpack_from("<I", self._buf, pos)
        return f"array of {TYPE_NAMES[itype]}"


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: Metadata
    tensors: list[TensorInfo]
    alignment: int
    data_start: int  # where the data section begins
    size: int


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's header, metadata and tensor table, each checked as it is read (see the module)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFError(f"a GGUF file is at least 24 bytes; {path.name} has {size}")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e.strerror or e}") from e
    walk = _Walk(buf, size)
    return walk.file(path)


class _Walk:
    """One pass over the header: a cursor that never reads past the end of the file."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(f"truncated: {what} needs {n} bytes at offset {self.pos}, the file has "
                            f"{self.size - self.pos} left")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return out

    def count(self, what: str, limit: int, each: int) -> int:
        """A uint64 count of items of at least `each` bytes: within `limit` and the file."""
        (n,) = self.unpack("<Q", what)
        left = self.size - self.pos
        if n > limit:
            raise GGUFError(f"{what} {n} is over the limit of {limit}")
        if n * each > left:
            raise GGUFError(f"{what} {n} cannot fit: {n} x at least {each} bytes, the file has {left} left")
        return n

    def string(self, what: str, limit: int | None = None, keep: bool = True) -> bytes | None:
        """A string's bytes (`keep`), or only stepped over."""
        (n,) = self.unpack("<Q", f"{what} length")
        if limit is not None and n > limit:
            raise GGUFError(f"{what} length {n} is over the limit of {limit}")
        self.need(n, f"{what} ({n} bytes)")
        self.pos += n
        return self.buf[self.pos - n:self.pos] if keep else None

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        """Step over a value of type `vtype`, checking its lengths (see `_decode` for reading it)."""
        if vtype == STRING:
            self.string(what, keep=False)
        elif vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(f"{what}: arrays nested over the limit of {MAX_ARRAY_DEPTH} deep")
            (itype,) = self.unpack("<I", f"{what} item type")
            if itype not in TYPE_NAMES:
                raise GGUFError(f"{what}: unknown array item type {itype} (known: 0-12)")
            each = np.dtype(_NUMPY[itype]).itemsize if itype in _NUMPY else (
                _STRING_MIN if itype == STRING else _ARRAY_MIN)
            n = self.count(f"{what} array length", 1 << 62, each)
            if itype in _NUMPY:
                self.pos += n * each
            elif itype == STRING:  # a length field per item: no string is made here
                buf, pos, end = self.buf, self.pos, self.size
                for _ in range(n):
                    if pos + 8 > end:
                        break
                    (k,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + k
                    if pos > end:
                        break
                else:
                    self.pos = pos
                    return
                self.pos = min(pos, end)
                raise GGUFError(f"truncated: {what} (an array of {n} strings) runs past the end of the file")
            else:
                for i in range(n):
                    self.value(itype, f"{what}[{i}]", depth + 1)
        elif vtype in _NUMPY:
            self.need(np.dtype(_NUMPY[vtype]).itemsize, what)
            self.pos += np.dtype(_NUMPY[vtype]).itemsize
        else:
            raise GGUFError(f"{what}: unknown value type {vtype} (known: 0-12)")

    def file(self, path: Path) -> GGUFFile:
        (magic,) = self.unpack("<4s", "magic")
        if magic != b"GGUF":
            raise GGUFError(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        (version,) = self.unpack("<I", "version")
        if version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if version >= 1 << 16 else ""
            raise GGUFError(f"GGUF version {version}{hint}: Orchard reads versions "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
        n_tensors = self.count("tensor count", MAX_TENSOR_COUNT, _TENSOR_MIN)
        n_kv = self.count("metadata key count", MAX_KV_COUNT, _KV_MIN)
        places: dict[str, tuple[int, int]] = {}
        for i in range(n_kv):
            raw = self.string(f"metadata key #{i}", MAX_KEY_LENGTH)
            key = _name(raw, f"metadata key #{i}")
            label = key if len(key) <= 80 else shown(key)
            if key in places:
                raise GGUFError(f"metadata key {shown(key)} appears twice (a key may appear once)")
            (vtype,) = self.unpack("<I", f"{label} value type")
            places[key] = (vtype, self.pos)
            self.value(vtype, label)
        metadata = Metadata(self.buf, places)
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in places:
            alignment = metadata["general.alignment"]
            if places["general.alignment"][0] != UINT32 or alignment <= 0 or alignment & (alignment - 1):
                raise GGUFError(f"general.alignment {shown(alignment)} ({metadata.type_of('general.alignment')}): "
                                "must be a uint32 power of two")
        types = ggml_types()
        infos = []
        names = set()
        for i in range(n_tensors):
            name = _name(self.string(f"tensor #{i} name", MAX_TENSOR_NAME), f"tensor #{i} name")
            if name in names:
                raise GGUFError(f"tensor {name!r} appears twice")
            names.add(name)
            (n_dims,) = self.unpack("<I", f"tensor {name} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor {name}: n_dims {n_dims} is not between 1 and {MAX_DIMS}")
            dims = self.unpack(f"<{n_dims}Q", f"tensor {name} dimensions")
            ggml_type, offset = self.unpack("<IQ", f"tensor {name} type and offset")
            infos.append((name, dims, ggml_type, offset))
        data_start = self.pos + (-self.pos % alignment)
        if data_start > self.size:
            raise GGUFError(f"truncated: the data section would start at {data_start}, past the end of the file "
                            f"({self.size} bytes)")
        tensors, end = [], 0
        for name, dims, ggml_type, offset in infos:
            t = _tensor(self.buf, name, dims, ggml_type, offset, types, alignment, data_start, self.size)
            if offset < end:
                raise GGUFError(f"tensor {name}: offset {offset} overlaps the tensor before it, which ends at {end} "
                                "(each tensor's data must follow the previous one's)")
            end = offset + t.nbytes
            tensors.append(t)
        return GGUFFile(path, version, metadata, tensors, alignment, data_start, self.size)


def _tensor(buf, name, dims, ggml_type, offset, types, alignment, data_start, size) -> TensorInfo:
    if ggml_type not in types:
        raise GGUFError(f"tensor {name}: ggml type {ggml_type} is not one the gguf package knows")
    type_name, block, block_bytes = types[ggml_type]
    if min(dims) < 1:
        raise GGUFError(f"tensor {name}: dimensions {list(dims)} must all be positive")
    n = 1
    for d in dims:
        n *= d
    if n > MAX_TENSOR_ELEMENTS:
        raise GGUFError(f"tensor {name}: {n} elements ({' x '.join(map(str, dims))}) is over the limit of "
                        f"{MAX_TENSOR_ELEMENTS}")
    if dims[0] % block:
        raise GGUFError(f"tensor {name}: {dims[0]} columns are not a whole number of {type_name} blocks "
                        f"({block} weights)")
    nbytes = n // block * block_bytes
    room = size - data_start
    if offset > room or nbytes > room - offset:
        raise GGUFError(f"tensor {name}: offset {offset} + {nbytes} bytes is outside the data section "
                        f"({room} bytes)")
    if offset % alignment:
        raise GGUFError(f"tensor {name}: offset {offset} is not a multiple of the alignment {alignment}")
    return TensorInfo(name, type_name, tuple(reversed(dims)), data_start + offset, nbytes, block, block_bytes, buf)


def _name(raw: bytes, what: str) -> str:
    """A key or tensor name: UTF-8 without control characters (it is shown in messages)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGUFError(f"{what} {shown(raw)} is not UTF-8 ({e.reason} at byte {e.start})") from e
    if any(c < " " or c == "\x7f" for c in text):
        raise GGUFError(f"{what} {shown(text)} holds control characters")
    return text


def _decode(buf, vtype: int, pos: int):
    """(value, position after it) of a value the walk has checked."""
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n
    if vtype == ARRAY:
        itype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _NUMPY:
            a = np.frombuffer(buf, dtype=_NUMPY[itype], count=n, offset=pos)
            return (a.astype(bool) if itype == BOOL else a), pos + a.nbytes
        out = []
        for _ in range(n):
            v, pos = _decode(buf, itype, pos)
            out.append(v)
        return out, pos
    a = np.frombuffer(buf, dtype=_NUMPY[vtype], count=1, offset=pos)
    return (bool(a[0]) if vtype == BOOL else a[0].item()), pos + a.itemsize
