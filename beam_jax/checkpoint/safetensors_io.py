"""A minimal reader and writer of the safetensors format, with no dependency on `safetensors`.

Format: an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [start, end]}, "__metadata__": {...}}`),
then the tensor bytes, offsets relative to the end of the header.

Reading maps each file once (`np.memmap`) and hands out views, so a tensor is paged in only when
it is read and no file is ever loaded whole: a 1 TB checkpoint is read on a host with far less
memory. Writing streams tensor by tensor for the same reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from beam_jax.checkpoint.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The Rust implementation refuses larger headers; a bigger one means a corrupt file, not a big model.
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "C64": np.dtype(np.complex64),
}
CODES: dict[np.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}


def dtype_code(dtype) -> str:
    """The safetensors code of a numpy (or ml_dtypes) dtype: `bfloat16` -> `"BF16"`."""
    dtype = np.dtype(dtype).newbyteorder("=")
    if dtype not in CODES:
        raise ValueError(f"dtype {dtype} has no safetensors encoding")
    return CODES[dtype]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its header entry plus the file it is in."""

    name: str
    code: str  # safetensors dtype code, kept even when unknown so a loader can report it
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offsets in `file`
    end: int

    @property
    def dtype(self) -> np.dtype:
        if self.code not in DTYPES:
            raise CheckpointError(f"{self.file}: tensor {self.name} has unsupported dtype {self.code}")
        return DTYPES[self.code]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor entries and `__metadata__` of one file, reading only its header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file (header length {header_len}, file size {size})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + header_len, size - 8 - header_len
    tensors, problems = {}, []
    for name, entry in header.items():
        try:
            code, shape, (start, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: malformed header entry {entry!r}")
            continue
        if not 0 <= start <= end <= data_len:
            problems.append(f"{name}: data_offsets [{start}, {end}] outside the {data_len} data bytes")
        elif code in DTYPES and end - start != math.prod(shape) * DTYPES[code].itemsize:
            problems.append(f"{name}: {code}{list(shape)} needs {math.prod(shape) * DTYPES[code].itemsize} bytes, "
                            f"data_offsets give {end - start}")
        tensors[name] = TensorInfo(name, code, shape, path, data_start + start, data_start + end)
    if problems:
        raise CheckpointError(f"{path}: corrupt safetensors header", problems)
    return tensors, metadata


class SafetensorsFile:
    """One `.safetensors` file: its header, and tensors as read-only views of a memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._map: np.memmap | None = None  # mapped on first read: validation needs headers only

    def get(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.nbytes == 0:  # an empty file cannot be mapped, and an empty tensor needs no bytes
            return np.empty(info.shape, info.dtype)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        # Little-endian on disk; every platform JAX runs on is little-endian too.
        return self._map[info.start : info.end].view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        # Dropping the reference unmaps once the last view handed out is gone.
        self._map = None


class SafetensorsCheckpoint:
    """The tensors of a checkpoint: one `model.safetensors`, or shards listed by
    `model.safetensors.index.json` (`weight_map`: tensor name -> shard file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files: dict[Path, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        index = self._find(self.path)
        if index.name.endswith(".json"):
            self._open_index(index)
        else:
            problems: list[str] = []
            self._add(SafetensorsFile(index), problems)  # one file cannot hold a name twice: JSON keys

    @staticmethod
    def _find(path: Path) -> Path:
        if path.is_file():
            return path
        if (path / INDEX_FILE).is_file():
            return path / INDEX_FILE
        if (path / SINGLE_FILE).is_file():
            return path / SINGLE_FILE
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")

    def _open_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map: {e})") from None
        problems = []
        for shard in sorted(set(weight_map.values())):
            if not (index.parent / shard).is_file():
                problems.append(f"{shard}: listed in {INDEX_FILE} but missing")
                continue
            self._add(SafetensorsFile(index.parent / shard), problems)
        for name, shard in weight_map.items():
            info = self.tensors.get(name)
            if (index.parent / shard).is_file() and (info is None or info.file != index.parent / shard):
                problems.append(f"{name}: {INDEX_FILE} places it in {shard}, which does not hold it")
        if problems:
            raise CheckpointError(f"{index}: inconsistent sharded checkpoint", problems)

    def _add(self, file: SafetensorsFile, problems: list[str]) -> None:
        self.files[file.path] = file
        for name, info in file.tensors.items():
            if name in self.tensors:
                problems.append(f"{name}: in both {self.tensors[name].file.name} and {file.path.name}")
            self.tensors[name] = info

    def get(self, name: str) -> np.ndarray:
        """A read-only view of one tensor; only its pages are read from disk."""
        return self.files[self.tensors[name].file].get(name)

    def close(self) -> None:
        for file in self.files.values():
            file.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- writing ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What the header needs to know about a tensor before its bytes are produced."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def encode_header(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """Length prefix + JSON header, padded with spaces to 8 bytes so tensor data stays aligned
    (the Rust writer does the same)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": dtype_code(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(
    path: str | Path,
    specs: Iterable[TensorSpec],
    fetch: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write one file: the header from `specs`, then `fetch(name)` for each spec in order, so
    only one tensor's bytes are in memory at a time. Returns the bytes of tensor data written.
    The file appears under its name only when complete (written beside it, then renamed)."""
    path, specs = Path(path), list(specs)
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("duplicate tensor names")
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(encode_header(specs, metadata))
            for spec in specs:
                array = np.asarray(fetch(spec.name))
                if array.shape != tuple(spec.shape) or array.dtype != np.dtype(spec.dtype):
                    raise ValueError(
                        f"{spec.name}: header says {np.dtype(spec.dtype)}{list(spec.shape)}, "
                        f"got {array.dtype}{list(array.shape)}"
                    )
                if array.dtype.byteorder == ">":
                    array = array.astype(array.dtype.newbyteorder("<"))
                f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
                written += spec.nbytes
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return written


def save_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None):
    """Write a dict of host arrays as one file (`{"format": "pt"}` metadata, which transformers
    expects, unless `metadata` is given)."""
    specs = [TensorSpec(name, np.asarray(a).dtype, np.shape(a)) for name, a in tensors.items()]
    return write_safetensors(path, specs, tensors.__getitem__, {"format": "pt"} if metadata is None else metadata)


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a file or checkpoint directory as memory-mapped views (nothing is read
    until used). Convenience for tests and tools."""
    checkpoint = SafetensorsCheckpoint(path)
    return {name: checkpoint.get(name) for name in checkpoint.tensors}
