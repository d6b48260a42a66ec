"""Safetensors checkpoints as a tensor index: name -> (file, dtype, shape, bytes), read by pread."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype -> (numpy dtype used to hold the raw bytes, bytes per element)
_RAW_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # bf16 bits, widened to f32 by `to_f32`
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_MAX_HEADER = 100 * 1024 * 1024
# How colibri holds the bfloat16 weights it keeps as bfloat16 (see weights.holds_bf16): their
# bit patterns, the top halves of the float32s they stand for.
BF16_BITS = np.dtype("<u2")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked: the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: absolute byte offset and size inside `path`."""

    name: str
    path: Path
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def raw_dtype(dtype: str) -> np.dtype:
    """The numpy dtype holding a safetensors dtype's raw bytes (bf16 as uint16)."""
    return _RAW_DTYPES[dtype]


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Widen raw tensor bytes (as read) to a new float32 array; bf16 is the top half of an f32,
    shifted in one pass into a fresh array."""
    if dtype == "BF16":
        out = np.empty(raw.shape, np.uint32)
        np.left_shift(raw, 16, out=out, dtype=np.uint32)
        return out.view(np.float32)
    return raw.astype(np.float32)


def to_held(raw: np.ndarray, dtype: str, held: np.dtype) -> np.ndarray:
    """Raw tensor bytes as colibri holds them, in a fresh array (no view into the read buffer
    survives): widened to float32, or for bfloat16 tensors held as BF16_BITS, their bits."""
    if np.dtype(held) == BF16_BITS:
        if dtype != "BF16":
            raise CheckpointError(f"a {dtype} tensor cannot be held as bfloat16 bits")
        return raw.astype(BF16_BITS, copy=True)
    return to_f32(raw, dtype)


class Checkpoint:
    """Index of every tensor in a folder's safetensors files (single file or sharded)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.files = _safetensors_files(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for info in _read_header(path):
                self.tensors[info.name] = info
        self._fds: dict[Path, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            files = ", ".join(p.name for p in self.files)
            raise CheckpointError(
                f"{self.dir}: tensor {name!r} is missing (looked in {files})"
            ) from None

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, as a numpy array of its raw dtype (bf16 as uint16)."""
        t = self.info(name)
        buf = self.pread(t.path, t.offset, t.nbytes)
        return np.frombuffer(buf, dtype=_RAW_DTYPES[t.dtype]).reshape(t.shape)

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as float32, checked against `shape` when given."""
        t = self.info(name)
        if shape is not None and tuple(shape) != t.shape:
            raise CheckpointError(
                f"{t.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
            )
        return to_f32(self.read_raw(name), t.dtype)

    def read_part(
        self, t: TensorInfo, offset: int, nbytes: int, held: np.dtype = np.float32
    ) -> np.ndarray:
        """`nbytes` of tensor `t` starting `offset` bytes into it, flat, held as `held`
        (`to_held`: float32, or bfloat16 bits)."""
        raw = np.frombuffer(self.pread(t.path, t.offset + offset, nbytes), _RAW_DTYPES[t.dtype])
        return to_held(raw, t.dtype, held)

    def pread(self, path: Path, offset: int, nbytes: int) -> bytes:
        """Exactly `nbytes` at `offset` of `path`, with os.pread (thread-safe, no seek)."""
        fd = self._fd(path)
        chunks, done = [], 0
        while done < nbytes:
            chunk = os.pread(fd, nbytes - done, offset + done)
            if not chunk:
                raise CheckpointError(f"{path}: file ends at byte {offset + done}, expected more")
            chunks.append(chunk)
            done += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
            self._fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard {missing[0].name} is missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no .safetensors files")
    return files


def _read_header(path: Path) -> list[TensorInfo]:
    """Parse a safetensors header: u64 little-endian length, then JSON of name -> dtype, shape."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {len(head)} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta.get("dtype")
        if dtype not in _RAW_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        start, end = meta["data_offsets"]
        shape = tuple(int(s) for s in meta["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * _RAW_DTYPES[dtype].itemsize
        if end - start != expected or base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} byte range {start}..{end} does not fit its shape "
                f"{list(shape)} or the file ({size} bytes)"
            )
        out.append(TensorInfo(name, path, dtype, shape, base + start, end - start))
    return out


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """Write float tensors to a safetensors file as F32, F16 or BF16 (round to nearest even)."""
    header: dict[str, dict] = {}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        raw = _encode(np.ascontiguousarray(arr, dtype=np.float32), dtype)
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        blobs.append(raw)
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw.tobytes())
    os.replace(tmp, path)


def _encode(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return arr
    if dtype == "F16":
        return arr.astype(np.float16)
    if dtype == "BF16":
        bits = arr.view(np.uint32)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return (rounded >> 16).astype(np.uint16)
    raise ValueError(f"dtype={dtype!r}: write supports F32, F16, BF16")
