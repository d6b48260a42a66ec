"""KV slots and the two kinds of step over them: chunked prefill of one slot, batched decode."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from colibri import kernels
from colibri.engine import steps
from colibri.engine.model import LoadedModel
from colibri.engine.sampling import greedy_ids
from colibri.engine.telemetry import Timers
from colibri.model import attention, layers, parallel, transformer

PREFILL_CHUNK = 256  # longest prefill step; longer prompts go through in chunks
_MIN_BUCKET = 8
# The layer-by-layer path's router when tracing (`Runner.prefill_traced`).
_route_traced = jax.jit(transformer.moe_route_traced, static_argnums=(0,))


def bucket(n: int, lo: int = _MIN_BUCKET, hi: int | None = None) -> int:
    """Smallest power of two >= n (at least lo, at most hi): the shapes we compile for."""
    b = lo
    while b < n:
        b *= 2
    return b if hi is None else min(b, hi)


@dataclass(frozen=True)
class Row:
    """One decode row: the slot it extends, the token it feeds, and that token's position.

    With `take` >= 0 the row feeds instead the greedy token of row `take` of the forward it
    is chained to (see `Runner.decode_async`), a token the host has not seen yet."""

    slot: int
    token: int
    pos: int
    take: int = -1


def _feed(weights_def, weights, rows, fed):
    """What both decode programs start from: (params, experts) from their leaves, and each
    row's token (its own, or fed[take] where take >= 0), position and slot."""
    params, experts = jax.tree.unflatten(weights_def, weights)
    tokens, pos, slots, take = rows
    return params, experts, jnp.where(take >= 0, fed[jnp.maximum(take, 0)], tokens), pos, slots


def _greedy_step(cfg, params, experts, cache, toks, pos, slots, kv_len, rope=None, trace=False):
    """One token per row: logits, cache, routes (a `transformer.Routing` where `trace`) and
    the rows' greedy tokens."""
    logits, cache, routes = transformer.forward(
        cfg,
        params,
        experts,
        cache,
        toks[:, None],
        pos[:, None],
        slots,
        jnp.zeros_like(slots),
        kv_len=kv_len,
        rope=rope,
        trace=trace,
    )
    return logits, cache, routes, greedy_ids(logits)


def _padded(fed, greedy):
    """Greedy tokens padded to the length of `fed`: what a forward chained behind feeds."""
    return jnp.zeros_like(fed).at[: greedy.shape[0]].set(greedy)


@partial(jax.jit, static_argnums=(0, 1), static_argnames=("kv_len",), donate_argnums=(3,))
def _decode_forward(cfg, weights_def, weights, cache, rows, fed, *, kv_len):
    """`transformer.forward` of one token per row. weights: the leaves of (params, experts)
    (a flat list crosses jit's argument handling faster than the nested dicts); rows [4, B]
    int32: token, position, slot and take of each row, one transfer. A row feeds its token,
    or fed[take] where take >= 0 (the previous forward's greedy tokens, which never leave
    the device). Also returns the rows' greedy tokens, padded to the length of `fed`."""
    params, experts, toks, pos, slots = _feed(weights_def, weights, rows, fed)
    logits, cache, routes, greedy = _greedy_step(
        cfg, params, experts, cache, toks, pos, slots, kv_len
    )
    return logits, cache, routes, _padded(fed, greedy)


@partial(jax.jit, static_argnums=(0, 1), static_argnames=("kv_len",), donate_argnums=(3,))
def _decode_traced(cfg, weights_def, weights, cache, rows, fed, *, kv_len):
    """`_decode_forward` through `forward(trace=True)` (SERVE_GATES), a program of its own:
    its routing is a `transformer.Routing` (ids, gate weights, the router's entropy and
    margin), the rest as `_decode_forward` returns it."""
    params, experts, toks, pos, slots = _feed(weights_def, weights, rows, fed)
    logits, cache, routing, greedy = _greedy_step(
        cfg, params, experts, cache, toks, pos, slots, kv_len, trace=True
    )
    return logits, cache, routing, _padded(fed, greedy)


@partial(
    jax.jit,
    static_argnums=(0, 1),
    static_argnames=("kv_len", "steps", "cuttable"),
    donate_argnums=(3,),
)
def _decode_burst(
    cfg, weights_def, weights, cache, rows, fed, run, stops, *, kv_len, steps, cuttable=False
):
    """Up to `run[0]` greedy decode steps in one program (an operand: one program, compiled
    for `steps`, runs any number up to it): as `_decode_forward`, then each row feeds its own
    greedy token one position further. The burst ends early once each of the first `run[1]`
    rows (the real ones) has chosen one of `stops` (token ids, -1 for none): the steps after
    would be computed for nothing. Returns routes [steps, n_moe, B, 1, K], the greedy tokens
    of every step [steps, B] (the rows after the steps run are zeros), those of the last step
    padded to the length of `fed`, and the number of steps run.

    `cuttable`: before each step after the first the burst reads the host's cut flag
    (`kernels.request_cut`) and ends there if it is raised; the steps it ran are exactly those
    of the full burst."""
    params, experts, toks, pos, slots = _feed(weights_def, weights, rows, fed)
    # Every step's cos and sin before the loop: inside it XLA would compute them again in
    # each layer's q and k fusions. A step's own come in the loop's carry: sliced from the
    # table inside those fusions, each fusion took 13-15 µs at 16 rows, against ~2 µs over a
    # plain operand (docs/kernels.md, "The step around the calls at 16 rows").
    at = pos[None] + jnp.arange(steps, dtype=pos.dtype)[:, None]
    cos, sin = layers.rope_cos_sin(cfg.rope, at[..., None])  # [steps, B, 1, R/2]

    def step(cache, toks, pos, rope):
        _, cache, routes, greedy = _greedy_step(
            cfg, params, experts, cache, toks, pos, slots, kv_len, rope
        )
        return cache, routes, greedy

    def more(carry):
        i, going = carry[0], carry[-1]
        go = (i < run[0]) & going.any()
        if not cuttable:
            return go
        return go & ((i == 0) | ~kernels.cut_requested(i))

    def body(carry):
        i, cache, toks, pos, routes, tokens, rope, going = carry
        cache, r, greedy = step(cache, toks, pos, rope)
        going &= ~(greedy[:, None] == stops[None]).any(axis=1)
        routes, tokens = routes.at[i].set(r), tokens.at[i].set(greedy)
        after = jnp.minimum(i + 1, steps - 1)
        return i + 1, cache, greedy, pos + 1, routes, tokens, (cos[after], sin[after]), going

    rope = (cos[0], sin[0])
    shape = jax.eval_shape(step, cache, toks, pos, rope)[1]  # one step's routes
    routes = jnp.zeros((steps, *shape.shape), shape.dtype)
    tokens = jnp.zeros((steps, toks.shape[0]), jnp.int32)
    going = jnp.arange(toks.shape[0]) < run[1]
    done, cache, greedy, _, routes, tokens, _, _ = jax.lax.while_loop(
        more, body, (jnp.int32(0), cache, toks, pos, routes, tokens, rope, going)
    )
    return cache, routes, tokens, _padded(fed, greedy), done


class InFlight:
    """A decode forward that has been started, of one step or a burst of up to `steps` greedy
    steps. `result()` waits for it (once) and returns logits [B, V] and routes
    [n_moe, B, K], as `Runner.decode` does, or for a burst None and routes
    [ran, n_moe, B, K]; `tokens()` its rows' greedy tokens at every step [ran, B] (the
    argmax of their logits, lowest id on ties). `ran()`: the steps it ran, `steps` unless a
    cuttable burst was cut short or every row of a burst chose a stop token before its end.
    A traced step (`traced`: its `transformer.Routing`) also has `routing()`."""

    def __init__(
        self,
        runner: Runner,
        batch: _Batch,
        out: tuple,
        greedy: jax.Array,
        steps: int = 1,
        ran: jax.Array | None = None,
        cuttable: bool = False,
        traced: transformer.Routing | None = None,
    ):
        self._runner, self._batch, self._out = runner, batch, out
        self.steps = steps
        self.cuttable = cuttable
        self._ran = steps if ran is None else ran  # (an int once known)
        self.t_start = time.perf_counter()  # when it was started (queued, if chained)
        self.greedy_dev = greedy  # [Bmax] on the device, the last step's: what chained rows feed
        self._value: tuple[np.ndarray | None, np.ndarray] | None = None
        self._traced = traced

    def ran(self) -> int:
        """Steps the forward ran (waits for a cuttable burst to end)."""
        if not isinstance(self._ran, int):
            self._ran = int(self._ran)
        return self._ran

    def result(self, keep: Sequence | None = None) -> tuple[np.ndarray | None, np.ndarray]:
        """`keep` (heeded on the first call): the rows that still matter [B], or for a burst
        the (step, row) pairs [ran, B]; the others (a request that ended before) stay out
        of the expert statistics."""
        if self._value is None:
            if self.steps == 1:
                logits, routes = self._runner._land(self._batch, self._out, keep)
                self._runner._count_decoded(self._batch.rows if keep is None else sum(keep))
                self._value = logits, routes[:, :, 0]
            else:
                routes = self._runner._land_burst(self._batch, self._out[0], keep, self.ran())
                self._value = None, routes
        return self._value

    def tokens(self) -> np.ndarray:
        """The rows' greedy tokens at every step [ran, B] (waits for them, not for the
        statistics: `result` records those)."""
        if self.steps == 1:
            return np.asarray(self.greedy_dev)[None, : self._batch.rows]
        return np.asarray(self._out[1])[: self.ran(), : self._batch.rows]

    def greedy(self) -> np.ndarray:
        """The rows' greedy tokens at the last step [B]."""
        return self.tokens()[-1]

    def routing(self) -> transformer.Routing:
        """A traced step's routing of its real rows, as host arrays: ids and gate weights
        [n_moe, B, K], the router's entropy and margin [n_moe, B] (waits for it)."""
        if self._traced is None:
            raise ValueError("not a traced forward: decode_async(..., trace=True) makes one")
        rows = self._batch.rows
        return transformer.Routing(*(np.asarray(a)[:, :rows, 0] for a in self._traced))


def _host_routing(ids: np.ndarray, traced: list, shape: tuple[int, int]) -> transformer.Routing:
    """A host `Routing` from the layer-by-layer path: ids [n_moe, rows, width, K] and each
    MoE layer's (weights [rows, width, K], entropy and margin [rows, width, 1])."""
    if not traced:
        empty = np.zeros((0, *shape), np.float32)
        return transformer.Routing(ids, np.zeros(ids.shape, np.float32), empty, empty)
    wts, ent, margin = (np.stack([e[j] for e in traced]).astype(np.float32) for j in range(3))
    return transformer.Routing(ids, wts, ent[..., 0], margin[..., 0])


def _stop_ids(stops: Sequence[int]) -> np.ndarray:
    """A burst's stop tokens as its operand: int32, -1 (no token) after them, 8 wide (more in
    multiples of 8), so that one program serves them all."""
    out = np.full(-(-max(len(stops), 1) // 8) * 8, -1, np.int32)
    out[: len(stops)] = stops
    return out


@dataclass(frozen=True)
class _Batch:
    """Padded inputs of one forward and which part of them is real."""

    tokens: np.ndarray  # [B, T] int32
    pos: np.ndarray  # [B, T] int32
    slots: np.ndarray  # [B] int32; padding rows name slot S (writes dropped)
    last: np.ndarray  # [B] int32: index of each row's last real token
    rows: int  # real rows
    width: int  # real tokens per row
    kv_len: int
    lens: tuple[int, ...] | None = None  # real tokens of each row, where rows differ


@partial(jax.jit, static_argnames=("size",))
def _export_positions(cache, slot, *, size):
    """The first `size` positions of `slot` in every layer, position first."""
    return [attention.export_positions(layer, slot, size) for layer in cache]


@partial(jax.jit, donate_argnums=(0,))
def _import_positions(cache, slot, layers):
    """`cache` with the first positions of `slot` in every layer set from `layers` (as
    `export_positions` gives them), in place: the cache is donated."""
    return [
        attention.import_positions(layer, slot, data)
        for layer, data in zip(cache, layers, strict=True)
    ]


class Runner:
    """A model with a KV cache of `slots` conversations of up to `capacity` positions each.

    With every expert resident a forward is one compiled program. Otherwise (or with
    `profile`) it runs layer by layer: route, stage the union of chosen experts through the
    store, compute from device slots; phase timers are then measured per layer.
    """

    def __init__(
        self, model: LoadedModel, slots: int = 1, capacity: int = 2048, profile: bool = False
    ):
        self.model = model
        self.cfg = model.cfg
        self.store = model.store
        self.slots = slots
        self.capacity = capacity
        self.cache = transformer.init_cache(self.cfg, slots, capacity)
        if parallel.mesh() is not None:  # on every device, beside the replicated weights
            self.cache = parallel.replicated(self.cache)
        self.stats = self.store.stats
        self.timers = Timers()
        self.split = profile or not self.store.all_resident
        self.decoded = 0
        self._next_repin = self.store.tiers.repin
        self._no_tokens = jnp.zeros((bucket(slots, lo=1),), jnp.int32)  # unchained decode
        # (params, resident experts) as the decode forward takes them, flattened once
        self._weights, self._weights_def = jax.tree.flatten((model.params, self.store.resident))
        # A decode step attends through the CPU kernel where it can (`attention.gqa`), over
        # each slot's cache in place: what it reads does not depend on kv_len, so one program
        # serves every context length instead of one per kv bucket (~10 MB of RSS each).
        leaves = jax.tree.leaves(self.cache)
        self._decode_kv_free = self.cfg.attention != "mla" and kernels.usable(*leaves)

    # -- public steps --------------------------------------------------------------------

    def prefill(
        self, slot: int, tokens: list[int], start: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Feed tokens at positions start.. into `slot`; logits [V] after the last one, routes."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if start + len(tokens) > self.capacity:
            raise ValueError(
                f"{start + len(tokens)} positions exceed the context of {self.capacity}"
            )
        logits, routes = None, []
        for at in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[at : at + PREFILL_CHUNK]
            T = bucket(len(chunk), hi=PREFILL_CHUNK)
            toks = np.zeros((1, T), np.int32)
            toks[0, : len(chunk)] = chunk
            batch = _Batch(
                toks,
                (start + at + np.arange(T, dtype=np.int32))[None],
                np.asarray([slot], np.int32),
                np.asarray([len(chunk) - 1], np.int32),
                rows=1,
                width=len(chunk),
                kv_len=self._kv_len(start + at + len(chunk) - 1),
            )
            out, r = self._forward(batch)
            logits = out[0]
            routes.append(r[:, 0])  # [n_moe, T_real, K]
        return logits, np.concatenate(routes, axis=1)

    def prefill_traced(
        self, feeds: Sequence[tuple[int, Sequence[int], int]]
    ) -> tuple[np.ndarray, list[transformer.Routing]]:
        """Feed several slots at once, for analysis: each feed (slot, tokens, start) puts its
        tokens at positions start.. of its slot; the feeds are the rows of one forward per
        chunk of up to PREFILL_CHUNK positions (a chunk of single tokens is a decode-shaped
        forward). Returns logits [n, V] after each feed's last token and each feed's routing
        as host arrays (`transformer.Routing`: ids and gate weights [n_moe, T, K], the
        router's entropy and margin [n_moe, T]). Its own program (`forward(trace=True)`, or
        the traced router layer by layer): `prefill` and `decode` are untouched. The
        selections of real tokens are counted in the statistics, as prefill's are."""
        if not feeds:
            raise ValueError("prefill_traced needs at least one feed")
        if len({f[0] for f in feeds}) != len(feeds):
            raise ValueError("each slot can be fed once per call")
        for slot, toks, start in feeds:
            if not 0 <= slot < self.slots:
                raise IndexError(f"slot {slot} is not one of the {self.slots} KV slots")
            if not len(toks):
                raise ValueError("every feed needs at least one token")
            if start + len(toks) > self.capacity:
                raise ValueError(
                    f"{start + len(toks)} positions exceed the context of {self.capacity}"
                )
        logits: list = [None] * len(feeds)
        parts: list[list] = [[] for _ in feeds]
        for at in range(0, max(len(f[1]) for f in feeds), PREFILL_CHUNK):
            live = [i for i, f in enumerate(feeds) if len(f[1]) > at]
            lens = [min(len(feeds[i][1]) - at, PREFILL_CHUNK) for i in live]
            width = max(lens)
            T = 1 if width == 1 else bucket(width, hi=PREFILL_CHUNK)
            B = bucket(len(live), lo=1)
            toks, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
            slots = np.full(B, self.slots, np.int32)  # padding rows: out of range, dropped
            last = np.zeros(B, np.int32)
            for r, (i, n) in enumerate(zip(live, lens, strict=True)):
                slot, chunk, start = feeds[i][0], feeds[i][1][at : at + n], feeds[i][2]
                toks[r, :n] = chunk
                pos[r] = start + at + np.arange(T, dtype=np.int32)
                slots[r], last[r] = slot, n - 1
            ends = [feeds[i][2] + at + n - 1 for i, n in zip(live, lens, strict=True)]
            batch = _Batch(
                toks, pos, slots, last, len(live), width, self._kv_len(max(ends)), tuple(lens)
            )
            out, routing = self._forward_traced(batch)
            for r, (i, n) in enumerate(zip(live, lens, strict=True)):
                parts[i].append([a[:, r, :n] for a in routing])
                if at + n == len(feeds[i][1]):
                    logits[i] = out[r]
        routings = [
            transformer.Routing(*(np.concatenate(a, axis=1) for a in zip(*p, strict=True)))
            for p in parts
        ]
        return np.stack(logits), routings

    def decode(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray]:
        """One token for each row, all in one forward: logits [B, V], routes [n_moe, B, K]."""
        return self.decode_async(rows).result()

    def decode_async(
        self,
        rows: list[Row],
        after: InFlight | None = None,
        steps: int = 1,
        cuttable=False,
        trace: bool = False,
        most: int = 0,
        stops: Sequence[int] = (),
    ) -> InFlight:
        """Start the forward of `decode(rows)` and return at once; `result()` waits for it.

        Rows with `take` >= 0 feed the greedy token of row `take` of `after` (its last step),
        an earlier forward that may still be running: where experts are resident the new
        forward is queued behind it without the host waiting for either (`chains`);
        otherwise the host waits for `after` and feeds its tokens itself.

        steps > 1 (resident experts only): a burst of greedy steps in one program, row by
        row as `steps` chained forwards would compute them (their tokens from `tokens()`);
        the host dispatches once and its thread is free meanwhile. `cuttable` (where
        `cuts`): the burst ends after the step in which `kernels.request_cut(True)` is called
        (at least one step runs); nothing can be chained behind it, as its length is known
        only when it lands. `most`: the program runs bursts of up to that many steps (default
        `steps`), so that bursts of every length up to it share one (`warmup(steps=most)`).
        `stops`: token ids that end a request; a burst ends once every row has chosen one
        (`ran()` then says how many steps it ran, whole or cuttable).

        `trace` (one step): the traced program (`forward(trace=True)`, or the traced router
        layer by layer), whose `InFlight.routing()` gives the gate weights and the router's
        entropy and margin too; the untraced programs are not touched."""
        if trace and steps > 1:
            raise ValueError("a traced forward is one decode step")
        if steps > 1 and not self.chains:
            raise ValueError("bursts of decode steps need every expert resident and no profile")
        if cuttable and not self.cuts:
            raise ValueError("cuttable bursts need the CPU kernels")
        if after is not None and after.cuttable:
            raise ValueError("nothing can be chained behind a cuttable burst: wait for it")
        B = bucket(len(rows), lo=1)
        packed = np.zeros((4, B), np.int32)  # token, position, slot, take
        packed[2], packed[3] = self.slots, -1  # padding rows: out-of-range slot, dropped
        for i, r in enumerate(rows):
            packed[:, i] = r.token, r.pos, r.slot, r.take
        toks, pos, slots, take = packed
        chained = any(r.take >= 0 for r in rows)
        if chained and after is None:
            raise ValueError("rows take tokens from an earlier forward, but none was given")
        if chained and self.split:
            picked = take >= 0
            toks[picked] = after.greedy()[take[picked]]
        last = max(r.pos for r in rows) + steps - 1
        if last >= self.capacity:
            raise ValueError(f"position {last} is outside the context of {self.capacity}")
        batch = _Batch(
            toks[:, None],
            pos[:, None],
            slots,
            np.zeros((B,), np.int32),
            rows=len(rows),
            width=1,
            kv_len=self.capacity if self._decode_kv_free else self._kv_len(last),
        )
        if self.split:
            logits, routes = self._forward_split(batch, all_logits=False, trace=trace)
            traced, routes = (routes, routes.ids) if trace else (None, routes)
            return InFlight(self, batch, (logits, routes), greedy_ids(logits), traced=traced)
        fed = after.greedy_dev if chained else self._no_tokens
        args = (self.cfg, self._weights_def, self._weights, self.cache, packed, fed)
        if trace:
            logits, self.cache, routing, greedy = _decode_traced(*args, kv_len=batch.kv_len)
            return InFlight(self, batch, (logits, routing.ids), greedy, traced=routing)
        if steps > 1:
            run = (np.asarray([steps, len(rows)], np.int32), _stop_ids(stops))
            self.cache, r, tokens, greedy, ran = _decode_burst(
                *args, *run, kv_len=batch.kv_len, steps=max(steps, most), cuttable=cuttable
            )
            return InFlight(self, batch, (r, tokens), greedy, steps, ran, cuttable)
        logits, self.cache, r, greedy = _decode_forward(*args, kv_len=batch.kv_len)
        return InFlight(self, batch, (logits, r), greedy)

    @property
    def chains(self) -> bool:
        """Whether a chained forward starts without waiting for the one it feeds from."""
        return not self.split

    @property
    def cuts(self) -> bool:
        """Whether decode bursts can be cuttable (`decode_async(..., cuttable=True)`)."""
        return self.chains and jax.default_backend() == "cpu" and kernels.available()

    def full_logits(self, tokens: list[int]) -> np.ndarray:
        """Logits [T, V] at every position of `tokens`, fed from position 0 into slot 0."""
        T = bucket(len(tokens))
        toks = np.zeros((1, T), np.int32)
        toks[0, : len(tokens)] = tokens
        batch = _Batch(
            toks,
            np.arange(T, dtype=np.int32)[None],
            np.zeros(1, np.int32),
            np.zeros(1, np.int32),
            rows=1,
            width=len(tokens),
            kv_len=min(T, self.capacity),
        )
        logits, _ = self._forward(batch, all_logits=True)
        return logits[0, : len(tokens)]

    def end_turn(self) -> None:
        """Persist `.coli_usage` (called at every turn end)."""
        self.store.save_usage()

    # -- warm-up -------------------------------------------------------------------------

    def warmup(self, steps: int = 1, export: bool = False) -> Iterator[str]:
        """Compile every program traffic can reach, one each `next()` (which yields its name):
        prefill chunks of every width bucket with every context bucket they can meet, decode
        steps of every row bucket (and context bucket, where decode reads them), bursts of up
        to `steps` (cuttable ones too, where `cuts`) and, with `export`, KVSAVE's export sizes.
        Each runs once, as `prefill` and `decode_async` call it, on padding rows: their slot is
        out of range, so the cache is unchanged and no statistic counts them. Compiled as
        traffic first reaches them instead, each would add its few MB of resident memory then
        (and stall the steps behind it). Only where every expert is resident and there is no
        profile: the layer-by-layer path is left to compile as it goes."""
        if self.split:
            return
        kvs = self.kv_buckets(self.capacity)
        S, top = self.slots, bucket(min(self.capacity, PREFILL_CHUNK), hi=PREFILL_CHUNK)
        T = _MIN_BUCKET
        while T <= top:  # a chunk of T columns holds more than T/2 tokens (or at least one)
            least = self._kv_len(T // 2 if T > _MIN_BUCKET else 0)
            for kv in (kv for kv in kvs if kv >= least):
                toks, last = np.zeros((1, T), np.int32), np.zeros((1,), np.int32)
                pos = np.arange(T, dtype=np.int32)[None]
                _, self.cache, _ = transformer.forward(
                    self.cfg,
                    self.model.params,
                    self.store.resident,
                    self.cache,
                    toks,
                    pos,
                    np.asarray([S], np.int32),
                    last,
                    kv_len=kv,
                    all_logits=False,
                )
                yield f"prefill {T} x {kv}"
            T *= 2
        bursts = [False, True] if steps > 1 and self.cuts else [False] if steps > 1 else []
        idle = (np.asarray([steps, 0], np.int32), _stop_ids(()))  # no real row: no step runs
        for B in sorted({bucket(n, lo=1) for n in range(1, S + 1)}):
            packed = np.zeros((4, B), np.int32)
            packed[2], packed[3] = S, -1
            args = (self.cfg, self._weights_def, self._weights)
            for kv in [self.capacity] if self._decode_kv_free else kvs:
                out = _decode_forward(*args, self.cache, packed, self._no_tokens, kv_len=kv)
                self.cache = out[1]
                yield f"decode {B} x {kv}"
                for cut in bursts:
                    self.cache, *_ = _decode_burst(
                        *args,
                        self.cache,
                        packed,
                        out[3],
                        *idle,
                        kv_len=kv,
                        steps=steps,
                        cuttable=cut,
                    )
                    yield f"burst {B} x {kv} x {steps}{' cuttable' if cut else ''}"
        for size in kvs if export else []:
            _export_positions(self.cache, 0, size=size)
            yield f"export {size}"

    @staticmethod
    def kv_buckets(capacity: int) -> list[int]:
        """Every `kv_bucket` of a context of `capacity` positions, smallest first."""
        out = [Runner.kv_bucket(0, capacity)]
        while out[-1] < capacity:
            out.append(Runner.kv_bucket(out[-1], capacity))
        return out

    # -- KV persistence ------------------------------------------------------------------

    def export_slot(self, slot: int, length: int) -> dict[str, np.ndarray]:
        """The first `length` cached positions of `slot`, per layer, as host arrays.

        One program copies a power-of-two bucket of positions out of every layer and the host
        cuts it to `length`: a handful of programs serves every length (one compiled per new
        length, as eager slicing did, kept them all, about 3 MB each on the CPU)."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} is not one of the {self.slots} KV slots")
        size = bucket(length, lo=32, hi=self.capacity)
        layers = jax.device_get(_export_positions(self.cache, slot, size=size))
        return {
            f"{i}.{name}": np.ascontiguousarray(data[:length])
            for i, layer in enumerate(layers)
            for name, data in layer.items()
        }

    def import_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        """Put arrays from `export_slot` back into `slot` (positions 0..length-1).

        One program writes them into the cache in place (it is donated; updated eagerly, every
        layer's whole cache was copied for each slot restored), padded with zeros to a
        power-of-two bucket of positions as `export_slot` reads them: a handful of programs
        serves every length. The padding lands on positions past the slot's history, which
        nothing reads before a forward writes them."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} is not one of the {self.slots} KV slots")
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) > 1:
            raise ValueError(f"the arrays hold different numbers of positions: {lengths}")
        length = lengths.pop() if lengths else 0
        if length > self.capacity:
            raise ValueError(f"{length} positions do not fit a slot of {self.capacity}")
        size = bucket(length, lo=32, hi=self.capacity)
        layers = []
        for i, layer in enumerate(self.cache):
            mine = {}
            for name in layer:
                data = np.asarray(arrays[f"{i}.{name}"])
                pad = [(0, size - len(data))] + [(0, 0)] * (data.ndim - 1)
                mine[name] = np.pad(data, pad)
            layers.append(mine)
        self.cache = _import_positions(self.cache, slot, layers)

    # -- internals -----------------------------------------------------------------------

    def _kv_len(self, max_pos: int) -> int:
        return self.kv_bucket(max_pos, self.capacity)

    @staticmethod
    def kv_bucket(max_pos: int, capacity: int) -> int:
        """Cached positions a forward attends over when its last position is max_pos."""
        return bucket(max_pos + 1, lo=32, hi=capacity)

    def _count_decoded(self, n: int) -> None:
        self.decoded += n
        if self._next_repin and self.decoded >= self._next_repin:
            self.store.repin()
            self._next_repin = self.decoded + self.store.tiers.repin

    def _forward(self, b: _Batch, all_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Logits of the real rows and routes [n_moe, rows, width, K] of real tokens."""
        if self.split:
            return self._land(b, self._forward_split(b, all_logits))
        logits, self.cache, r = transformer.forward(
            self.cfg,
            self.model.params,
            self.store.resident,
            self.cache,
            b.tokens,  # numpy in: jit transfers it without dispatching an op per array
            b.pos,
            b.slots,
            b.last,
            kv_len=b.kv_len,
            all_logits=all_logits,
        )
        return self._land(b, (logits, r))

    def _forward_traced(self, b: _Batch) -> tuple[np.ndarray, transformer.Routing]:
        """`_forward` of a traced prefill: host logits of the real rows and their `Routing`
        (rows, width cut to the real ones); only real tokens are counted."""
        if self.split:
            logits, routing = self._forward_split(b, all_logits=False, trace=True)
        else:
            logits, self.cache, routing = transformer.forward(
                self.cfg,
                self.model.params,
                self.store.resident,
                self.cache,
                b.tokens,
                b.pos,
                b.slots,
                b.last,
                kv_len=b.kv_len,
                trace=True,
            )
            routing = transformer.Routing(*(np.asarray(a)[:, : b.rows, : b.width] for a in routing))
            self._record(np.concatenate([routing.ids[:, r, :n] for r, n in enumerate(b.lens)], 1))
        self.timers.total["t_edisk"] = self.store.disk.thread_seconds
        return np.asarray(logits)[: b.rows], routing

    def _land(
        self, b: _Batch, out: tuple, keep: list[bool] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Wait for a forward: host logits of the real rows and routes of real tokens (those
        of rows in `keep` are counted in the statistics)."""
        logits, r = out
        if self.split:
            routes = r
        else:
            routes = np.asarray(r)[:, : b.rows, : b.width]
            self._record(routes if keep is None else routes[:, np.asarray(keep, bool)])
        self.timers.total["t_edisk"] = self.store.disk.thread_seconds
        return np.asarray(logits)[: b.rows], routes

    def _land_burst(self, b: _Batch, r: jax.Array, keep: Sequence | None, ran: int) -> np.ndarray:
        """Wait for a burst that ran `ran` steps: routes [ran, n_moe, rows, K]; each step's
        (rows in `keep`) is counted in the statistics as one forward's."""
        routes = np.asarray(r)[:ran, :, : b.rows, 0]
        kept = None if keep is None else np.asarray(keep, bool)
        decoded = routes.shape[0] * b.rows if kept is None else int(np.count_nonzero(kept))
        if self._next_repin and self.decoded + decoded >= self._next_repin:
            for s, step in enumerate(routes):  # a repin falls inside: it sees the steps before
                self._record(step if kept is None else step[:, kept[s]], more=s > 0)
                self._count_decoded(b.rows if kept is None else int(np.count_nonzero(kept[s])))
        else:  # every step at once, as the loop above would count them
            distinct = int(self.stats.record_steps(routes, kept).sum())
            self.stats.record_lookups(distinct, distinct)
            self._count_decoded(decoded)
        self.timers.total["t_edisk"] = self.store.disk.thread_seconds
        return routes

    def _record(self, routes: np.ndarray, more: bool = False) -> None:
        """Selection counts of real tokens (`more`: a burst's step after its first); in the
        fused path every lookup is a device hit."""
        distinct = self.stats.record_all(routes, more)
        if not self.split:
            self.stats.record_lookups(distinct, distinct)

    def _forward_split(self, b: _Batch, all_logits: bool, trace: bool = False):
        cfg, params, t = self.cfg, self.model.params, self.timers
        pos, slots = jnp.asarray(b.pos), jnp.asarray(b.slots)
        x = steps.embed(cfg, params, jnp.asarray(b.tokens))
        routes, traced, prediction, keep = [], [], None, None
        for i, lw in enumerate(params["layers"]):
            x, keep = self._attention(i, lw, x, pos, slots, b.kv_len, keep)
            if "moe" not in lw:
                x = steps.dense_mlp(cfg, lw, x)
                continue
            x, ids, prediction, extra = self._moe(len(routes), lw, x, b, prediction, trace)
            routes.append(ids)
            traced.append(extra)
        with t.phase("t_head"):
            logits = steps.head(cfg, params, x, jnp.asarray(b.last), all_logits=all_logits)
            logits.block_until_ready()
        ids = np.stack(routes) if routes else np.zeros((0, b.rows, b.width, 1), np.int32)
        if trace:
            return logits, _host_routing(ids, traced, (b.rows, b.width))
        return logits, ids

    def _attention(self, i: int, lw: dict, x, pos, slots, kv_len: int, keep=None):
        """One layer's attention: x, and DSA's selection (`keep`: the layer before's, which a
        layer without an indexer reuses; None elsewhere)."""
        cfg, t = self.cfg, self.timers
        with t.phase("t_attn"):
            if cfg.attention != "mla":
                x, self.cache[i] = steps.attend(
                    cfg, lw, self.cache[i], x, pos, slots, kv_len=kv_len
                )
            else:
                if cfg.dsa is not None:
                    q, keep, self.cache[i] = steps.dsa_project(
                        cfg, lw, self.cache[i], x, pos, slots, keep, kv_len=kv_len
                    )
                else:
                    q, self.cache[i] = steps.mla_project(cfg, lw, self.cache[i], x, pos, slots)
                if attention.mla_in_latents(lw["attn"], q.shape[1]):  # no expansion (t_kvb 0)
                    x = steps.mla_attend_latent(
                        cfg, lw, self.cache[i], x, q, pos, slots, keep, kv_len=kv_len
                    )
                else:
                    with t.phase("t_kvb"):
                        k_nope, v = steps.mla_expand(cfg, lw, self.cache[i], slots, kv_len=kv_len)
                        v.block_until_ready()
                    x = steps.mla_attend(
                        cfg, lw, self.cache[i], x, q, k_nope, v, pos, slots, keep, kv_len=kv_len
                    )
            x.block_until_ready()
        return x, keep

    def _moe(self, row: int, lw: dict, x, b: _Batch, prediction, trace: bool = False):
        """Route, stage the union of chosen experts chunk by chunk, combine. Also returns,
        where `trace`, the real rows' gate weights, router entropy and margin (else None)."""
        cfg, store, t = self.cfg, self.store, self.timers
        extra = None
        if trace:
            h, ids, wts, ent, margin = _route_traced(cfg, lw, x)
            extra = tuple(
                np.asarray(a).reshape(*b.tokens.shape, -1)[: b.rows, : b.width]
                for a in (wts, ent, margin)
            )
        else:
            h, ids, wts = steps.route(cfg, lw, x)
        ids_np = np.asarray(ids)  # [B*T, K]: the one host round trip of the layer
        real = ids_np.reshape(*b.tokens.shape, -1)[: b.rows, : b.width]  # [rows, width, K]
        if b.lens is None:
            self.stats.record(row, real)
        else:  # rows of different lengths: their padding stays out of the statistics
            self.stats.record(row, np.concatenate([real[r, :n] for r, n in enumerate(b.lens)]))
        union = np.unique(real)
        if prediction is not None:
            store.score_prediction(prediction, union)
        prediction = self._lookahead(row, h, b) if store.tiers.pilot else None
        y = None
        if store.all_resident:
            maps = [np.arange(store.E, dtype=np.int32)]
            self.stats.record_lookups(len(union), len(union))
        else:
            maps = store.chunks(row, union, t)
        for slot_map in maps:
            bufs = store.resident[row] if store.all_resident else store.slots[row].bufs
            with t.phase("t_emm"):
                part = steps.expert_outputs(cfg, bufs, h, jnp.asarray(slot_map), ids)
                y = part if y is None else y + part  # disjoint chunks: adds exact zeros
                y.block_until_ready()
        with t.phase("t_emm"):
            x = steps.combine(cfg, lw, x, h, y, wts)
            x.block_until_ready()
        return x, real, prediction, extra

    def _lookahead(self, row: int, h, b: _Batch) -> np.ndarray | None:
        """PILOT: predict the next MoE layer's experts from this layer's input; prefetch them."""
        nxt = row + 1
        if nxt >= len(self.cfg.moe_layer_ids) or self.store.all_resident:
            return None
        lw_next = self.model.params["layers"][self.cfg.moe_layer_ids[nxt]]
        pred = np.asarray(steps.lookahead(self.cfg, lw_next, h))
        pred = np.unique(pred.reshape(*b.tokens.shape, -1)[: b.rows, : b.width])
        self.store.prefetch(nxt, pred)
        return pred
