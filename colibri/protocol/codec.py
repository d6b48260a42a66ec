"""Wire codec for the mux serve protocol: one typed value per line kind, its bytes, its readers.

Pure: no threads, no engine, no I/O beyond the binary streams handed in (``readline(n)`` and
``read(n)``). The engine formats with it, the client parses with it; the contract is
``docs/protocol.md``.

Fields are separated by exactly one space, as the engine's ``printf`` writes them, so an empty
field (the hex of an empty token, a 0x0 map) survives a round trip. Number formats:

========================  =========================================================
integers                  decimal (``str(int)``)
``STAT``/``DONE``         tok_s ``%.2f``, hit_pct ``%.1f``, rss_gb ``%.2f``; length_limited 0/1
GB values                 ``%.2f`` (HWINFO, TIERS, GPUS)
``PERF`` seconds          ``%.6f``
``PROF`` seconds          ``%.3f`` (as colibrì's engine writes them)
``ENTROPY`` bits          ``%.4f``
``TOPK`` logprob          ``%.4f``; token bytes as lowercase hex
``GATES`` numbers         weight, entropy (bits) and margin ``%.7f``
``SUBMIT`` sampling       temperature, top_p as ``repr(float)`` (shortest exact round trip)
========================  =========================================================

``HITS`` bit order: the ``rows*cols`` experts are numbered row-major, ``i = row*cols + col``;
bit ``i`` lives in byte ``i // 8`` under mask ``1 << (i % 8)`` (least significant bit first, as
colibrì's engine writes it and its web UI reads it).
The bitmap is ``ceil(rows*cols / 8)`` bytes, written as lowercase hex; padding bits are 0.
``EMAP`` holds one byte per expert in the same row-major order: ``(tier << 6) | heat``.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator
from dataclasses import astuple, dataclass, replace
from typing import ClassVar, Protocol

READY_LINE = b"\x01\x01READY\x01\x01"
MAX_HEADER = 4096  # request header cap: longer lines are drained, never buffered
MAX_PAYLOAD = 64 << 20  # SUBMIT payload cap: larger payloads are drained and refused
MAX_GRAMMAR = 1 << 20  # SUBMIT grammar cap (colibrì's own): larger ones are drained and refused
MAX_EVENT_LINE = 1 << 20  # engine line cap: an EMAP of 512k experts still fits
MAX_DATA = 1 << 20  # DATA payload cap (one token's bytes)
U64_MAX = (1 << 64) - 1
_CHUNK = 1 << 16

_UINT = re.compile(rb"[0-9]{1,20}")
_INT = re.compile(rb"-?[0-9]{1,20}")
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})*")


class ByteStream(Protocol):
    """The part of a binary file object the readers use."""

    def readline(self, size: int = -1, /) -> bytes: ...

    def read(self, size: int = -1, /) -> bytes: ...


class ProtocolError(Exception):
    """An engine stream broke the contract: a malformed known line or a bad DATA frame."""


# ---------------------------------------------------------------------------- field helpers


def _uint(field: bytes) -> int:
    if not _UINT.fullmatch(field):
        raise ValueError(f"expected an unsigned integer, got {field!r}")
    return int(field)


def _u64(field: bytes) -> int:
    value = _uint(field)
    if value > U64_MAX:
        raise ValueError(f"id {value} does not fit in u64")
    return value


def _int(field: bytes) -> int:
    if not _INT.fullmatch(field):
        raise ValueError(f"expected an integer, got {field!r}")
    return int(field)


def _float(field: bytes) -> float:
    if b"_" in field:  # Python's float() reads "0_1" as 1.0; the wire has no digit separators
        raise ValueError(f"expected a number, got {field!r}")
    return float(field.decode("ascii"))  # UnicodeDecodeError is a ValueError


def _flag(field: bytes) -> bool:
    if field not in (b"0", b"1"):
        raise ValueError(f"expected 0 or 1, got {field!r}")
    return field == b"1"


def _hex(field: bytes) -> bytes:
    if not _HEX.fullmatch(field):
        raise ValueError(f"expected even-length hex, got {field[:40]!r}")
    return bytes.fromhex(field.decode("ascii"))


def _text(field: bytes) -> str:
    return field.decode("utf-8", errors="replace")


def _arity(words: list[bytes], n: int) -> list[bytes]:
    if len(words) != n:
        raise ValueError(f"expected {n} fields, got {len(words)}")
    return words


def _words(rest: bytes, maxsplit: int = -1) -> list[bytes]:
    return rest.split(b" ", maxsplit) if rest else []


def _line(kind: bytes, fields: Iterable[str]) -> bytes:
    body = b" ".join([kind, *(f.encode() for f in fields)])
    if b"\n" in body:
        raise ValueError(f"{kind.decode()} line would contain a newline: {body[:80]!r}")
    return body + b"\n"


def _cell(rows: int, cols: int, row: int, col: int) -> int:
    """Row-major index of expert (row, col) in a rows x cols map."""
    if not (0 <= row < rows and 0 <= col < cols):
        raise IndexError(f"cell ({row}, {col}) outside a {rows}x{cols} map")
    return row * cols + col


def _f(x: float, places: int) -> str:
    return f"{x:.{places}f}"


# ---------------------------------------------------------------------------- engine -> server


@dataclass(frozen=True)
class Ready:
    """Handshake sentinel; the server sends nothing before it."""


@dataclass(frozen=True)
class Stat:
    """Handshake statistics: ``STAT <emitted> <tok_s> <hit_pct> <rss_gb>``."""

    emitted: int
    tok_s: float
    hit_pct: float
    rss_gb: float
    KIND: ClassVar[bytes] = b"STAT"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        return [str(self.emitted), _f(self.tok_s, 2), _f(self.hit_pct, 1), _f(self.rss_gb, 2)]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Stat:
        _arity(w, 4)
        return cls(_int(w[0]), _float(w[1]), _float(w[2]), _float(w[3]))


@dataclass(frozen=True)
class HwInfo:
    """Host snapshot: ``HWINFO <cores> <ram_total> <ram_avail> <ngpu> <vram_total> <cpu>|<gpu>``.

    The names are free text (spaces allowed); the first ``|`` separates them, so ``cpu_name``
    may not contain one.
    """

    cores: int
    ram_total_gb: float
    ram_avail_gb: float
    ngpu: int
    vram_total_gb: float
    cpu_name: str
    gpu_name: str
    KIND: ClassVar[bytes] = b"HWINFO"
    MAXSPLIT: ClassVar[int] = 5

    def __post_init__(self) -> None:
        if "|" in self.cpu_name:
            raise ValueError(f"cpu_name may not contain '|': {self.cpu_name!r}")

    def to_fields(self) -> list[str]:
        gb = [_f(self.ram_total_gb, 2), _f(self.ram_avail_gb, 2)]
        names = f"{self.cpu_name}|{self.gpu_name}"
        return [str(self.cores), *gb, str(self.ngpu), _f(self.vram_total_gb, 2), names]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> HwInfo:
        _arity(w, 6)
        cpu, bar, gpu = _text(w[5]).partition("|")
        if not bar:
            raise ValueError("HWINFO names lack the '|' separator")
        numbers = (_int(w[0]), _float(w[1]), _float(w[2]), _int(w[3]), _float(w[4]))
        return cls(*numbers, cpu_name=cpu, gpu_name=gpu)


@dataclass(frozen=True)
class Tiers:
    """Expert count per tier and resident GB: ``TIERS <vram> <ram> <disk> <vram_gb> <ram_gb>``."""

    vram: int
    ram: int
    disk: int
    vram_gb: float
    ram_gb: float
    KIND: ClassVar[bytes] = b"TIERS"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        counts = [str(self.vram), str(self.ram), str(self.disk)]
        return [*counts, _f(self.vram_gb, 2), _f(self.ram_gb, 2)]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Tiers:
        _arity(w, 5)
        return cls(_int(w[0]), _int(w[1]), _int(w[2]), _float(w[3]), _float(w[4]))


@dataclass(frozen=True)
class Emap:
    """Expert map ``EMAP <rows> <cols> <hex>``: one byte ``(tier << 6) | heat`` per expert."""

    rows: int
    cols: int
    data: bytes  # [rows * cols], row-major
    KIND: ClassVar[bytes] = b"EMAP"
    MAXSPLIT: ClassVar[int] = -1

    def __post_init__(self) -> None:
        if self.rows < 0 or self.cols < 0 or len(self.data) != self.rows * self.cols:
            raise ValueError(
                f"EMAP {self.rows}x{self.cols} needs that many bytes, got {len(self.data)}"
            )

    def tier(self, row: int, col: int) -> int:
        """0 disk, 1 RAM, 2 device."""
        return self.data[_cell(self.rows, self.cols, row, col)] >> 6

    def heat(self, row: int, col: int) -> int:
        """Bit length of the expert's cumulative selection count, capped at 63."""
        return self.data[_cell(self.rows, self.cols, row, col)] & 0x3F

    def to_fields(self) -> list[str]:
        return [str(self.rows), str(self.cols), self.data.hex()]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Emap:
        _arity(w, 3)
        return cls(_uint(w[0]), _uint(w[1]), _hex(w[2]))


@dataclass(frozen=True)
class Hits:
    """Experts routed since the last HITS: ``HITS <rows> <cols> <hex>`` (bit order: module doc)."""

    rows: int
    cols: int
    bits: bytes  # [ceil(rows * cols / 8)]
    KIND: ClassVar[bytes] = b"HITS"
    MAXSPLIT: ClassVar[int] = -1

    def __post_init__(self) -> None:
        want = (self.rows * self.cols + 7) // 8
        if self.rows < 0 or self.cols < 0 or len(self.bits) != want:
            raise ValueError(
                f"HITS {self.rows}x{self.cols} needs {want} bytes, got {len(self.bits)}"
            )

    @classmethod
    def from_set(cls, rows: int, cols: int, cells: Iterable[tuple[int, int]]) -> Hits:
        bits = bytearray((rows * cols + 7) // 8)
        for row, col in cells:
            byte, mask = _bit(rows, cols, row, col)
            bits[byte] |= mask
        return cls(rows, cols, bytes(bits))

    def hit(self, row: int, col: int) -> bool:
        byte, mask = _bit(self.rows, self.cols, row, col)
        return bool(self.bits[byte] & mask)

    def with_hit(self, row: int, col: int, value: bool = True) -> Hits:
        """A copy with the bit for (row, col) set to ``value``."""
        byte, mask = _bit(self.rows, self.cols, row, col)
        bits = bytearray(self.bits)
        bits[byte] = bits[byte] | mask if value else bits[byte] & ~mask
        return replace(self, bits=bytes(bits))

    def cells(self) -> frozenset[tuple[int, int]]:
        """Every (row, col) whose bit is set."""
        grid = ((r, c) for r in range(self.rows) for c in range(self.cols))
        return frozenset(cell for cell in grid if self.hit(*cell))

    def to_fields(self) -> list[str]:
        return [str(self.rows), str(self.cols), self.bits.hex()]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Hits:
        _arity(w, 3)
        return cls(_uint(w[0]), _uint(w[1]), _hex(w[2]))


def _bit(rows: int, cols: int, row: int, col: int) -> tuple[int, int]:
    """(byte index, mask) of expert (row, col): row-major, least significant bit first."""
    i = _cell(rows, cols, row, col)
    return i // 8, 1 << (i % 8)


@dataclass(frozen=True)
class Data:
    """One token's bytes: ``DATA <id> <n>\\n<n bytes>\\n`` (may hold part of a UTF-8 char)."""

    id: int
    payload: bytes


@dataclass(frozen=True)
class TopK:
    """Candidates for the sampled token: ``TOPK <id> <n> (<logprob> <hextext>)*n``."""

    id: int
    entries: tuple[tuple[float, bytes], ...]  # (natural-log prob, token bytes), best first
    KIND: ClassVar[bytes] = b"TOPK"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        pairs = [s for lp, tok in self.entries for s in (_f(lp, 4), tok.hex())]
        return [str(self.id), str(len(self.entries)), *pairs]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> TopK:
        n = _uint(w[1])
        pairs = _arity(w[2:], 2 * n)
        entries = tuple((_float(pairs[2 * i]), _hex(pairs[2 * i + 1])) for i in range(n))
        return cls(_uint(w[0]), entries)


@dataclass(frozen=True)
class Gates:
    """Routing of one fed token (SERVE_GATES): ``GATES <id> <pos> <token> <layers> <k>
    (<expert>*k <weight>*k <entropy> <margin>)*layers``.

    `pos` is the token's position in its KV slot and `token` its id; the GATES after a DATA is
    that of the forward that chose the DATA's token, so it describes the token fed before it
    (the prompt's last for the first DATA). Per MoE layer: the k experts by descending gate
    weight, their gate weights, and the entropy (bits) and top-1 minus top-2 margin of the
    router's distribution over all experts.
    """

    id: int
    pos: int
    token: int
    experts: tuple[tuple[int, ...], ...]  # [layers][k]
    weights: tuple[tuple[float, ...], ...]  # [layers][k]
    entropy: tuple[float, ...]  # [layers]
    margin: tuple[float, ...]  # [layers]
    KIND: ClassVar[bytes] = b"GATES"
    MAXSPLIT: ClassVar[int] = -1

    def __post_init__(self) -> None:
        n, k = len(self.experts), self.k
        per_layer = (len(self.weights), len(self.entropy), len(self.margin))
        rows = [*self.experts, *self.weights]
        if per_layer != (n, n, n) or any(len(row) != k for row in rows):
            raise ValueError(f"GATES needs {n} layers of {k} experts and weights each")

    @property
    def k(self) -> int:
        """Experts per layer."""
        return len(self.experts[0]) if self.experts else 0

    def to_fields(self) -> list[str]:
        head = [str(self.id), str(self.pos), str(self.token), str(len(self.experts)), str(self.k)]
        layers = zip(self.experts, self.weights, self.entropy, self.margin, strict=True)
        body = [
            s
            for ids, wts, h, m in layers
            for s in (*map(str, ids), *(_f(w, 7) for w in wts), _f(h, 7), _f(m, 7))
        ]
        return head + body

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Gates:
        layers, k = _uint(w[3]), _uint(w[4])
        f = _arity(w[5:], layers * (2 * k + 2))
        per = [f[i : i + 2 * k + 2] for i in range(0, len(f), 2 * k + 2)]
        return cls(
            _uint(w[0]),
            _uint(w[1]),
            _uint(w[2]),
            tuple(tuple(_uint(x) for x in p[:k]) for p in per),
            tuple(tuple(_float(x) for x in p[k : 2 * k]) for p in per),
            tuple(_float(p[2 * k]) for p in per),
            tuple(_float(p[2 * k + 1]) for p in per),
        )


@dataclass(frozen=True)
class Repin:
    """One hot-store swap: ``REPIN <layer> <eid> <old_tier> <gpu>``."""

    layer: int
    expert: int
    old_tier: int
    gpu: int
    KIND: ClassVar[bytes] = b"REPIN"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        return [str(self.layer), str(self.expert), str(self.old_tier), str(self.gpu)]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Repin:
        return cls(*(_int(f) for f in _arity(w, 4)))


@dataclass(frozen=True)
class Perf:
    """The turn's time split in seconds: ``PERF <id> <dt> <t_edisk> ... <t_head>``."""

    id: int
    dt: float
    t_edisk: float
    t_ewait: float
    t_emm: float
    t_attn: float
    t_kvb: float
    t_head: float
    KIND: ClassVar[bytes] = b"PERF"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        return [str(self.id), *(_f(t, 6) for t in astuple(self)[1:])]  # fields in wire order

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Perf:
        _arity(w, 8)
        return cls(_uint(w[0]), *(_float(f) for f in w[1:]))


@dataclass(frozen=True)
class Prof:
    """A turn's phase timings, the line colibrì's gateway keeps for its profiling page:
    ``PROF <wall_s> <prompt_tokens> <completion_tokens> <edisk_s> <ewait_s> <emm_s> <attn_s>
    <head_s> <forwards>``. It carries no id: it comes right before the DONE it belongs to.
    """

    wall_s: float
    prompt_tokens: int
    completion_tokens: int
    edisk_s: float
    ewait_s: float
    emm_s: float
    attn_s: float
    head_s: float
    forwards: int  # model forward passes over the turn's window (every slot's)
    KIND: ClassVar[bytes] = b"PROF"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        times = (self.edisk_s, self.ewait_s, self.emm_s, self.attn_s, self.head_s)
        counts = [str(self.prompt_tokens), str(self.completion_tokens)]
        return [_f(self.wall_s, 3), *counts, *(_f(t, 3) for t in times), str(self.forwards)]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Prof:
        _arity(w, 9)
        times = (_float(f) for f in w[3:8])
        return cls(_float(w[0]), _int(w[1]), _int(w[2]), *times, forwards=_int(w[8]))


@dataclass(frozen=True)
class Entropy:
    """Routing entropy per sparse layer, bits: ``ENTROPY <h0> <h1> ...``."""

    values: tuple[float, ...]
    KIND: ClassVar[bytes] = b"ENTROPY"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        return [_f(h, 4) for h in self.values]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Entropy:
        return cls(tuple(_float(f) for f in w))


@dataclass(frozen=True)
class Gpus:
    """Per-device memory and resident experts: ``GPUS <n> (<used_gb> <total_gb> <experts>)*n``."""

    devices: tuple[tuple[float, float, int], ...]
    KIND: ClassVar[bytes] = b"GPUS"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        per = [s for u, t, e in self.devices for s in (_f(u, 2), _f(t, 2), str(e))]
        return [str(len(self.devices)), *per]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Gpus:
        n = _uint(w[0])
        f = _arity(w[1:], 3 * n)
        return cls(
            tuple((_float(f[i]), _float(f[i + 1]), _int(f[i + 2])) for i in range(0, 3 * n, 3))
        )


@dataclass(frozen=True)
class Done:
    """End of a request: ``DONE <id> STAT <emitted> <tok_s> <hit_pct> <rss_gb> <prompt> <lim>``."""

    id: int
    emitted: int
    tok_s: float
    hit_pct: float
    rss_gb: float
    prompt_tokens: int
    length_limited: bool
    KIND: ClassVar[bytes] = b"DONE"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        rates = [_f(self.tok_s, 2), _f(self.hit_pct, 1), _f(self.rss_gb, 2)]
        tail = [str(self.prompt_tokens), str(int(self.length_limited))]
        return [str(self.id), "STAT", str(self.emitted), *rates, *tail]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Done:
        _arity(w, 8)
        if w[1] != b"STAT":
            raise ValueError(f"expected STAT after the DONE id, got {w[1]!r}")
        rates = (_float(w[3]), _float(w[4]), _float(w[5]))
        return cls(_uint(w[0]), _int(w[2]), *rates, _int(w[6]), _flag(w[7]))


@dataclass(frozen=True)
class Error:
    """A request's failure: ``ERROR <id> <CODE> [detail ...]`` (e.g. CONTEXT_EXCEEDED <n> <max>)."""

    id: int
    code: str
    detail: tuple[str, ...] = ()
    KIND: ClassVar[bytes] = b"ERROR"
    MAXSPLIT: ClassVar[int] = -1

    def __post_init__(self) -> None:
        for word in (self.code, *self.detail):
            if " " in word:
                raise ValueError(f"ERROR code and detail are single words, got {word!r}")

    def to_fields(self) -> list[str]:
        return [str(self.id), self.code, *self.detail]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Error:
        if len(w) < 2:
            raise ValueError(f"expected at least 2 fields, got {len(w)}")
        return cls(_uint(w[0]), _text(w[1]), tuple(_text(f) for f in w[2:]))


@dataclass(frozen=True)
class Accept:
    """Extension: a SUBMIT passed validation: ``ACCEPT <id> <prompt_tokens> <reused_tokens>``.

    ``reused_tokens`` were taken from the slot's KV prefix; a line without it parses as 0.
    """

    id: int
    prompt_tokens: int
    reused_tokens: int = 0
    KIND: ClassVar[bytes] = b"ACCEPT"
    MAXSPLIT: ClassVar[int] = -1

    def to_fields(self) -> list[str]:
        return [str(self.id), str(self.prompt_tokens), str(self.reused_tokens)]

    @classmethod
    def from_fields(cls, w: list[bytes]) -> Accept:
        if len(w) not in (2, 3):
            raise ValueError(f"expected 2 or 3 fields, got {len(w)}")
        return cls(*(_uint(f) for f in w))


@dataclass(frozen=True)
class Unknown:
    """A line kind this codec does not know; kept whole, never an error (forward compatibility)."""

    kind: str
    raw: bytes  # the line without its newline


Event = (
    Ready
    | Stat
    | HwInfo
    | Tiers
    | Emap
    | Hits
    | Data
    | TopK
    | Gates
    | Repin
    | Perf
    | Prof
    | Entropy
    | Gpus
    | Done
    | Error
    | Accept
    | Unknown
)
_LINE_KINDS = (
    Stat,
    HwInfo,
    Tiers,
    Emap,
    Hits,
    TopK,
    Gates,
    Repin,
    Perf,
    Prof,
    Entropy,
    Gpus,
    Done,
    Error,
    Accept,
)
_BY_KIND = {cls.KIND: cls for cls in _LINE_KINDS}


def format_data(rid: int, payload: bytes) -> bytes:
    """``DATA <id> <n>\\n<payload>\\n``: what format_event gives for Data(rid, payload)."""
    return b"DATA %d %d\n%b\n" % (rid, len(payload), payload)


def format_event(ev: Event) -> bytes:
    """The exact bytes of one engine line, newline included (DATA: header, payload, newline)."""
    if isinstance(ev, Ready):
        return READY_LINE + b"\n"
    if isinstance(ev, Data):
        return format_data(ev.id, ev.payload)
    if isinstance(ev, Unknown):
        return ev.raw + b"\n"
    return _line(ev.KIND, ev.to_fields())


def read_event(
    stream: ByteStream, *, max_line: int = MAX_EVENT_LINE, max_data: int = MAX_DATA
) -> Event | None:
    """The next engine line, or None at EOF (a line or frame cut short by EOF is dropped).

    Unknown kinds come back as ``Unknown`` (an over-long one truncated to ``max_line`` bytes);
    a malformed known line or DATA frame raises ``ProtocolError``.
    """
    got = _read_line(stream, max_line)
    if got is None:
        return None
    line, fits = got
    if line == READY_LINE:
        return Ready()
    kind, _, rest = line.partition(b" ")
    if kind != b"DATA" and kind not in _BY_KIND:
        return Unknown(_text(kind), line)
    try:
        if not fits:
            raise ValueError(f"line longer than {max_line} bytes")
        if kind == b"DATA":
            return _read_data(stream, _words(rest), max_data)
        cls = _BY_KIND[kind]
        return cls.from_fields(_words(rest, cls.MAXSPLIT))
    except (ValueError, IndexError) as e:  # IndexError: a counted list with no count
        raise ProtocolError(f"malformed {_text(kind)} line {line[:80]!r}: {e}") from e


def iter_events(stream: ByteStream) -> Iterator[Event]:
    """Every engine line until EOF."""
    while (ev := read_event(stream)) is not None:
        yield ev


def _read_data(stream: ByteStream, words: list[bytes], max_data: int) -> Data | None:
    _arity(words, 2)
    rid, n = _uint(words[0]), _uint(words[1])
    if n > max_data:
        raise ValueError(f"DATA payload of {n} bytes exceeds {max_data}")
    payload = _read_exact(stream, n)
    end = stream.read(1)
    if payload is None or not end:
        return None
    if end != b"\n":
        raise ProtocolError(f"DATA {rid}: expected b'\\n' after {n} payload bytes, got {end!r}")
    return Data(rid, payload)


# ---------------------------------------------------------------------------- server -> engine


@dataclass(frozen=True)
class Submit:
    """``SUBMIT <id> <slot> <bytes> <max_tokens> <temperature> <top_p> [<grammar_bytes>]``, then
    the payload, the grammar (``grammar_bytes`` of them, straight after the payload, as colibrì's
    gateway writes it) and one newline.

    The grammar (GBNF or a JSON schema, from ``response_format``) is kept on the request; colibrì
    uses it only to steer draft speculation, and it changes no token here.
    """

    id: int
    slot: int
    max_tokens: int
    temperature: float
    top_p: float
    payload: bytes  # the rendered prompt, UTF-8
    grammar: bytes = b""  # UTF-8 without NUL; empty: none


@dataclass(frozen=True)
class Cancel:
    """``CANCEL <id>``: abort; acknowledged by ``ERROR <id> CANCELLED``."""

    id: int
    KIND: ClassVar[bytes] = b"CANCEL"


@dataclass(frozen=True)
class Stop:
    """Extension ``STOP <id>``: end the request early through the normal DONE path."""

    id: int
    KIND: ClassVar[bytes] = b"STOP"


Request = Submit | Cancel | Stop


@dataclass(frozen=True)
class FrameError:
    """A request the engine must refuse: answer ``ERROR <id> <code>``; if fatal, stop reading."""

    code: str  # BAD_REQUEST, BAD_FRAME or EMPTY_PROMPT
    id: int  # 0 when the header could not be parsed
    fatal: bool  # the stream lost its framing: drain in-flight work and exit 0
    reason: str  # for the log, not the wire

    def to_event(self) -> Error:
        return Error(self.id, self.code)


def format_request(req: Request) -> bytes:
    """The exact bytes of one request, newline(s) included."""
    if isinstance(req, Submit):
        nums = [req.id, req.slot, len(req.payload), req.max_tokens]
        fields = [*map(str, nums), repr(float(req.temperature)), repr(float(req.top_p))]
        grammar = [str(len(req.grammar))] if req.grammar else []
        return _line(b"SUBMIT", fields + grammar) + req.payload + req.grammar + b"\n"
    return _line(req.KIND, [str(req.id)])


def read_request(
    stream: ByteStream,
    kv_slots: int,
    *,
    max_payload: int = MAX_PAYLOAD,
    max_grammar: int = MAX_GRAMMAR,
) -> Request | FrameError | None:
    """The next server request, a ``FrameError`` to answer, or None at EOF.

    A refused SUBMIT whose byte counts are readable has its frame drained first, so the next
    request is read from its first byte (BAD_REQUEST, not fatal). One whose counts are not
    readable, or whose frame does not end in a newline where the counts say, leaves no way to
    find the next request: BAD_FRAME, fatal. Each call consumes at least one byte or returns
    None, so a reader loop always ends on a finite stream.
    """
    got = _read_line(stream, MAX_HEADER)
    if got is None:
        return None
    line, fits = got
    if not fits:
        return _bad(0, f"header longer than {MAX_HEADER} bytes")
    kind, _, rest = line.partition(b" ")
    words = _words(rest)
    if kind == b"SUBMIT":
        return _read_submit(stream, words, kv_slots, max_payload, max_grammar)
    if kind in (b"CANCEL", b"STOP"):
        return _id_request(Cancel if kind == b"CANCEL" else Stop, words)
    return _bad(0, f"unknown request kind {kind[:40]!r}")


def _bad(rid: int, reason: str) -> FrameError:
    return FrameError("BAD_REQUEST", rid, False, reason)


def _id_request(cls: type[Cancel] | type[Stop], words: list[bytes]) -> Request | FrameError:
    try:
        (field,) = words
        rid = _u64(field)
    except ValueError:
        return _bad(0, f"unparseable {cls.KIND.decode()} header")
    return cls(rid) if rid else _bad(0, "id must be non-zero")


def _read_submit(
    stream: ByteStream, words: list[bytes], kv_slots: int, max_payload: int, max_grammar: int
) -> Submit | FrameError:
    head = _submit_header(words)
    rid = head.id if head is not None else 0
    sizes = _frame_sizes(words)
    if sizes is None:
        return FrameError("BAD_FRAME", rid, True, "SUBMIT header without readable byte counts")
    n, g = sizes
    keep = n <= max_payload and g <= max_grammar
    frame = _read_frame(stream, n + g, keep)
    if frame.fault is not None:
        return FrameError("BAD_FRAME", rid, True, frame.fault)
    if head is None:
        return _bad(0, "unparseable SUBMIT header")
    if frame.payload is None:
        return _bad(
            rid, f"payload of {n} bytes over {max_payload}, or grammar of {g} over {max_grammar}"
        )
    req = replace(head, payload=frame.payload[:n], grammar=frame.payload[n:])
    return _validate(req, kv_slots)


def _frame_sizes(words: list[bytes]) -> tuple[int, int] | None:
    """(payload bytes, grammar bytes) if the header says them readably: enough to drain the
    frame even when other fields are malformed. A header of more than 7 fields says neither."""
    if len(words) < 3 or len(words) > 7 or not _UINT.fullmatch(words[2]):
        return None
    if len(words) < 7:
        return int(words[2]), 0
    if not _UINT.fullmatch(words[6]):
        return None
    return int(words[2]), int(words[6])


def _submit_header(words: list[bytes]) -> Submit | None:
    """The SUBMIT header's values with an empty payload, or None if any field is malformed."""
    if len(words) not in (6, 7):
        return None
    try:
        rid, slot, _, max_tokens, temperature, top_p = words[:6]
        nums = (_u64(rid), _int(slot), _int(max_tokens), _float(temperature), _float(top_p))
    except ValueError:
        return None
    return Submit(*nums, payload=b"")


def _submit_checks(req: Submit, kv_slots: int) -> Iterator[tuple[bool, str, str]]:
    """(passes, code, reason) per rule, in the order they are reported."""
    yield req.id != 0, "BAD_REQUEST", "id must be non-zero"
    yield 0 <= req.slot < kv_slots, "BAD_REQUEST", f"slot {req.slot} outside 0..{kv_slots - 1}"
    yield (
        0.0 <= req.temperature <= 2.0,
        "BAD_REQUEST",
        f"temperature {req.temperature} not in [0, 2]",
    )
    yield 0.0 < req.top_p <= 1.0, "BAD_REQUEST", f"top_p {req.top_p} not in (0, 1]"
    yield req.max_tokens >= 1, "BAD_REQUEST", f"max_tokens {req.max_tokens} < 1"
    yield b"\0" not in req.payload, "BAD_REQUEST", "payload contains a NUL byte"
    yield _is_utf8(req.payload), "BAD_REQUEST", "payload is not valid UTF-8"
    yield b"\0" not in req.grammar, "BAD_REQUEST", "grammar contains a NUL byte"
    yield _is_utf8(req.grammar), "BAD_REQUEST", "grammar is not valid UTF-8"
    yield len(req.payload) > 0, "EMPTY_PROMPT", "payload is empty"


def _validate(req: Submit, kv_slots: int) -> Submit | FrameError:
    for ok, code, reason in _submit_checks(req, kv_slots):
        if not ok:
            return FrameError(code, req.id, False, reason)
    return req


def _is_utf8(payload: bytes) -> bool:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# ---------------------------------------------------------------------------- stream plumbing


@dataclass(frozen=True)
class _Frame:
    payload: bytes | None  # None when over the cap (drained, not kept) or faulty
    fault: str | None  # a fatal framing problem


def _read_frame(stream: ByteStream, n: int, keep: bool) -> _Frame:
    """Read (or, when not kept, drain) n frame bytes and check the newline after them."""
    if not keep:
        payload, complete = None, _skip(stream, n)
    else:
        payload = _read_exact(stream, n)
        complete = payload is not None
    if not complete:
        return _Frame(None, "payload cut short by end of input")
    end = stream.read(1)
    if end != b"\n":
        return _Frame(None, f"expected b'\\n' after the {n}-byte frame, got {end!r}")
    return _Frame(payload, None)


def _read_line(stream: ByteStream, cap: int) -> tuple[bytes, bool] | None:
    """(line without its newline, whether it fit in cap bytes); None at EOF or a cut line.

    An over-long line is returned truncated to cap bytes, its rest drained unbuffered.
    """
    line = stream.readline(cap + 1)
    if line.endswith(b"\n"):
        return line[:-1], True
    if len(line) <= cap:
        return None
    _skip_line(stream)
    return line[:cap], False


def _skip_line(stream: ByteStream) -> None:
    while (chunk := stream.readline(_CHUNK)) and not chunk.endswith(b"\n"):
        pass


def _read_exact(stream: ByteStream, n: int) -> bytes | None:
    """Exactly n bytes (looping over short reads), or None if EOF comes first."""
    parts, left = [], n
    while left > 0:
        chunk = stream.read(left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _skip(stream: ByteStream, n: int) -> bool:
    """Discard n bytes in bounded chunks; False if EOF comes first."""
    while n > 0:
        chunk = stream.read(min(n, _CHUNK))
        if not chunk:
            return False
        n -= len(chunk)
    return True


# ---------------------------------------------------------------------------- text


class UTF8Assembler:
    """Joins DATA payloads into text, holding back a UTF-8 character split across frames."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, payload: bytes) -> str:
        """The text completed by this payload (possibly empty)."""
        return self._decoder.decode(payload)

    def flush(self) -> str:
        """Whatever is held back, as U+FFFD if incomplete; call at the request's DONE."""
        return self._decoder.decode(b"", final=True)
