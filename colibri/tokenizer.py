"""Tokenizer from `tokenizer.json`: encode text and give each token's exact bytes for streaming."""

from __future__ import annotations

import functools
import json
import re
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class Tokenizer:
    """A `tokenizers` tokenizer plus per-token bytes (byte-level BPE or SentencePiece-style)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.hf = HFTokenizer.from_file(str(self.path))
        except Exception as e:
            raise ValueError(f"{self.path}: cannot load tokenizer ({e})") from None
        spec = json.loads(self.path.read_text())
        self._byte_level = _uses_byte_level(spec)
        self._special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self._bytes_cache: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.hf.token_to_id(text)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token as the vocabulary spells it (UTF-8), at least 1: an upper
        bound on the bytes one token stands for, up to what the normalizer folds."""
        return max((len(p.encode()) for p in self.hf.get_vocab(with_added_tokens=True)), default=1)

    def token_bytes(self, tid: int) -> bytes:
        """The exact bytes token `tid` contributes to the text (may be part of a UTF-8 char)."""
        b = self._bytes_cache.get(tid)
        if b is None:
            b = self._token_bytes(tid)
            self._bytes_cache[tid] = b
        return b

    def _token_bytes(self, tid: int) -> bytes:
        piece = self.hf.id_to_token(tid)
        if piece is None:
            return b""
        if tid in self._special:
            return piece.encode()
        if self._byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        m = _BYTE_FALLBACK.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def _uses_byte_level(spec: dict) -> bool:
    def has(node: dict | None) -> bool:
        if not node:
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(n) for n in node.get("decoders", []) + node.get("pretokenizers", []))

    return has(spec.get("decoder")) or has(spec.get("pre_tokenizer"))
