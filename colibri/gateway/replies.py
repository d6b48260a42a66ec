"""One request's answer as the client sees it: text deltas, stop strings, usage, the colibri object.

The engine knows no stop strings, so `StopScanner` watches the decoded text, holding back any
tail that could be the start of one; when one appears the text is cut before it and the engine
is told `STOP <id>`, which ends the request through its normal DONE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from colibri.gateway.engine_client import EngineGone, EngineRequest
from colibri.gateway.telemetry import gpu_json, repin_json
from colibri.protocol.codec import Data, Done, Error, UTF8Assembler


class StopScanner:
    """Releases streamed text up to the first stop string, never a partial one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hit = False
        self._held = ""

    def feed(self, text: str) -> str:
        """The text that is safe to release now (after a hit: nothing more, ever)."""
        if self.hit:
            return ""
        buf = self._held + text
        at = [i for s in self.stops if (i := buf.find(s)) >= 0]
        if at:
            self.hit, self._held = True, ""
            return buf[: min(at)]
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of the text (it did not become a stop string)."""
        out, self._held = self._held, ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


class Reply:
    """Reads a started turn: `deltas()` yields its text; then `end` says how it ended."""

    def __init__(self, turn: EngineRequest, stops: Sequence[str]):
        self.turn = turn
        self.text = ""  # everything released so far
        self.end: Done | Error | EngineGone | None = None
        self._utf8 = UTF8Assembler()
        self._stops = StopScanner(stops)
        self._stop_sent = False

    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces until the engine ends the request (STOP is sent at a stop string)."""
        while self.end is None:
            ev = await self.turn.chunks.get()
            if isinstance(ev, Data):
                piece = self._release(self._utf8.feed(ev.payload))
            else:
                self.end = ev
                piece = self._release(self._utf8.flush()) + self._stops.flush()
            if piece:
                self.text += piece
                yield piece

    async def read(self) -> str:
        """The whole text, once the request has ended."""
        async for _ in self.deltas():
            pass
        return self.text

    def abandon(self) -> None:
        """The client left before the end: cancel the request so its slot frees at once."""
        if self.end is None:
            self.turn.cancel()

    @property
    def done(self) -> Done | None:
        return self.end if isinstance(self.end, Done) else None

    @property
    def finish_reason(self) -> str:
        """ "length" when max_tokens or the context cut the answer, else "stop"."""
        limited = self.done is not None and self.done.length_limited and not self._stops.hit
        return "length" if limited else "stop"

    def usage(self) -> dict:
        done = self.done
        prompt = done.prompt_tokens if done else 0
        completion = done.emitted if done else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def colibri(self) -> dict:
        """`{stats, perf, topk, entropy, gpus, repin}` of the finished turn (DONE's numbers)."""
        t, done = self.turn, self.done
        stats = None
        if done is not None:
            stats = {
                "emitted": done.emitted,
                "tok_s": done.tok_s,
                "hit_pct": done.hit_pct,
                "rss_gb": done.rss_gb,
                "prompt_tokens": done.prompt_tokens,
                "length_limited": done.length_limited,
                "reused_tokens": t.accept.reused_tokens if t.accept and t.own_cache else 0,
                "slot": t.slot,
                "replica": t.replica,
            }
        perf = None
        if t.perf is not None:
            p = t.perf
            times = (p.dt, p.t_edisk, p.t_ewait, p.t_emm, p.t_attn, p.t_kvb, p.t_head)
            names = ("dt", "t_edisk", "t_ewait", "t_emm", "t_attn", "t_kvb", "t_head")
            perf = dict(zip(names, times, strict=True))
        return {
            "stats": stats,
            "perf": perf,
            "topk": [[_candidate(lp, tok) for lp, tok in k.entries] for k in t.topk],
            "entropy": list(t.entropy.values) if t.entropy else [],
            "gpus": [gpu_json(d) for d in t.gpus.devices] if t.gpus else [],
            "repin": [repin_json(r) for r in t.repins],
        }

    def _release(self, text: str) -> str:
        out = self._stops.feed(text)
        if self._stops.hit and self.end is None and not self._stop_sent:
            self._stop_sent = True
            self.turn.stop()
        return out


def _candidate(logprob: float, token: bytes) -> dict:
    return {"token": token.decode("utf-8", errors="replace"), "logprob": logprob}
