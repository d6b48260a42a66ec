"""Requests over KV slots: admission, serial prefill, continuously batched decode, per-turn reports.

No I/O: callers hand in requests and get back engine events (the protocols turn them into lines).
Each slot remembers the tokens whose KV it holds, so a request reuses the longest common prefix
and prefills only the rest. A step lands the decode forward in flight (every active request
contributed one row), admits waiting requests (serial prefill, within a token budget) and
starts the next forward before it returns the landed forward's events, so that the caller
writes them while the forward runs (`Scheduler.step` says when forwards chain on the device
and when one is a burst of several steps).
"""

from __future__ import annotations

import errno
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np

from colibri.engine.kvstore import KVStore
from colibri.engine.runner import Row
from colibri.engine.sampling import log_softmax, sample
from colibri.engine.telemetry import Timers
from colibri.experts.stats import ExpertStats, RepinEvent

log = logging.getLogger("colibri")

# Error codes a request can end with (the wire names them the same way).
DUPLICATE_ID = "DUPLICATE_ID"
SLOT_BUSY = "SLOT_BUSY"
EMPTY_PROMPT = "EMPTY_PROMPT"
CONTEXT_EXCEEDED = "CONTEXT_EXCEEDED"
STATE_WRITE = "STATE_WRITE"  # advisory, id 0: a state file could not be written (errno name)
NOT_FOUND = "NOT_FOUND"
CANCELLED = "CANCELLED"
BAD_REQUEST = "BAD_REQUEST"
INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class GenRequest:
    """One turn to generate: `prompt` token ids into KV slot `slot`."""

    id: int
    slot: int
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    grammar: str = ""  # a grammar or JSON schema the answer is expected to follow (kept, unused)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-engine generation policy."""

    ngen: int = 0  # cap on every request's max_tokens (0 = no cap)
    seed: int = 0  # sampling seed; each request draws from (seed, id)
    topk: int = 0  # candidates reported with each token (0 = none)
    gates: int = 0  # routing reported: 1 each token's forward, 2 also prompt tokens (0 = none)
    hits_every: int = 6  # decode steps between HitsTick events
    prefill_budget: int = 256  # prompt tokens prefilled per step before decoding resumes
    stop_ids: tuple[int, ...] = ()  # tokens that end a turn (never emitted)
    burst: int = 48  # most decode steps per forward (Scheduler._burst)
    burst_ms: float = 5.0  # longest a chained burst may be expected to take (input waits it)
    full_burst_ms: float = 20.0  # the same while every KV slot is taken (no prompt can wait)
    cut_bursts: bool = True  # longer bursts too, cut short by input (Runner.cuts), unchained
    stream_ms: float = 200.0  # longest a burst may hold back its tokens (slower: one step each)

    def __post_init__(self) -> None:
        for name in ("ngen", "seed", "topk", "prefill_budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.gates not in (0, 1, 2):
            raise ValueError(f"gates={self.gates} must be 0, 1 or 2")
        if self.hits_every < 1:
            raise ValueError(f"hits_every={self.hits_every} must be >= 1")
        if self.burst < 1:
            raise ValueError(f"burst={self.burst} must be >= 1")
        for name in ("burst_ms", "full_burst_ms", "stream_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")


# ---------------------------------------------------------------------------- the runner


class InFlightLike(Protocol):
    """What the scheduler reads of a started decode forward (`colibri.engine.runner.InFlight`)."""

    steps: int  # steps it was started for: 1, or a burst's
    cuttable: bool  # a burst the input may cut short (nothing is chained behind it)
    t_start: float  # time.perf_counter() when it was started (queued, if chained)

    def ran(self) -> int:
        """Steps it ran: `steps`, or fewer where a cuttable burst was cut (waits for it)."""

    def tokens(self) -> np.ndarray:
        """The rows' greedy tokens at every step it ran [ran, B] (waits for them)."""

    def result(self, keep: Sequence | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """A step's (logits [B, V], routes [n_moe, B, K]), a burst's (None, routes [ran, n_moe,
        B, K]); only rows in `keep` ([B], or [ran, B]) count in the statistics."""

    def routing(self) -> Any:
        """A traced step's host routing (`transformer.Routing`): ids and gate weights
        [n_moe, B, K], the router's entropy and margin [n_moe, B]."""


F = TypeVar("F", bound=InFlightLike)  # the runner's own kind of forward, fed back as `after`


class RunnerLike(Protocol[F]):
    """What the scheduler needs of a runner (`colibri.engine.runner.Runner`): KV slots,
    prefill, decode forwards (chained, bursts), expert statistics and phase timers."""

    slots: int  # KV slots, numbered 0 .. slots-1
    capacity: int  # positions per slot (a prompt and its answer)
    stats: ExpertStats  # expert counters: lookups and hits, hits since the last tick, repins
    timers: Timers  # cumulative phase seconds (turn reports take deltas)

    @property
    def chains(self) -> bool:
        """Whether forwards chain behind one in flight, and bursts of steps run."""

    @property
    def cuts(self) -> bool:
        """Whether bursts may be cuttable (ended early when input comes in)."""

    def prefill(
        self, slot: int, tokens: list[int], start: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Feed tokens at positions start..: logits [V] after the last one, routes [n_moe, T, K]."""

    def prefill_traced(
        self, feeds: Sequence[tuple[int, Sequence[int], int]]
    ) -> tuple[np.ndarray, list[Any]]:
        """`prefill` of (slot, tokens, start) feeds through the traced program: logits [n, V]
        and each feed's host routing (`transformer.Routing`, [n_moe, T, ...]); with gates only."""

    def decode_async(
        self,
        rows: list[Row],
        after: F | None = None,
        steps: int = 1,
        cuttable: bool = False,
        most: int = 0,
        stops: Sequence[int] = (),
    ) -> F:
        """Start a forward of one token per row (a burst of greedy `steps`, in the program of
        bursts of up to `most`, ended early once every row chose one of `stops`), behind
        `after`; with gates the scheduler also passes `trace=True` (one step, routing() then
        works)."""

    def end_turn(self) -> None:
        """A turn ended: persist the expert usage (called where the runner has it)."""

    def export_slot(self, slot: int, length: int) -> dict[str, np.ndarray]:
        """The KV of positions 0..length-1 of slot, as host arrays (for the KV store)."""

    def import_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        """Put `export_slot`'s arrays back into slot (a restore)."""


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Accepted:
    """A request passed validation and is about to be prefilled."""

    id: int
    prompt_tokens: int
    reused_tokens: int  # prefix taken from the slot's cache


@dataclass(frozen=True)
class Token:
    """One emitted token, its bytes, and (if configured) the top candidates it was drawn from."""

    id: int
    token: int
    text: bytes
    topk: tuple[tuple[float, bytes], ...] = ()  # (natural-log prob, token bytes), best first
    gates: TokenGates | None = None  # the routing of the forward that chose it (if configured)


@dataclass(frozen=True)
class TokenGates:
    """The routing of one token fed to the model (`SchedulerConfig.gates`): per MoE layer its
    K experts by descending gate weight (ties in the router's order), their gate weights, and
    the entropy (bits) and top-1 minus top-2 margin of the router's distribution. A `Token`
    carries the gates of the forward that chose it, whose input is the token before it; those
    of the other prompt tokens are events of their own (gates 2)."""

    id: int
    pos: int  # position of the fed token in its slot
    token: int  # the fed token
    experts: np.ndarray  # [n_moe, K] int32
    weights: np.ndarray  # [n_moe, K] float32
    entropy: np.ndarray  # [n_moe] float32
    margin: np.ndarray  # [n_moe] float32


@dataclass(frozen=True)
class TurnReport:
    """Everything the end of a turn reports."""

    emitted: int
    tok_s: float  # over the decode window (after the first token)
    hit_pct: float
    prompt_tokens: int
    length_limited: bool  # max_tokens, NGEN or the context ended it
    dt: float  # wall seconds from acceptance to the end
    phases: dict[str, float]  # runner timer deltas over the same window
    entropy: tuple[float, ...]  # [n_moe] bits of this turn's expert-selection counts
    tiers: tuple[int, int, int, float, float]
    emap: bytes
    hits: np.ndarray  # bool [rows, cols]: experts routed since the previous HITS
    forwards: int = 0  # model forward passes over the window (prefills and decode steps, any slot)


@dataclass(frozen=True)
class Finished:
    id: int
    report: TurnReport


@dataclass(frozen=True)
class Failed:
    """A request ended without DONE: a refusal, a cancellation, or an internal error."""

    id: int
    code: str
    detail: tuple[str, ...] = ()


@dataclass(frozen=True)
class HitsTick:
    """Experts routed since the previous tick (every `hits_every` decode steps)."""

    hits: np.ndarray  # bool [rows, cols]


Event = Accepted | Token | TokenGates | Finished | Failed | HitsTick | RepinEvent


# ---------------------------------------------------------------------------- state


@dataclass
class _Slot:
    history: list[int] = field(default_factory=list)  # tokens cached at positions 0..len-1
    owner: int | None = None  # id of the in-flight request holding the slot


@dataclass
class _Run:
    """An admitted request: its limits, sampler and counters."""

    req: GenRequest
    limit: int  # tokens it may emit
    rng: np.random.Generator
    t_accept: float
    timers0: dict[str, float]
    lookups0: tuple[int, int]  # (lookups, hits) at acceptance: DONE's hit_pct is this turn's
    forwards0: int  # the scheduler's forward count at acceptance
    routes: list[np.ndarray] = field(default_factory=list)  # [n_moe, T, K] per forward
    emitted: int = 0
    chosen: int = 0  # tokens chosen, emitted or about to be (reports follow the next launch)
    pending: int | None = None  # last sampled token, fed at the next decode step
    t_first: float = 0.0


_Forward = tuple[list[_Run], InFlightLike]  # a decode forward started, and its rows' requests
# a request's next token, its logits if any, and its gates if configured
_Chosen = tuple[_Run, int, np.ndarray | None, TokenGates | None]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def by_weight(routing: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids, weights, entropy, margin) of a host routing (`transformer.Routing`: ids and
    weights [n_moe, N, K], entropy and margin [n_moe, N]), each row's K experts by descending
    gate weight (stable: ties keep the router's order)."""
    order = np.argsort(-np.asarray(routing.weights), axis=-1, kind="stable")
    ids = np.take_along_axis(np.asarray(routing.ids, np.int32), order, -1)
    wts = np.take_along_axis(np.asarray(routing.weights, np.float32), order, -1)
    ent, margin = np.asarray(routing.entropy, np.float32), np.asarray(routing.margin, np.float32)
    return ids, wts, ent, margin


def gates_of(rid: int, start: int, tokens: Sequence[int], routing: Any) -> list[TokenGates]:
    """The `TokenGates` of tokens fed at positions start.., from their host routing
    ([n_moe, T, ...], `by_weight`)."""
    ranked = by_weight(routing)
    return [
        TokenGates(rid, start + t, int(tok), *(a[:, t] for a in ranked))
        for t, tok in enumerate(tokens)
    ]


def entropy_bits(counts: np.ndarray) -> tuple[float, ...]:
    """Shannon entropy in bits of each row of counts [n_moe, E] (0 for an empty row)."""
    out = []
    for row in counts:
        total = row.sum()
        p = row[row > 0] / total if total else row[:0]
        out.append(float(-(p * np.log2(p)).sum()) if p.size else 0.0)
    return tuple(out)


class Scheduler:
    """Requests over the runner's KV slots; `step` advances every in-flight request."""

    def __init__(
        self,
        runner: RunnerLike[Any],
        token_bytes: Callable[[int], bytes],
        config: SchedulerConfig = SchedulerConfig(),
        kv_store: KVStore | None = None,
    ):
        self.runner = runner
        self.token_bytes = token_bytes
        self.config = config
        self.kv_store = kv_store
        # With gates every decode forward is the traced program (one step; no bursts)
        self._trace = {"trace": True} if config.gates else {}
        self.slots = [_Slot() for _ in range(runner.slots)]
        self.waiting: deque[GenRequest] = deque()
        self.active: dict[int, _Run] = {}  # id -> run, in admission order
        self.steps = 0  # decode steps so far
        self.forwards = 0  # model forward passes so far: prefills and decode steps
        self.inflight: _Forward | None = None  # the decode forward running between steps
        self._periods: deque[float] = deque(maxlen=8)  # seconds per decode step, lately
        self._landed = 0.0  # when the last forward landed
        self._state_failed = False  # a state write failed this session (reported once)
        self._advisories: list[Event] = []  # engine-wide lines for the next turn end

    # ------------------------------------------------------------------ public surface

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def in_flight(self) -> list[int]:
        return [r.id for r in self.waiting] + list(self.active)

    def history(self, slot: int) -> list[int]:
        """The tokens whose KV `slot` holds."""
        return list(self.slots[slot].history)

    def restore(self) -> int:
        """Reload every slot the KV store holds; returns how many positions came back."""
        if self.kv_store is None:
            return 0
        total = 0
        for i, slot in enumerate(self.slots):
            total += self._restore_slot(i, slot)
        return total

    def submit(self, req: GenRequest) -> list[Event]:
        """Validate and queue; a refusal comes back as a Failed event."""
        refusal = self._refusal(req)
        if refusal is not None:
            return [refusal]
        self.slots[req.slot].owner = req.id
        self.waiting.append(req)
        return []

    def cancel(self, rid: int) -> list[Event]:
        """End a request without DONE, after its slot's KV is persisted."""
        if self._drop_waiting(rid):
            return [Failed(rid, CANCELLED)]
        run = self.active.pop(rid, None)
        if run is None:
            return [Failed(rid, NOT_FOUND)]
        self._close(run)
        return [Failed(rid, CANCELLED), *self._take_advisories()]

    def stop(self, rid: int) -> list[Event]:
        """End a request now through the normal DONE path."""
        for req in self.waiting:
            if req.id == rid:
                self._drop_waiting(rid)
                return [Finished(rid, self._unstarted_report(req))]
        run = self.active.pop(rid, None)
        if run is None:
            return [Failed(rid, NOT_FOUND)]
        return self._finish(run, limited=False)

    def stop_all(self) -> list[Event]:
        return [ev for rid in self.in_flight() for ev in self.stop(rid)]

    def warmup(self) -> Iterator[str]:
        """The runner's warm-up (`Runner.warmup`: every program traffic can reach, one a
        `next()`) for this scheduler's bursts and KV store; none where the runner has none,
        nor with gates (its programs are not those traffic reaches then)."""
        warm = getattr(self.runner, "warmup", None)
        if warm is None or self.config.gates:  # (gates: the traced programs run instead)
            return iter(())
        n = self.config.burst
        bursts = n > 1 and self.runner.chains and not (self.config.topk or self.config.gates)
        return warm(steps=n if bursts else 1, export=self.kv_store is not None)

    def step(self) -> list[Event]:
        """One decode step: land the forward in flight and choose its tokens, admit waiting
        requests (serial prefill), and have the next decode forward over every active request
        running before this step's events are built (and written out by the caller).

        When every request of the forward in flight decodes greedily, the next forward is
        started before the host waits for it, fed from its greedy tokens on the device; a row
        whose token turns out to be a stop token is then computed once for nothing.

        When moreover no prompt waits and no TOPK or gates are asked for, a forward is a burst
        of up to `config.burst` steps in one program (experts resident; `_burst` says how
        many): the host dispatches once for them all, where that costs as much as the step
        itself on small models, and on larger ones takes cores from the kernels and leaves
        every cache cold. The HITS ticks that fall inside a burst come when it lands, each
        with the experts of its own steps. One that the recent steps say would last at most
        `config.burst_ms` (`config.full_burst_ms` while every KV slot is taken: no new prompt
        can start until a request ends, and only CANCEL, STOP and refusals wait for the
        burst) runs whole, and the next forward is chained behind it; a longer one is
        cuttable (`config.cut_bursts`): it ends after the step in which a frame comes in
        (`kernels.request_cut`, raised by the input thread) and nothing is chained behind it.
        Requests submitted, cancelled or stopped meanwhile are handled when the burst lands,
        and the steps of a request that ends inside one are left out of every count. A
        burst's tokens are those of its steps one by one."""
        nxt = self._chain()
        decoded, chosen = self._collect()
        events = self._admit()
        if self.active and nxt is None:
            nxt, failed = self._launch()
            events += failed
        self.inflight = nxt
        return self._report_decoded(decoded, chosen) + events

    # ------------------------------------------------------------------ admission

    def _refusal(self, req: GenRequest) -> Failed | None:
        if req.id in self.in_flight():
            return Failed(req.id, DUPLICATE_ID)
        if not 0 <= req.slot < len(self.slots):
            return Failed(req.id, BAD_REQUEST)
        if self.slots[req.slot].owner is not None:
            return Failed(req.id, SLOT_BUSY)
        if not req.prompt:
            return Failed(req.id, EMPTY_PROMPT)
        if len(req.prompt) + 1 > self.runner.capacity:
            detail = (str(len(req.prompt)), str(self.runner.capacity))
            return Failed(req.id, CONTEXT_EXCEEDED, detail)
        if req.max_tokens < 1:
            return Failed(req.id, BAD_REQUEST)
        return None

    def _admit(self) -> list[Event]:
        events: list[Event] = []
        budget = self.config.prefill_budget
        while self.waiting and (budget > 0 or not events):
            req = self.waiting.popleft()
            budget -= len(req.prompt) - self._reuse(req)
            events += self._guarded(req.id, self._start, req)
        return events

    def _reuse(self, req: GenRequest) -> int:
        """Prefix tokens taken from the slot's cache; at least one token is always prefilled."""
        common = common_prefix(self.slots[req.slot].history, req.prompt)
        return min(common, len(req.prompt) - 1)

    def _start(self, req: GenRequest) -> list[Event]:
        reused = self._reuse(req)
        run = self._new_run(req)
        self.active[req.id] = run
        events: list[Event] = [Accepted(req.id, len(req.prompt), reused)]
        slot = self.slots[req.slot]
        del slot.history[reused:]
        fed = list(req.prompt[reused:])
        gates: list[TokenGates] = []
        if self.config.gates:
            logits, routes, gates = self._prefill_traced(req, fed, reused)
        else:
            logits, routes = self.runner.prefill(req.slot, fed, start=reused)
        self.forwards += 1
        slot.history.extend(fed)
        run.routes.append(routes)
        run.t_first = time.perf_counter()
        first = gates.pop() if gates else None  # the last prompt token's: the first token's
        return events + gates + self._repins() + self._advance(run, logits, first)

    def _prefill_traced(
        self, req: GenRequest, fed: list[int], start: int
    ) -> tuple[np.ndarray, np.ndarray, list[TokenGates]]:
        """`prefill` through the traced program: logits [V], routes [n_moe, T, K], and the
        gates of the last token fed (gates 1) or of every one (gates 2)."""
        logits, (routing,) = self.runner.prefill_traced([(req.slot, fed, start)])
        keep = 0 if self.config.gates > 1 else len(fed) - 1
        tail = type(routing)(*(np.asarray(a)[:, keep:] for a in routing))
        return logits[0], routing.ids, gates_of(req.id, start + keep, fed[keep:], tail)

    def _new_run(self, req: GenRequest) -> _Run:
        limit = self.runner.capacity - len(req.prompt)  # prompt + answer fit in the context
        limit = min(limit, req.max_tokens, self.config.ngen or req.max_tokens)
        return _Run(
            req=req,
            limit=limit,
            rng=np.random.default_rng([self.config.seed, req.id]),
            t_accept=time.perf_counter(),
            timers0=self.runner.timers.snapshot(),
            lookups0=(self.runner.stats.lookups, self.runner.stats.hits),
            forwards0=self.forwards,
        )

    # ------------------------------------------------------------------ decode

    def _launch(self) -> tuple[_Forward | None, list[Event]]:
        """Start one decode forward in which every active request feeds its pending token."""
        runs = list(self.active.values())
        rows = [self._row(r) for r in runs]
        steps, cut = self._burst(runs, [r.limit - r.chosen for r in runs])
        try:
            fwd = self.runner.decode_async(rows, steps=steps, cuttable=cut, **self._kw(steps))
            return (runs, fwd), []
        except Exception:
            log.exception("decode step failed; ending its %d requests", len(runs))
            return None, [ev for r in runs for ev in self._fail(r.req.id)]

    def _kw(self, steps: int) -> dict:
        """`decode_async`'s keywords beside rows and steps: the traced program with gates; a
        burst's program, that of `burst` steps, and the stop tokens that end it early."""
        if steps == 1:
            return self._trace
        return {**self._trace, "most": self.config.burst, "stops": self.config.stop_ids}

    def _row(self, run: _Run) -> Row:
        """The decode row of a run that feeds its pending token at the end of its slot."""
        return Row(run.req.slot, run.pending, len(self.slots[run.req.slot].history))

    def _chain(self) -> _Forward | None:
        """Start the next forward behind the one in flight, if every live request in it is
        greedy: those that will not reach their limit feed its greedy token one position
        further; requests admitted since feed their pending token."""
        if self.inflight is None or not self.runner.chains or self.waiting:
            return None  # waiting prompts are prefilled first, not behind a queued forward
        if self._too_slow_to_burst():
            return None  # the ~1 ms saved is little there; a frame then waits one step only
        runs, fwd = self.inflight
        if fwd.cuttable:
            return None  # its length is known when it lands
        live = [(i, r) for i, r in enumerate(runs) if self.active.get(r.req.id) is r]
        if not live or any(r.req.temperature > 0 for _, r in live):
            return None
        n = fwd.steps  # tokens each live request gets from the forward in flight
        rows, chained = [], []
        for i, r in live:
            if r.chosen + n < r.limit:  # the tokens it gets now leave it short of its limit
                rows.append(Row(r.req.slot, 0, len(self.slots[r.req.slot].history) + n, take=i))
                chained.append(r)
        running = {id(r) for r in runs}
        fresh = [r for r in self.active.values() if id(r) not in running]
        rows += [self._row(r) for r in fresh]
        if not rows:
            return None
        left = [r.limit - r.chosen - n for r in chained] + [r.limit - r.chosen for r in fresh]
        steps, cut = self._burst(chained + fresh, left)
        try:
            fwd = self.runner.decode_async(
                rows, after=fwd, steps=steps, cuttable=cut, **self._kw(steps)
            )
            return chained + fresh, fwd
        except Exception:
            log.exception("starting a chained decode step failed; it starts after this one")
            return None

    def _collect(self) -> tuple[list[Event], list[_Chosen | HitsTick]]:
        """Wait for the forward in flight and choose each of its requests' next token; requests
        that end are taken out of `active` (their reports are built later, by the caller). The
        HITS ticks of its steps come among the tokens chosen, each before the tokens of the
        step that made it, as single steps give them."""
        if self.inflight is None:
            return [], []
        runs, fwd = self.inflight
        self.inflight = None
        keep = [self.active.get(r.req.id) is r for r in runs]  # not ended since it started
        if not any(keep):
            return [], []  # every row was computed for nothing: no step, no statistics
        try:
            greedy = fwd.tokens()  # [steps, B]: what chained rows fed; sampled rows draw below
            masks = self._live_steps(runs, keep, greedy) if fwd.steps > 1 else [keep]
            logits, routes = fwd.result(keep if fwd.steps == 1 else masks)
            ranked = by_weight(fwd.routing()) if self.config.gates else None
        except Exception:
            live = [r for r, k in zip(runs, keep, strict=True) if k]
            log.exception("decode step failed; ending its %d requests", len(live))
            return [ev for r in live for ev in self._fail(r.req.id)], []
        if fwd.steps == 1:
            routes = routes[None]  # [steps, n_moe, B, K]
        self._time(fwd)
        events = self._repins()
        chosen: list[_Chosen | HitsTick] = []
        active, slots, greedy = self.active, self.slots, greedy.tolist()
        taken = 0  # steps of this forward whose experts a HITS tick took
        for s, live in enumerate(masks):
            if not any(live):
                break  # the rest of a burst whose requests all ended: no decode step
            self.steps += 1
            first = len(chosen)
            self.forwards += 1
            for i, run in enumerate(runs):
                if not live[i] or active.get(run.req.id) is not run:  # (failed meanwhile)
                    continue
                history = slots[run.req.slot].history
                gates = None
                if ranked is not None:  # (no bursts: s == 0) the input's position and token
                    row = (a[:, i] for a in ranked)
                    gates = TokenGates(run.req.id, len(history), run.pending, *row)
                history.append(run.pending)
                run.routes.append(routes[s, :, i : i + 1])  # a view, counted at the turn's end
                try:
                    temp = run.req.temperature
                    tok = greedy[s][i] if temp <= 0 else self._sample(run, logits[i])
                except Exception:
                    log.exception("request %d failed", run.req.id)
                    events += self._fail(run.req.id)
                    continue
                chosen.append((run, tok, None if logits is None else logits[i], gates))
                self._choose(run, tok)
            if self.steps % self.config.hits_every == 0:
                chosen.insert(first, HitsTick(self.runner.stats.take_hits(s + 1 - taken)))
                taken = s + 1
        return events, chosen

    @property
    def step_s(self) -> float | None:
        """Seconds a decode step takes lately: the median of the last 8 forwards' (one that
        compiled a new shape is an outlier), None before the first."""
        if not self._periods:
            return None
        return statistics.median(self._periods)  # (numpy's costs ~40 us a call here)

    def _time(self, fwd: InFlightLike) -> None:
        """Note the seconds per step of a forward that just landed: from its start, or from
        the previous landing if it was queued behind that one."""
        now = time.perf_counter()
        self._periods.append((now - max(fwd.t_start, self._landed)) / fwd.ran())
        self._landed = now

    def _burst(self, runs: list[_Run], left: list[int]) -> tuple[int, bool]:
        """(steps, cuttable) of the next forward over `runs`, which have `left` tokens to go:
        a burst when every request decodes greedily on resident experts, no prompt waits and no
        TOPK or gates are asked for: up to `burst` steps, no more than any request has left,
        nor than the recent steps say would hold its tokens back longer than `stream_ms`. A
        burst due to end within `burst_ms` (`full_burst_ms` while every slot is taken) runs
        whole and can be chained behind; a longer one is cuttable (with `cut_bursts`, where the
        runner `cuts`): the input thread cuts it after the step in which a frame comes in, so
        that frame waits no longer than for single steps; where it cannot be, the burst is as
        long as fits in `burst_ms`. Steps slower than half `stream_ms` run one a forward, not
        chained (`_chain`), so that each token is written as it is chosen and a frame waits for
        one step at most (bursts and chaining save the host ~1 ms a forward, little beside
        steps that slow). Otherwise, and before any step has landed, 1. Bursts of every length
        share one program, of `burst` steps."""
        cfg = self.config
        n = min(cfg.burst, min(left, default=0))
        if n < 2 or not self.runner.chains or self.waiting or cfg.topk or cfg.gates:
            return 1, False
        if any(r.req.temperature > 0 for r in runs) or self.step_s is None:
            return 1, False  # (no step has landed yet: how long a burst takes is unknown)
        n = min(n, self._steps_in(cfg.stream_ms))  # tokens held back at most stream_ms
        if n < 2:
            return 1, False
        full = all(slot.owner is not None for slot in self.slots)
        whole = self._steps_in(cfg.full_burst_ms if full else cfg.burst_ms)
        if n <= whole:
            return n, False
        if cfg.cut_bursts and self.runner.cuts:
            return n, True
        return (whole, False) if whole >= 2 else (1, False)  # (whole < n here)

    def _steps_in(self, ms: float) -> int:
        """Steps the recent ones say fit in `ms` (`step_s` known)."""
        return int(ms / 1e3 / max(self.step_s, 1e-9))

    def _too_slow_to_burst(self) -> bool:
        """Whether the recent steps say even a burst of two would hold its tokens back longer
        than `stream_ms`."""
        return self.step_s is not None and self._steps_in(self.config.stream_ms) < 2

    def _live_steps(self, runs: list[_Run], keep: list[bool], tokens: np.ndarray):
        """Which rows of a burst still matter at each of its steps: those kept, up to and
        including the step whose token ends their request (a stop token or the last)."""
        stop = self.config.stop_ids
        live, out = list(keep), []
        for s, toks in enumerate(tokens.tolist()):  # as _ends(run, tok, ahead=s), inlined
            out.append(list(live))
            for i, run in enumerate(runs):
                if live[i] and (toks[i] in stop or run.chosen + s + 1 >= run.limit):
                    live[i] = False
        return out

    def _report_decoded(self, events: list[Event], chosen: list[_Chosen | HitsTick]) -> list[Event]:
        for item in chosen:
            if isinstance(item, HitsTick):
                events.append(item)
                continue
            run, tok, logits, gates = item
            events += self._guarded(run.req.id, self._report, run, tok, logits, gates)
        return events

    def _sample(self, run: _Run, logits: np.ndarray) -> int:
        return sample(logits, run.req.temperature, run.req.top_p, run.rng)

    def _advance(
        self, run: _Run, logits: np.ndarray, gates: TokenGates | None = None
    ) -> list[Event]:
        """Sample the next token from logits [V]: emit it (with the gates of the forward that
        gave the logits, if any), or end the turn."""
        tok = self._sample(run, logits)
        self._choose(run, tok)
        return self._report(run, tok, logits, gates)

    def _ends(self, run: _Run, tok: int, ahead: int = 0) -> bool:
        """Whether `tok`, chosen `ahead` tokens after the run's last choice, ends its turn."""
        return tok in self.config.stop_ids or run.chosen + ahead + 1 >= run.limit

    def _choose(self, run: _Run, tok: int) -> None:
        """Take `tok` as the run's next token: it is fed next, or the run ends (out of
        `active`, so that the next forward leaves it out)."""
        ends = self._ends(run, tok)
        run.chosen += 1
        run.pending = None if ends else tok
        if ends:
            self.active.pop(run.req.id)

    def _report(
        self, run: _Run, tok: int, logits: np.ndarray | None, gates: TokenGates | None = None
    ) -> list[Event]:
        """The events of a chosen token: the token itself, then DONE if the turn ended."""
        if tok in self.config.stop_ids:
            return self._finish(run, limited=False)
        req = run.req
        text = self.token_bytes(tok)
        events: list[Event] = [Token(req.id, tok, text, self._topk(logits), gates)]
        run.emitted += 1
        if run.emitted >= run.limit:
            return events + self._finish(run, limited=True)
        return events

    def _topk(self, logits: np.ndarray | None) -> tuple[tuple[float, bytes], ...]:
        if self.config.topk == 0 or logits is None:  # bursts (no logits) only without TOPK
            return ()
        k = min(self.config.topk, logits.shape[-1])
        lp = log_softmax(logits)
        best = np.argpartition(-lp, k - 1)[:k]
        best = best[np.lexsort((best, -lp[best]))]  # descending, ties by token id
        return tuple((float(lp[t]), self.token_bytes(int(t))) for t in best)

    def _counts(self, run: _Run) -> np.ndarray:
        """[n_moe, E] expert selections over the run's prefill and decode rows."""
        stats = self.runner.stats
        counts = np.zeros((stats.rows, stats.cols), np.int64)
        if run.routes:
            routes = np.concatenate(run.routes, axis=1)  # [n_moe, T, K]
            for layer, ids in enumerate(routes):
                counts[layer] = np.bincount(ids.reshape(-1), minlength=stats.cols)[: stats.cols]
        return counts

    def _repins(self) -> list[Event]:
        return list(self.runner.stats.take_repins())

    # ------------------------------------------------------------------ ends of turns

    def _finish(self, run: _Run, limited: bool) -> list[Event]:
        self._close(run)
        now = time.perf_counter()
        stats = self.runner.stats
        after = self.runner.timers.snapshot()
        decode_s = now - run.t_first
        report = TurnReport(
            emitted=run.emitted,
            tok_s=(run.emitted - 1) / decode_s if run.emitted > 1 and decode_s > 0 else 0.0,
            hit_pct=stats.hit_pct(since=run.lookups0),
            prompt_tokens=len(run.req.prompt),
            length_limited=limited,
            dt=now - run.t_accept,
            phases={k: after[k] - run.timers0.get(k, 0.0) for k in after},
            entropy=entropy_bits(self._counts(run)),
            tiers=stats.tier_counts(),
            emap=stats.emap(),
            hits=stats.take_hits(),
            forwards=self.forwards - run.forwards0,
        )
        return [Finished(run.req.id, report), *self._take_advisories()]

    def _unstarted_report(self, req: GenRequest) -> TurnReport:
        stats = self.runner.stats
        return TurnReport(
            emitted=0,
            tok_s=0.0,
            hit_pct=stats.hit_pct(),
            prompt_tokens=len(req.prompt),
            length_limited=False,
            dt=0.0,
            phases=dict.fromkeys(self.runner.timers.snapshot(), 0.0),
            entropy=(0.0,) * stats.rows,
            tiers=stats.tier_counts(),
            emap=stats.emap(),
            hits=stats.take_hits(),
        )

    def _close(self, run: _Run) -> None:
        """Release the run's slot at a turn end: persist its KV and the usage counts."""
        slot_id = run.req.slot
        self.slots[slot_id].owner = None
        self._persist(slot_id)
        end_turn = getattr(self.runner, "end_turn", None)
        if end_turn is not None:
            self._write_state("the expert usage file", end_turn)

    def _persist(self, slot_id: int) -> None:
        if self.kv_store is None:
            return
        export = partial(self.runner.export_slot, slot_id)  # n -> its first n positions
        sync = partial(self.kv_store.sync, slot_id, self.slots[slot_id].history, export)
        self._write_state(f"KV slot {slot_id}", sync)

    def _write_state(self, what: str, write: Callable[[], None]) -> None:
        """One state write (KV, usage). A failing disk (full, read-only) is reported once a
        session, in the log and as an advisory `ERROR 0 STATE_WRITE <errno>`; the last good
        file stays, and the write is tried again at every turn end."""
        try:
            write()
        except OSError as e:
            if self._state_failed:
                log.debug("writing %s failed again: %s", what, e)
                return
            self._state_failed = True
            log.warning("writing %s failed: %s (the last good file is kept; retried)", what, e)
            code = errno.errorcode.get(e.errno or 0, "EIO")
            self._advisories.append(Failed(0, STATE_WRITE, (code,)))
        except Exception:
            log.exception("writing %s failed", what)

    def _take_advisories(self) -> list[Event]:
        out, self._advisories = self._advisories, []
        return out

    def _fail(self, rid: int) -> list[Event]:
        """End a request on an internal error; its slot's cache is no longer trusted."""
        run = self.active.pop(rid, None)
        for i, slot in enumerate(self.slots):
            if slot.owner == rid:
                slot.history.clear()
                slot.owner = None
                self._persist(i)
        if run is not None:
            self._close(run)
        return [Failed(rid, INTERNAL), *self._take_advisories()]

    def _guarded(self, rid: int, fn: Callable[..., list[Event]], *args) -> list[Event]:
        """fn(*args); an unexpected exception ends request `rid` instead of the engine."""
        try:
            return fn(*args)
        except Exception:
            log.exception("request %d failed", rid)
            return self._fail(rid)

    def _drop_waiting(self, rid: int) -> bool:
        for req in self.waiting:
            if req.id == rid:
                self.waiting.remove(req)
                self.slots[req.slot].owner = None
                return True
        return False

    def _restore_slot(self, i: int, slot: _Slot) -> int:
        assert self.kv_store is not None
        try:
            kv = self.kv_store.load(i)
            if kv is None or not kv.tokens:
                return 0
            if len(kv.tokens) > self.runner.capacity:
                log.warning("KV slot %d holds %d positions > CTX; ignored", i, len(kv.tokens))
                return 0
            self.runner.import_slot(i, kv.arrays)
        except Exception:
            log.exception("restoring KV slot %d failed; it starts empty", i)
            return 0
        slot.history = list(kv.tokens)
        return len(kv.tokens)
