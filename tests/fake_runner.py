"""A scripted runner for scheduler tests: what `Scheduler` needs of a `Runner`, without JAX.

The model it fakes is a rule over each slot's KV cache: the token after a context is
`next_token(context)` (a function of its last token, its length and its sum, over VOCAB
tokens), and its logits rank every token by how far it lies past that one, so greedy decoding
picks it and sampling draws around it. Tokens a prompt or a request did not feed are never in
a context, so a wrong position, a reused prefix that is not the slot's or a token fed twice
changes what comes out. The cache is a list of token ids per slot: a write at a position drops
what lay after it (what a real cache holds there is never read before it is written again),
and a write that would leave a gap, a position outside the context or a malformed call raises
ValueError, as a misused runner would, and is noted in `misuse` (the scheduler may catch it).

Routes are a rule too: `experts(token, pos)` [n_moe, K], counted in `stats` (an
ExpertStats of N_MOE x N_EXPERTS) as the real runner counts them: a prefill at once, a decode
forward's kept rows when it lands. Forwards compute when they start (calls come in the order
the device would run them); only a cuttable burst's length is decided when it lands. A burst
ends after the step by which every row has chosen one of the `stops` it was given.

Scripts: `chains` and `cuts` (what the runner allows), `faults` (failures to raise, see
`Fault`), `frame(during=k)` (input comes in during step k of a cuttable burst: it ends after
that step), and the `calls` log of every decode forward started.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colibri.engine.runner import Row
from colibri.engine.telemetry import Timers
from colibri.experts.stats import ExpertStats

VOCAB = 32
N_MOE = 2  # MoE layers
N_EXPERTS = 8
TOP_K = 2


def next_token(context: Sequence[int]) -> int:
    """The model: the token that follows `context` (not empty)."""
    return (5 * context[-1] + 3 * len(context) + sum(context)) % VOCAB


def logits_after(context: Sequence[int]) -> np.ndarray:
    """Logits [VOCAB] after `context`: 0 for `next_token`, -d for the token d places past it."""
    best = next_token(context)
    return -((np.arange(VOCAB) - best) % VOCAB).astype(np.float32)


def experts(token: int, pos: int) -> np.ndarray:
    """The experts [N_MOE, TOP_K] a token at a position is routed to (distinct per layer)."""
    layer = np.arange(N_MOE)[:, None]
    return (token + (layer + 1) * pos + np.arange(TOP_K)[None]) % N_EXPERTS


@dataclass
class Fault:
    """A failure to inject: `at` "prefill" (prefill raises), "start" (decode_async raises),
    "land" (the forward's tokens() and result() raise) or "nan" (a decode forward's logits
    are NaN: sampling them raises; its greedy tokens, the device's, are unaffected), on the
    next call that touches `slot` (any call where None), `times` times."""

    at: str
    slot: int | None = None
    times: int = 1


class FakeInFlight:
    """A started decode forward, computed already: tokens [steps, B], logits [steps, B, V]
    and routes [steps, N_MOE, B, TOP_K] of every step it was started for."""

    def __init__(self, runner, tokens, logits, routes, cuttable: bool, broken: bool, limit: int):
        self._runner, self._tokens, self._logits, self._routes = runner, tokens, logits, routes
        self.steps = tokens.shape[0]
        self.cuttable = cuttable
        self.t_start = time.perf_counter()
        self._broken = broken
        self._limit = limit  # steps it runs uncut: fewer where every row chose a stop token
        self._ran: int | None = None if cuttable else limit
        self._landed = False  # (ran() has slept for its steps)
        self._value = None

    def ran(self) -> int:
        if self._ran is None:  # a cuttable burst: cut where a frame came in
            during, self._runner.frame_during = self._runner.frame_during, None
            self._ran = self._limit if during is None else max(1, min(during, self._limit))
        if not self._landed:
            self._landed = True
            time.sleep(self._runner.step_s * self._ran)
        return self._ran

    def tokens(self) -> np.ndarray:
        if self._broken:
            raise RuntimeError("injected: the forward failed")
        return self._tokens[: self.ran()].copy()

    def result(self, keep=None):
        if self._broken:
            raise RuntimeError("injected: the forward failed")
        if self._value is None:
            ran, rows = self.ran(), self._tokens.shape[1]
            routes = self._routes[:ran]
            if keep is None:
                keep = np.ones((ran, rows), bool)
            keep = np.asarray(keep, bool).reshape(-1, rows)
            if keep.shape[0] != ran:
                raise self._runner.misused(f"keep has {keep.shape[0]} steps, the forward ran {ran}")
            stats = self._runner.stats
            distinct = int(stats.record_steps(routes, keep).sum())
            stats.record_lookups(distinct, distinct)
            if self.steps == 1:
                self._value = self._logits[0], routes[0]
            else:
                self._value = None, routes
        return self._value


class FakeRunner:
    """`slots` KV slots of `capacity` positions over the `next_token` model (module doc)."""

    def __init__(self, slots: int = 4, capacity: int = 64, chains: bool = True, cuts: bool = True):
        self.slots = slots
        self.capacity = capacity
        self.chains = chains
        self.cuts = cuts
        self.stats = ExpertStats(N_MOE, N_EXPERTS)
        self.timers = Timers()
        self.cache: list[list[int]] = [[] for _ in range(slots)]
        self.faults: list[Fault] = []
        self.frame_during: int | None = None
        self.step_s = 0.0  # how long each step a forward runs takes to land (slept)
        self.calls: list[tuple[int, bool, bool]] = []  # (steps, cuttable, chained) per start
        self.prefills = 0  # prefills that returned
        self.turns = 0  # end_turn calls
        self.misuse: list[str] = []  # calls the real runner would refuse, or compute wrongly

    def frame(self, during: int = 1) -> None:
        """Input comes in during step `during` of the cuttable burst in flight (or the next
        one started): it ends after that step."""
        self.frame_during = during

    def prefill(self, slot: int, tokens: list[int], start: int = 0):
        if not tokens or not 0 <= start <= len(self.cache[slot]):
            raise self.misused(f"prefill of {len(tokens)} tokens at {start} of slot {slot}")
        if start + len(tokens) > self.capacity:
            raise self.misused(f"{start + len(tokens)} positions exceed {self.capacity}")
        if self._fault("prefill", [slot]):
            raise RuntimeError("injected: prefill failed")
        cache = self.cache[slot]
        del cache[start:]
        routes = []
        for tok in tokens:
            routes.append(experts(tok, len(cache)))
            cache.append(tok)
        routes = np.stack(routes, axis=1)  # [N_MOE, T, TOP_K]
        distinct = self.stats.record_all(routes)
        self.stats.record_lookups(distinct, distinct)
        self.prefills += 1
        return logits_after(cache), routes

    def decode_async(
        self,
        rows: list[Row],
        after: FakeInFlight | None = None,
        steps: int = 1,
        cuttable: bool = False,
        most: int = 0,
        stops: Sequence[int] = (),
    ) -> FakeInFlight:
        slots = [r.slot for r in rows]
        if not rows or len(set(slots)) != len(slots) or not all(0 <= s < self.slots for s in slots):
            raise self.misused(f"decode rows on slots {slots}")
        if steps > 1 and not self.chains:
            raise self.misused("bursts need a runner that chains")
        if cuttable and not (self.cuts and self.chains and steps > 1):
            raise self.misused("cuttable bursts need a runner that cuts")
        if steps > most and steps > 1:
            raise self.misused(f"a burst of {steps} steps in the program of {most}")
        chained = any(r.take >= 0 for r in rows)
        if chained and after is None:
            raise self.misused("rows take tokens from an earlier forward, but none was given")
        if after is not None and after.cuttable:
            raise self.misused("nothing can be chained behind a cuttable burst")
        if max(r.pos for r in rows) + steps - 1 >= self.capacity:
            raise self.misused("a position outside the context")
        if self._fault("start", slots):
            raise RuntimeError("injected: the forward did not start")
        broken = self._fault("land", slots)
        nan = [self._fault("nan", [s]) for s in slots]
        self.calls.append((steps, cuttable, chained))
        B = len(rows)
        feed = [after._tokens[-1, r.take] if r.take >= 0 else r.token for r in rows]
        tokens = np.zeros((steps, B), np.int32)
        logits = np.zeros((steps, B, VOCAB), np.float32)
        routes = np.zeros((steps, N_MOE, B, TOP_K), np.int64)
        for s in range(steps):
            for i, r in enumerate(rows):
                pos, cache = r.pos + s, self.cache[r.slot]
                if not isinstance(feed[i], int | np.integer) or pos > len(cache):
                    raise self.misused(f"slot {r.slot}: token {feed[i]} at {pos} of {len(cache)}")
                del cache[pos:]
                cache.append(int(feed[i]))
                routes[s, :, i] = experts(int(feed[i]), pos)
                logits[s, i] = np.nan if nan[i] else logits_after(cache)
                tokens[s, i] = next_token(cache)
            feed = [int(t) for t in tokens[s]]
        # a burst ends after the step by which every row has chosen a stop token
        stopped = np.logical_or.accumulate(np.isin(tokens, list(stops)), axis=0).all(axis=1)
        limit = int(np.argmax(stopped)) + 1 if stopped.any() else steps
        return FakeInFlight(self, tokens, logits, routes, cuttable, broken, limit)

    def end_turn(self) -> None:
        self.turns += 1

    def export_slot(self, slot: int, length: int) -> dict[str, np.ndarray]:
        return {"tok": np.asarray(self.cache[slot][:length], np.int32)[:, None]}

    def import_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        self.cache[slot] = [int(t) for t in arrays["tok"][:, 0]]

    def misused(self, what: str) -> ValueError:
        """Note a misuse; the error to raise."""
        self.misuse.append(what)
        return ValueError(what)

    def _fault(self, at: str, slots: list[int]) -> bool:
        """Whether an armed fault fires here (it is used up)."""
        for f in self.faults:
            if f.at == at and (f.slot is None or f.slot in slots):
                f.times -= 1
                if f.times <= 0:
                    self.faults.remove(f)
                return True
        return False
