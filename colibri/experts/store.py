"""The expert store: where every routed expert is, and staging the ones a forward needs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import jax
import numpy as np

from colibri import hugepages
from colibri.checkpoint import Checkpoint
from colibri.config import ModelConfig
from colibri.experts.budget import Plan, TierConfig, plan
from colibri.experts.disk import DiskReader
from colibri.experts.ram import RamCache, Weights
from colibri.experts.slots import ExpertSlots
from colibri.experts.stats import TIER_DEVICE, TIER_DISK, TIER_RAM, ExpertStats, RepinEvent
from colibri.experts.usage import read_usage, write_usage
from colibri.formats import HOLD_ALL, Holding
from colibri.model import parallel
from colibri.weights import expert_dtype, expert_shapes, expert_stacks, load_experts, row_blocks

log = logging.getLogger("colibri")


class ExpertStore:
    """Routed experts of every MoE layer across device slots, a RAM cache and the checkpoint.

    Rows are MoE layers in order (row r is checkpoint layer `cfg.moe_layer_ids[r]`). When every
    expert fits on device they are stacked once (`resident`) and nothing moves; otherwise
    `chunks` stages what each forward needs, layer by layer.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        cfg: ModelConfig,
        tiers: TierConfig,
        usage_path: str | Path | None = None,
        progress: bool = False,
        holding: Holding = HOLD_ALL,
    ):
        self.ckpt, self.cfg, self.tiers = ckpt, cfg, tiers
        self.layer_ids = cfg.moe_layer_ids
        m = cfg.moe
        self.E = m.num_experts
        self.held = expert_dtype(ckpt, cfg, holding)  # a formats.HeldFormat's storage dtype
        self.blocks = row_blocks(ckpt, cfg, self.held)
        self.shapes = expert_shapes(cfg, self.held, self.blocks)
        self.expert_bytes = sum(r * c for r, c in self.shapes.values()) * self.held.itemsize
        cpu = jax.devices()[0].platform == "cpu"
        self.disk = DiskReader(ckpt, cfg, tiers.io_threads, tiers.direct_io, held=self.held)
        # Misses of a layer read at once (`chunks`), and what reading holds beyond the tiers:
        # that many read buffers in flight, as many kept for reuse, and the experts read but
        # not yet placed. Automatic budgets leave it out (a model that fits needs none).
        self.read_window = max(2, 2 * tiers.io_threads)
        raw = self.disk.buffer_bytes(self.layer_ids[0], 0) if self.layer_ids else 0
        self.disk.keep_spare(self.read_window * raw)
        self.read_reserve = self.read_window * (2 * raw + 2 * self.expert_bytes)  # PILOT's too
        n = len(self.layer_ids)
        self.plan: Plan = plan(tiers, n, self.E, self.expert_bytes, cpu)
        if not self.plan.all_resident(self.E):
            self.plan = plan(tiers, n, self.E, self.expert_bytes, cpu, self.read_reserve)
        self.stats = ExpertStats(len(self.layer_ids), self.E, self.expert_bytes)
        self.usage_path = Path(usage_path) if usage_path else None
        if self.usage_path:
            self.stats.counts[:] = read_usage(self.usage_path, len(self.layer_ids), self.E)
        self.tick = 0
        self.resident: list[dict] | None = None
        self.pilot_predicted = 0
        self.pilot_correct = 0
        self.pilot_actual = 0
        self.pilot_read_ahead = 0  # misses whose read PILOT had started (no RAM tier)
        self._needed: set[tuple[int, int]] = set()
        self._inflight: dict[tuple[int, int], Future] = {}
        # PILOT without a RAM tier: reads of the next layer's predicted experts, kept until that
        # layer's `chunks` takes them (at most read_window of them)
        self._ahead: dict[tuple[int, int], Future] = {}
        self._lock = threading.RLock()  # tier bookkeeping from the reader pool (PILOT)
        self._pinned = _pinned_host()
        if self.all_resident:
            self._load_resident(progress)
        else:
            self.ram = RamCache(self.plan.ram_bytes)
            self.slots = [
                ExpertSlots(self.plan.slots_per_layer, self.E, self.shapes, self.held)
                for _ in self.layer_ids
            ]
            self.stats.tier[:] = TIER_DISK
            self._warm_start()

    @property
    def all_resident(self) -> bool:
        return self.plan.all_resident(self.E)

    def _load_resident(self, progress: bool) -> None:
        from tqdm import tqdm

        layers = tqdm(
            self.layer_ids, desc="experts", unit="layer", disable=not progress, leave=False
        )
        # Every layer's room first, its pages faulted in by a thread of their own while the
        # layers are read into it: a fresh process here loads the peers checkpoints in
        # 0.57-0.63x the time it takes on small pages (faulted in by the writes themselves,
        # layer by layer, it took longer than on small pages; bench_hugepages.py --level load).
        room = [expert_stacks(self.cfg, self.held, self.blocks) for _ in self.layer_ids]
        hugepages.populate([a for r in room for a in r.values()])
        # Several devices (`parallel`): each layer's stacks split over them along the experts.
        self.resident = [
            parallel.split_experts(load_experts(self.ckpt, self.cfg, i, out=r))
            for i, r in zip(layers, room, strict=True)
        ]
        self.stats.tier[:] = TIER_DEVICE

    def _warm_start(self) -> None:
        """Pin the hottest experts of the usage history, then fill the RAM cache with the next."""
        order = np.argsort(-self.stats.counts, axis=None, kind="stable")
        hot = [divmod(int(i), self.E) for i in order if self.stats.counts.flat[i] > 0]
        pins_left = self.plan.pins
        for row, e in hot:
            if pins_left == 0:
                break
            s = self.slots[row]
            if s.can_pin(e):
                slot = s.victim(set(), "lru", self.stats.counts[row], e)
                assert slot is not None
                self._stage(row, slot, e, self._fetch(row, e))
                s.pinned[slot] = True
                pins_left -= 1
        for row, e in hot:
            if self.ram.used + self.expert_bytes > self.ram.budget:
                break
            if self.slots[row].slot_of[e] < 0:
                self._ram_put(row, e, self.disk.read(self.layer_ids[row], e))

    # -- lookups -------------------------------------------------------------------------

    def chunks(self, row: int, needed: np.ndarray, timers) -> Iterator[np.ndarray]:
        """Stage the experts `needed` by MoE row `row`; yields expert->slot maps [E], -1 = absent.

        Each yielded map's experts are on device together; compute with it before advancing
        the iterator (the next chunk may reuse slots). Counts one lookup per needed expert.
        """
        self.tick += 1
        s = self.slots[row]
        needed = [int(e) for e in needed]
        self._needed = {(row, e) for e in needed}
        on_device = [e for e in needed if s.slot_of[e] >= 0]
        in_ram = [e for e in needed if s.slot_of[e] < 0 and (row, e) in self.ram]
        t0 = time.perf_counter()
        # A miss is neither on device nor in RAM, so it is read from disk: read_window of them
        # at once, the next one started as each is placed, so what reading holds is bounded
        # (`read_reserve`) however many a layer misses.
        unread = [e for e in needed if s.slot_of[e] < 0 and e not in in_ram]
        self.stats.record_lookups(len(needed), len(on_device) + len(in_ram), len(unread))
        futures: dict[int, Future] = {}
        for key in [k for k in self._ahead if k[0] == row]:  # PILOT's reads for this layer
            f = self._ahead.pop(key)
            if key[1] in unread:
                unread.remove(key[1])
                self.disk.promote(f)  # now needed: its queued pieces go first
                futures[key[1]] = f
                self.pilot_read_ahead += 1

        def read_more() -> None:
            while unread and len(futures) < self.read_window:  # started, not yet placed
                e = unread.pop(0)
                futures[e] = self._read_async(row, e)

        read_more()
        pending = sorted(needed, key=lambda e: s.slot_of[e] < 0)  # resident ones first
        # While reads are in flight, the experts already on device are computed first, alone:
        # the forward waits only for what it truly lacks, after computing what it has.
        overlap = bool(on_device) and any(not f.done() for f in futures.values())
        while pending:
            protect = {int(s.slot_of[e]) for e in pending if s.slot_of[e] >= 0}
            chunk = [e for e in pending if s.slot_of[e] >= 0]
            missing = [e for e in pending if s.slot_of[e] < 0]
            # those in RAM or read already first, then those being read, then those not started
            missing.sort(key=lambda e: 2 if e in unread else e in futures and not futures[e].done())
            for e in [] if overlap else missing:
                slot = s.victim(protect, self.tiers.policy, self.stats.counts[row], e)
                if slot is None:  # its device's slots are taken (other devices may have room)
                    continue
                if e in unread:  # not started yet: now, ahead of those still waiting
                    unread.remove(e)
                    futures[e] = self._read_async(row, e)
                w = self.ram.get((row, e))
                if w is None:
                    w = futures.pop(e).result() if e in futures else self._fetch(row, e)
                    self._ram_put(row, e, w)
                self._stage(row, slot, e, w)
                read_more()
                protect.add(slot)
                chunk.append(e)
            overlap = False
            if not chunk:
                raise RuntimeError(f"MoE row {row}: no device slot to stage into (all pinned)")
            slots = s.slot_of[chunk]
            s.touch(slots, self.tick)
            mapping = np.full(self.E, -1, np.int32)
            mapping[chunk] = slots
            timers.add("t_ewait", time.perf_counter() - t0)
            yield mapping
            t0 = time.perf_counter()
            done = set(chunk)
            pending = [e for e in pending if e not in done]
        self._needed = set()

    def _read_async(self, row: int, e: int, urgent: bool = True) -> Future:
        """The read of (row, e) in flight, started if need be; `urgent` when a forward waits."""
        with self._lock:
            f = self._inflight.get((row, e))
            if f is not None and urgent:
                self.disk.promote(f)  # a prefetch the current layer now needs
            if f is None:
                f = self.disk.submit(self.layer_ids[row], e, urgent)
                self._inflight[(row, e)] = f
                f.add_done_callback(lambda _f, k=(row, e): self._inflight.pop(k, None))
        return f

    def _fetch(self, row: int, e: int) -> Weights:
        w = self.ram.get((row, e))
        return w if w is not None else self.disk.read(self.layer_ids[row], e)

    def _stage(self, row: int, slot: int, e: int, w: Weights) -> None:
        with self._lock:
            old = self.slots[row].stage(slot, e, w)
            if old >= 0:
                self.stats.tier[row, old] = TIER_RAM if (row, old) in self.ram else TIER_DISK
            self.stats.tier[row, e] = TIER_DEVICE

    def _ram_put(self, row: int, e: int, w: Weights) -> None:
        if self._pinned is not None and isinstance(w[0], np.ndarray):
            w = tuple(jax.device_put(a, self._pinned) for a in w)  # staging becomes one DMA
        with self._lock:
            for r, old in self.ram.put((row, e), w, protect=self._needed):
                if self.slots[r].slot_of[old] < 0:
                    self.stats.tier[r, old] = TIER_DISK
            if (row, e) in self.ram and self.slots[row].slot_of[e] < 0:
                self.stats.tier[row, e] = TIER_RAM

    # -- PILOT: router lookahead ---------------------------------------------------------

    def prefetch(self, row: int, predicted: np.ndarray) -> None:
        """Start disk reads for experts MoE row `row` is predicted to need: into RAM, or with
        no RAM tier (unified memory) held for that row's `chunks`, a window of them."""
        self.pilot_predicted += len(predicted)
        ahead = self.ram.budget == 0  # no RAM tier (unified memory): held until row's chunks
        for e in (int(x) for x in predicted):
            if self.slots[row].slot_of[e] >= 0 or (row, e) in self.ram or (row, e) in self._ahead:
                continue
            if self.disk.in_flight() >= self.read_window:  # a guess: never past the window
                break
            if ahead:
                if len(self._ahead) >= self.read_window:
                    break
                self._ahead[(row, e)] = self._read_async(row, e, urgent=False)
                continue
            f = self._read_async(row, e, urgent=False)
            f.add_done_callback(lambda f, k=(row, e): self._prefetched(k, f))

    def _prefetched(self, key: tuple[int, int], f: Future) -> None:
        if f.exception() is None:  # from the reader pool; never evicts what is needed now
            self._ram_put(key[0], key[1], f.result())

    def score_prediction(self, predicted: np.ndarray, actual: np.ndarray) -> None:
        """One-layer-ahead recall: how many of the experts a layer used were predicted."""
        self.pilot_actual += len(actual)
        self.pilot_correct += len(np.intersect1d(predicted, actual))

    def pilot_recall(self) -> float:
        return self.pilot_correct / self.pilot_actual if self.pilot_actual else 0.0

    # -- REPIN ---------------------------------------------------------------------------

    def repin(self) -> list[RepinEvent]:
        """Per layer, swap the coldest pin for the hottest unpinned expert if it is hotter."""
        if self.all_resident:
            return []
        events = []
        for row, s in enumerate(self.slots):
            pinned = np.nonzero(s.pinned)[0]
            if len(pinned) == 0:
                continue
            counts = self.stats.counts[row]
            pinned_experts = set(s.expert_in[pinned].tolist())
            hot = max(
                (e for e in range(self.E) if e not in pinned_experts), key=lambda e: counts[e]
            )
            cold_slot = min(pinned, key=lambda sl: counts[s.expert_in[sl]])
            if counts[hot] <= counts[s.expert_in[cold_slot]]:
                continue
            s.pinned[cold_slot] = False
            if not s.can_pin(hot):  # its device (several devices) has no slot to spare
                s.pinned[cold_slot] = True
                continue
            old_tier = int(self.stats.tier[row, hot])
            if s.slot_of[hot] < 0:
                slot = s.victim(set(), self.tiers.policy, counts, hot)
                assert slot is not None
                self._stage(row, slot, hot, self._fetch(row, hot))
            s.pinned[s.slot_of[hot]] = True
            event = RepinEvent(row, hot, old_tier, s.device_of(hot))
            self.stats.repins.append(event)
            events.append(event)
        return events

    def save_usage(self, engine_id: int = 0) -> None:
        if self.usage_path:
            write_usage(self.usage_path, self.stats.counts, engine_id)

    def summary(self) -> str:
        n_dev, n_ram, n_disk, _, _ = self.stats.tier_counts()
        n = len(parallel.devices())
        where = f"on {n} devices" if n > 1 else "on device"
        return (
            f"experts: {n_dev} {where} ({self.plan.slots_per_layer}/layer"
            f"{' each' if n > 1 and not self.all_resident else ''}, "
            f"{self.plan.pins} pinned), {n_ram} in RAM, {n_disk} on disk"
        )

    def close(self) -> None:
        self.disk.close()


def _pinned_host() -> jax.sharding.Sharding | None:
    """Page-locked host memory next to a GPU (JAX memory kinds); None on CPU, where RAM is RAM."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return None
    try:
        return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    except (ValueError, RuntimeError):  # a backend without memory kinds: plain host arrays
        return None
