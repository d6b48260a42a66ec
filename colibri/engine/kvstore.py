"""Crash-safe persistence of each KV slot: an append-only file of checksummed records per slot.

A slot file is a sequence of records ``<u32 length><u32 crc32><payload>``. The first payload is
a header (magic, the model fingerprint, the cache arrays' names, dtypes and per-position shapes);
each later payload holds a run of consecutive positions: ``<u32 start><u32 n>``, n token ids
(int32) and, per array in header order, its n positions. Appends extend a slot whose tokens still
begin with what the file holds; anything else (a changed prefix, a first save, a torn tail found
on load) rewrites the file through a temporary file and a rename. A kill at any moment leaves the
old file, the new file, or the old file plus a torn tail that `load` ignores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.files import append_durable, write_atomic

log = logging.getLogger("colibri")

MAGIC = b"CKV1"
_FRAME = struct.Struct("<II")  # record length, crc32 of the payload
_SPAN = struct.Struct("<II")  # first position, number of positions
MAX_RECORD = 1 << 34  # a length beyond this is a torn or foreign file, not a record

Arrays = dict[str, np.ndarray]  # name -> [n, ...] positions first
Export = Callable[[int], Arrays]  # length -> the slot's first `length` positions


@dataclass(frozen=True)
class SlotKV:
    """What a slot file holds: the cached token ids and their KV, position by position."""

    tokens: list[int]
    arrays: Arrays  # name -> [len(tokens), ...]


def fingerprint(model_dir: str | Path) -> str:
    """A short id of a checkpoint: its config and the size, head and tail of each weight file."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name} {size}".encode())
        with path.open("rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 16)))
            h.update(f.read())
    return h.hexdigest()[:32]


class KVStore:
    """Slot files under `folder` for the model with fingerprint `key`."""

    def __init__(self, folder: str | Path, key: str):
        self.folder = Path(folder)
        self.key = key
        self._saved: dict[int, list[int]] = {}  # slot -> tokens durable in its file

    def path(self, slot: int) -> Path:
        return self.folder / f"slot{slot}.kv"

    def load(self, slot: int) -> SlotKV | None:
        """The slot's longest intact prefix of records, or None if it has no usable file."""
        try:
            data = self.path(slot).read_bytes()
        except FileNotFoundError:
            return None
        got = _parse(data, self.key)
        if got is None:
            log.warning("%s: not a KV file of this model, ignored", self.path(slot))
            return None
        kv, intact = got
        if not intact:
            log.warning(
                "%s: torn tail ignored (%d positions kept)", self.path(slot), len(kv.tokens)
            )
            self._rewrite(slot, kv.tokens, kv.arrays)
        self._saved[slot] = list(kv.tokens)
        return kv

    def sync(self, slot: int, tokens: Sequence[int], export: Export) -> None:
        """Make the slot file hold exactly `tokens` and their KV (`export(n)` gives n positions)."""
        tokens = list(tokens)
        saved = self._saved.get(slot)
        if saved == tokens:
            return
        self._saved.pop(slot, None)  # unknown until this write completes
        arrays = export(len(tokens))
        if saved is not None and tokens[: len(saved)] == saved and self.path(slot).exists():
            n = len(saved)
            _append(self.path(slot), n, tokens[n:], {k: v[n:] for k, v in arrays.items()})
        else:
            self._rewrite(slot, tokens, arrays)
        self._saved[slot] = tokens

    def _rewrite(self, slot: int, tokens: list[int], arrays: Arrays) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        body = _record(_header(self.key, arrays))
        if tokens:
            body += _record(_positions(0, tokens, arrays))
        write_atomic(self.path(slot), body)


# ---------------------------------------------------------------------------- records


def _record(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _header(key: str, arrays: Arrays) -> bytes:
    spec = [[name, a.dtype.str, list(a.shape[1:])] for name, a in sorted(arrays.items())]
    return MAGIC + json.dumps({"key": key, "arrays": spec}).encode()


def _positions(start: int, tokens: list[int], arrays: Arrays) -> bytes:
    parts = [_SPAN.pack(start, len(tokens)), np.asarray(tokens, "<i4").tobytes()]
    parts += [np.ascontiguousarray(arrays[name]).tobytes() for name in sorted(arrays)]
    return b"".join(parts)


def _append(path: Path, start: int, tokens: list[int], arrays: Arrays) -> None:
    if tokens:
        append_durable(path, _record(_positions(start, tokens, arrays)))


def _records(data: bytes) -> tuple[list[bytes], bool]:
    """Every intact record payload in order, and whether the data ended cleanly after them."""
    out, at = [], 0
    while at < len(data):
        if at + _FRAME.size > len(data):
            return out, False
        n, crc = _FRAME.unpack_from(data, at)
        end = at + _FRAME.size + n
        if n > MAX_RECORD or end > len(data):
            return out, False
        payload = data[at + _FRAME.size : end]
        if zlib.crc32(payload) != crc:
            return out, False
        out.append(payload)
        at = end
    return out, True


def _parse(data: bytes, key: str) -> tuple[SlotKV, bool] | None:
    """(the intact prefix, whether the whole file was intact), or None for a foreign file."""
    records, clean = _records(data)
    if not records or not records[0].startswith(MAGIC):
        return None
    try:
        head = json.loads(records[0][len(MAGIC) :])
        spec = [(name, np.dtype(dt), tuple(shape)) for name, dt, shape in head["arrays"]]
    except (ValueError, KeyError, TypeError):
        return None
    if head.get("key") != key:
        return None
    tokens: list[int] = []
    chunks: dict[str, list[np.ndarray]] = {name: [] for name, _, _ in spec}
    for payload in records[1:]:
        span = _read_positions(payload, spec, len(tokens))
        if span is None:  # checksummed yet inconsistent: keep what came before it
            return _slot_kv(tokens, chunks, spec), False
        tokens += span[0]
        for name, a in span[1].items():
            chunks[name].append(a)
    return _slot_kv(tokens, chunks, spec), clean


def _read_positions(
    payload: bytes, spec: list[tuple[str, np.dtype, tuple]], expect_start: int
) -> tuple[list[int], Arrays] | None:
    """The tokens and arrays of one positions record, or None if it does not fit the file."""
    if len(payload) < _SPAN.size:
        return None
    start, n = _SPAN.unpack_from(payload)
    sizes = [n * dt.itemsize * int(np.prod(shape)) for _, dt, shape in spec]
    if start != expect_start or len(payload) != _SPAN.size + 4 * n + sum(sizes):
        return None
    at = _SPAN.size + 4 * n
    tokens = np.frombuffer(payload, "<i4", n, _SPAN.size).tolist()
    arrays = {}
    for (name, dt, shape), size in zip(spec, sizes, strict=True):
        arrays[name] = np.frombuffer(payload, dt, size // dt.itemsize, at).reshape(n, *shape)
        at += size
    return tokens, arrays


def _slot_kv(
    tokens: list[int], chunks: dict[str, list[np.ndarray]], spec: list[tuple[str, np.dtype, tuple]]
) -> SlotKV:
    arrays = {
        name: np.concatenate(chunks[name]) if chunks[name] else np.zeros((0, *shape), dt)
        for name, dt, shape in spec
    }
    return SlotKV(tokens, arrays)
