"""Placement changes speed, never tokens: tiered experts against the all-resident run."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import tiny

from colibri import kernels
from colibri.engine.model import load_model
from colibri.engine.runner import Row, Runner, _decode_burst
from colibri.experts.budget import TierConfig
from colibri.experts.stats import TIER_DEVICE, TIER_DISK, TIER_RAM
from colibri.experts.usage import read_usage, write_usage
from colibri.formats import Holding

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps",
    "Der schnelle braune Fuchs springt über",
    "int main(void) {",
]
STEPS = 10


def batched_greedy(runner: Runner, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    """Prefill each prompt into its own slot, then decode all of them together, greedily."""
    out: list[list[int]] = [[] for _ in prompts]
    nxt = []
    for slot, ids in enumerate(prompts):
        logits, _ = runner.prefill(slot, ids)
        nxt.append(int(np.argmax(logits)))
    pos = [len(p) for p in prompts]
    for _ in range(steps):
        rows = [Row(s, nxt[s], pos[s]) for s in range(len(prompts))]
        logits, _ = runner.decode(rows)
        for s in range(len(prompts)):
            out[s].append(nxt[s])
            nxt[s] = int(np.argmax(logits[s]))
            pos[s] += 1
    return out


def chained_greedy(runner: Runner, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    """As batched_greedy, but each forward is fed the previous one's greedy tokens through
    `decode_async(rows, after=...)`, started before the host has seen them."""
    first = [int(np.argmax(runner.prefill(s, ids)[0])) for s, ids in enumerate(prompts)]
    fwd = runner.decode_async([Row(s, first[s], len(p)) for s, p in enumerate(prompts)])
    out = [[t] for t in first]
    for step in range(1, steps):
        rows = [Row(s, -1, len(p) + step, take=s) for s, p in enumerate(prompts)]
        fwd, prev = runner.decode_async(rows, after=fwd), fwd
        for s, t in enumerate(prev.greedy()):
            out[s].append(int(t))
    return out


def test_chained_forwards_feed_the_greedy_tokens(checkpoints):
    d = checkpoints("qwen3_moe")
    model = load_model(d, progress=False)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    reference = batched_greedy(Runner(model, slots=4, capacity=64), prompts)
    fused = Runner(model, slots=4, capacity=64)
    assert fused.chains and chained_greedy(fused, prompts) == reference
    split = Runner(model, slots=4, capacity=64, profile=True)  # the host feeds the tokens
    assert not split.chains and chained_greedy(split, prompts) == reference
    with pytest.raises(ValueError, match="earlier forward"):
        fused.decode_async([Row(0, -1, 5, take=0)])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_a_burst_of_steps_is_those_steps_chained(checkpoints, family):
    """decode_async(steps=n): n greedy steps in one program give, step by step, the tokens,
    routes and cached keys and values of n single chained forwards; a second burst, run by
    the program of bursts of up to 8 steps, chains behind the first. A burst whose rows have
    all chosen a stop token ends there."""
    model = load_model(checkpoints(family), progress=False)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    reference = batched_greedy(Runner(model, slots=4, capacity=64), prompts)
    single, burst = Runner(model, slots=4, capacity=64), Runner(model, slots=4, capacity=64)
    first = [int(np.argmax(burst.prefill(s, ids)[0])) for s, ids in enumerate(prompts)]
    for s, ids in enumerate(prompts):
        single.prefill(s, ids)
    rows = [Row(s, first[s], len(p)) for s, p in enumerate(prompts)]
    a = burst.decode_async(rows, steps=4)
    b = burst.decode_async(
        [Row(s, -1, len(p) + 4, take=s) for s, p in enumerate(prompts)],
        after=a,
        steps=5,
        most=8,
    )
    assert a.steps == 4 and b.steps == 5
    tokens = np.concatenate([a.tokens(), b.tokens()])  # [9, rows]
    assert [[first[s], *tokens[:, s]] for s in range(4)] == reference
    logits, routes = b.result()
    assert logits is None and routes.shape[:3] == (5, len(model.cfg.moe_layer_ids), 4)
    fwd = single.decode_async(rows)
    for step in range(1, 9):
        nxt = single.decode_async(
            [Row(s, -1, len(p) + step, take=s) for s, p in enumerate(prompts)], after=fwd
        )
        want = fwd.result()[1]
        got = a.result()[1][step - 1] if step <= 4 else routes[step - 5]
        np.testing.assert_array_equal(got, want)
        fwd = nxt
    fwd.result()
    for s, p in enumerate(prompts):  # the roped keys the burst cached: bitwise the steps'
        got, want = burst.export_slot(s, len(p) + 8), single.export_slot(s, len(p) + 8)
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # a burst ends once every row has chosen one of its stop tokens: the steps up to there
    ended = Runner(model, slots=4, capacity=64)
    for s, ids in enumerate(prompts):
        ended.prefill(s, ids)
    stops = sorted({r[3] for r in reference})  # each row's third step's token
    last = max(next(i for i, t in enumerate(r[1:]) if t in stops) for r in reference)
    c = ended.decode_async(rows, steps=8, stops=stops)
    assert c.ran() == last + 1 < 8 and not c.cuttable
    assert c.tokens().tolist() == tokens[: last + 1].tolist()
    assert c.result()[1].shape[0] == last + 1
    split = Runner(model, slots=4, capacity=64, profile=True)
    with pytest.raises(ValueError, match="resident"):
        split.decode_async(rows, steps=2)
    with pytest.raises(ValueError, match="outside the context"):
        burst.decode_async([Row(0, 1, 60)], steps=5)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_cuttable_burst_is_its_steps_up_to_the_cut(checkpoints, family):
    """decode_async(steps=n, cuttable=True) runs n steps while the cut flag is down; raised
    before it starts, the burst runs its first step only: that step's tokens, routes and
    cached keys and values, as a whole burst gives them. Nothing chains behind it."""
    model = load_model(checkpoints(family), progress=False)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    reference = batched_greedy(Runner(model, slots=4, capacity=64), prompts)
    cut, whole = Runner(model, slots=4, capacity=64), Runner(model, slots=4, capacity=64)
    if jax.default_backend() != "cpu":  # the cut flag is the CPU kernels' own
        assert not cut.cuts
        with pytest.raises(ValueError, match="cuttable bursts need the CPU kernels"):
            cut.decode_async([Row(0, 1, 8)], steps=2, cuttable=True)
        pytest.skip("cuttable bursts are the CPU kernels' own")
    assert cut.cuts
    first = [int(np.argmax(cut.prefill(s, ids)[0])) for s, ids in enumerate(prompts)]
    for s, ids in enumerate(prompts):
        whole.prefill(s, ids)
    rows = [Row(s, first[s], len(p)) for s, p in enumerate(prompts)]
    a = cut.decode_async(rows, steps=4, cuttable=True, most=6)  # (the program of 6 steps)
    assert a.cuttable and a.ran() == 4
    assert [[first[s], *a.tokens()[:, s]] for s in range(4)] == [r[:5] for r in reference]
    with pytest.raises(ValueError, match="cuttable"):
        cut.decode_async([Row(0, -1, len(prompts[0]) + 4, take=0)], after=a)
    a.result()
    whole.decode_async(rows, steps=4)
    later = [Row(s, int(a.tokens()[-1, s]), len(p) + 4) for s, p in enumerate(prompts)]
    kernels.request_cut(True)
    try:
        b = cut.decode_async(later, steps=5, cuttable=True)
        assert b.ran() == 1
    finally:
        kernels.request_cut(False)
    c = whole.decode_async(later, steps=5)
    assert b.tokens().tolist() == c.tokens()[:1].tolist() == [[r[5] for r in reference]]
    np.testing.assert_array_equal(b.result()[1], c.result()[1][:1])
    for s, p in enumerate(prompts):  # the keys and values of the steps run: bitwise
        got, want = cut.export_slot(s, len(p) + 5), whole.export_slot(s, len(p) + 5)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # The flag is read in the loop's condition, before every step (not once, hoisted out).
    packed = np.zeros((4, 1), np.int32)
    args = (cut.cfg, cut._weights_def, cut._weights, cut.cache, packed, cut._no_tokens)
    args += (np.asarray([5, 1], np.int32), np.full(8, -1, np.int32))  # 5 steps, 1 row, no stop
    hlo = _decode_burst.lower(*args, kv_len=64, steps=5, cuttable=True).compile().as_text()
    (cond,) = re.findall(r"while\(.*?condition=%?([\w.\-]+)", hlo)
    reads, where = [], None
    for line in hlo.splitlines():
        if head := re.match(r"(?:ENTRY )?%?([\w.\-]+) \(", line):  # a computation begins
            where = head.group(1)
        if 'custom_call_target="colibri_cut_requested"' in line:
            reads.append(where)
    assert reads == [cond]


def budgets(eb: int, layers: int) -> dict[str, tuple[TierConfig, bool]]:
    per_layer = eb * layers
    return {
        "profiled-resident": (TierConfig(), True),
        "1-slot-no-ram": (TierConfig(device_bytes=per_layer, ram_bytes=0), False),
        "2-slot-lru-ram": (
            TierConfig(device_bytes=2 * per_layer, ram_bytes=3 * eb, unified=False),
            False,
        ),
        # on the CPU the RAM budget becomes two more slots a layer
        "2+2-slot-unified": (
            TierConfig(device_bytes=2 * per_layer, ram_bytes=2 * per_layer),
            False,
        ),
        "3-slot-lfru": (TierConfig(device_bytes=3 * per_layer, ram_bytes=0, policy="lfru"), False),
        "pins+repin": (
            TierConfig(
                device_bytes=3 * per_layer,
                ram_bytes=2 * eb,
                pin_bytes=layers * eb,
                repin=4,
                unified=False,
            ),
            False,
        ),
        # PILOT reading ahead beside the slots (unified memory), and into a RAM tier
        "pilot": (TierConfig(device_bytes=2 * per_layer, ram_bytes=0, pilot=True), False),
        "pilot-ram": (
            TierConfig(device_bytes=2 * per_layer, ram_bytes=6 * eb, pilot=True, unified=False),
            False,
        ),
        "direct-io": (TierConfig(device_bytes=per_layer, ram_bytes=0, direct_io=True), False),
    }


# qwen3_moe in `make test`; the other families' sweeps are `slow` (the suite's cold time is
# near its budget, and test_parallel runs olmoe and deepseek_v3 tiered through the engine)
@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        pytest.param("olmoe", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", marks=pytest.mark.slow),
    ],
)
def test_greedy_identical_under_every_policy_and_budget(family, checkpoints, tmp_path):
    d = checkpoints(family)
    base = load_model(d, progress=False)
    assert base.store.all_resident
    prompts = [base.tokenizer.encode(p) for p in PROMPTS]
    reference = batched_greedy(Runner(base, slots=len(prompts), capacity=64), prompts)
    eb, layers = base.store.expert_bytes, len(base.cfg.moe_layer_ids)
    usage = tmp_path / ".coli_usage"
    write_usage(usage, base.store.stats.counts)  # history from the reference run: pins learn
    for name, (tiers, profile) in budgets(eb, layers).items():
        model = load_model(d, tiers=tiers, usage_path=usage, progress=False)
        runner = Runner(model, slots=len(prompts), capacity=64, profile=profile)
        assert runner.split
        got = batched_greedy(runner, prompts)
        assert got == reference, name
        st = model.store.stats
        assert st.hits + st.misses == st.lookups, name
        if not model.store.all_resident:
            assert model.store.disk.bytes_read > 0, name  # warm start or misses read disk
            on_device = (st.tier == TIER_DEVICE).sum(axis=1)
            assert (on_device <= model.store.plan.slots_per_layer).all(), name
        if tiers.pilot:
            assert 0 < model.store.pilot_recall() <= 1
            assert (model.store.pilot_read_ahead > 0) == (tiers.unified is None), name
        if tiers.repin:
            assert all(s.pinned.sum() == 1 for s in model.store.slots), name
        model.store.close()


@pytest.mark.parametrize("tiered", [False, True])
def test_bfloat16_weights_held_as_such_decode_what_float32_ones_do(tiered, checkpoints):
    """A bfloat16 checkpoint's matrices, routed experts and dense ones, are held as bfloat16
    bits (half the bytes, in memory and per token read). Wherever the CPU kernels compute
    (decode, and prefill of up to 16 tokens) the logits are bitwise those of the same weights
    widened to float32 at load (COLIBRI_BF16=0); a longer prefill goes through XLA's products,
    into which the widening is fused: the same to float32 rounding. Resident and tiered."""
    d = checkpoints("qwen3_moe", "bfloat16")
    prompts = [[5, 9, 300, 17], [44, 2, 2, 81, 6, 7], list(range(3, 43))]
    got = {}
    for bf16 in ("1", "0"):
        model, probe = tiny.load_placed(d, tiered, Holding.from_env({"COLIBRI_BF16": bf16}))
        logits, steps = tiny.prefill_then_decode(model, prompts)
        dense = (model.params["lm_head"].dtype, model.params["final_norm"].dtype)
        got[bf16] = (model.store.held, dense, model.store.expert_bytes, logits, steps)
        model.store.close()
        probe.store.close()
    (h16, d16, eb16, pre16, dec16), (h32, d32, eb32, pre32, dec32) = got["1"], got["0"]
    assert (h16, h32) == (np.uint16, np.float32) and eb16 * 2 == eb32
    assert d16 == (np.uint16, np.float32) and d32 == (np.float32, np.float32)  # norms stay
    np.testing.assert_array_equal(pre16[:2], pre32[:2])
    np.testing.assert_array_equal(dec16[:, :2], dec32[:, :2])  # each row as it is alone
    np.testing.assert_allclose(pre16[2], pre32[2], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dec16[:, 2], dec32[:, 2], rtol=1e-4, atol=1e-4)
    assert np.argmax(pre16[2]) == np.argmax(pre32[2])


def test_resident_model_is_one_program(checkpoints):
    model = load_model(checkpoints("qwen3_moe"), progress=False)
    runner = Runner(model, capacity=64)
    assert not runner.split and model.store.resident is not None
    assert (model.store.stats.tier == TIER_DEVICE).all()


def test_pins_come_from_usage_history(checkpoints, tmp_path):
    d = checkpoints("olmoe")
    probe = load_model(d, progress=False)
    rows, E = probe.store.stats.counts.shape
    counts = np.zeros((rows, E), np.int64)
    counts[:, 5] = 100  # expert 5 is the hottest everywhere
    counts[:, 2] = 50
    usage = tmp_path / ".coli_usage"
    write_usage(usage, counts, engine_id=7)
    eb = probe.store.expert_bytes
    tiers = TierConfig(
        device_bytes=3 * eb * rows, ram_bytes=eb * rows, pin_bytes=eb * rows, unified=False
    )
    model = load_model(d, tiers=tiers, usage_path=usage, progress=False)
    for s in model.store.slots:
        assert s.pinned.sum() == 1 and s.expert_in[s.pinned][0] == 5
    st = model.store.stats
    assert (st.tier[:, 5] == TIER_DEVICE).all() and (st.tier[:, 2] == TIER_RAM).all()
    assert (st.tier[:, [0, 1, 3]] == TIER_DISK).all()
    runner = Runner(model, capacity=64)
    batched_greedy(runner, [model.tokenizer.encode(PROMPTS[0])], steps=6)
    for s in model.store.slots:  # pins survive any amount of traffic
        assert s.expert_in[s.pinned][0] == 5
    runner.end_turn()
    saved = read_usage(usage, rows, E)
    assert (saved >= counts).all() and saved.sum() > counts.sum()
    assert usage.read_text().splitlines()[:2] == [f"-1 {rows} {E}", "-2 1 0"]


def test_repin_swaps_cold_pin_for_hot_expert(checkpoints, tmp_path):
    d = checkpoints("qwen3_moe")
    probe = load_model(d, progress=False)
    rows, E = probe.store.stats.counts.shape
    counts = np.zeros((rows, E), np.int64)
    counts[:, 1] = 3  # pinned at start, then never hot again
    usage = tmp_path / ".coli_usage"
    write_usage(usage, counts)
    eb = probe.store.expert_bytes
    tiers = TierConfig(device_bytes=2 * eb * rows, ram_bytes=0, pin_bytes=eb * rows, repin=2)
    model = load_model(d, tiers=tiers, usage_path=usage, progress=False)
    runner = Runner(model, capacity=64)
    batched_greedy(runner, [model.tokenizer.encode(p) for p in PROMPTS[:1]], steps=8)
    events = model.store.stats.take_repins()
    assert events, "a pin with 3 selections must lose to experts selected more often"
    counts_now = model.store.stats.counts
    for ev in events:
        assert 0 <= ev.layer < rows and 0 <= ev.expert < E and ev.old_tier in (0, 1, 2)
    for row, s in enumerate(model.store.slots):
        pinned = s.expert_in[s.pinned][0]
        unpinned = [e for e in range(E) if e != pinned]
        assert counts_now[row, pinned] >= max(counts_now[row, e] for e in unpinned) - 8


def test_on_the_cpu_experts_in_ram_are_computed_where_they_lie(checkpoints):
    """The CPU's device memory is host RAM: a RAM budget becomes device slots (no RAM tier, no
    copy into a slot), so all experts in RAM is the resident path itself; unified=False keeps a
    RAM tier staged into slots, as on a GPU. Both decode the resident tokens."""
    d = checkpoints("qwen3_moe")
    base = load_model(d, progress=False)
    prompts = [base.tokenizer.encode(p) for p in PROMPTS]
    reference = batched_greedy(Runner(base, slots=len(prompts), capacity=64), prompts)
    eb, layers = base.store.expert_bytes, len(base.cfg.moe_layer_ids)
    total = eb * layers * base.store.E
    for unified in (None, False):
        tiers = TierConfig(device_bytes=eb * layers, ram_bytes=total, unified=unified)
        model = load_model(d, tiers=tiers, progress=False)
        assert model.store.all_resident == (unified is None)
        assert model.store.plan.ram_bytes == (0 if unified is None else total)
        runner = Runner(model, slots=len(prompts), capacity=64)
        assert batched_greedy(runner, prompts) == reference
        if unified is None:  # nothing staged: every expert was read once, at load
            assert not hasattr(model.store, "slots")
        model.store.close()


def test_a_layer_reads_at_most_its_window_of_misses_at_once(checkpoints, monkeypatch):
    """With one reader thread the window is two: however many experts a layer misses (four
    conversations, every expert on disk, one slot a layer), no more than two are read and not
    yet placed at any time, and the tokens are the resident ones. Automatic budgets leave
    what the window holds out of the tiers (`read_reserve`)."""
    d = checkpoints("qwen3_moe")
    resident = load_model(d, progress=False)
    prompts = [resident.tokenizer.encode(p) for p in PROMPTS]
    want = batched_greedy(Runner(resident, slots=4, capacity=64), prompts)
    model = load_model(d, tiers=TierConfig(cap=1, ram_bytes=0, io_threads=1), progress=False)
    store = model.store
    assert store.read_window == 2 and not store.all_resident
    # buffers in flight and kept, experts read and not placed, as many read ahead by PILOT
    raw = store.disk.buffer_bytes(store.layer_ids[0], 0)
    assert store.read_reserve == 2 * (2 * raw + 2 * store.expert_bytes)
    started: set[tuple[int, int]] = set()
    most = []
    read_async, stage = store._read_async, store._stage

    def counted_read(row, e, urgent=True):
        started.add((row, e))
        most.append(len(started))
        return read_async(row, e, urgent)

    def counted_stage(row, slot, e, w):
        started.discard((row, e))
        return stage(row, slot, e, w)

    monkeypatch.setattr(store, "_read_async", counted_read)
    monkeypatch.setattr(store, "_stage", counted_stage)
    got = batched_greedy(Runner(model, slots=4, capacity=64), prompts)
    assert got == want
    assert max(most) == 2 and len(most) > 4 * store.read_window  # many misses, two at a time
