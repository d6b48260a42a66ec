"""Expert calls replayed side by side: the routes a checkpoint's routers choose, recorded once,
then replayed on random weights of the same shapes by two or more versions of a call (two
kernel builds, or one build on two ways of holding the weights), taking turns step by step so
that all meet the same phases of a machine whose speed moves by a quarter within minutes."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from colibri import hugepages
from colibri.bench import anatomy
from colibri.bench.accounting import distinct_experts

STEPS = 24


def record_routes(ckpt: Path, rows: int, prompt_len: int = 128) -> np.ndarray:
    """[steps, layers, rows, top_k] slot ids the routers chose, greedy from the prompt, in
    `rows` conversations (anatomy.conversations, in as many slots) decoded in one burst."""
    from colibri.engine.model import load_model

    model = load_model(ckpt, progress=False)
    runner, firsts = anatomy.conversations(model, rows, STEPS, prompt_len, slots=rows)
    routes: list = []
    anatomy.decode_bursts(runner, firsts, prompt_len, STEPS, STEPS, routes)
    return np.asarray(routes)[:, :, :rows]


def alternate(
    calls: dict, step, steps: int, passes: int, before_pass=None
) -> dict[str, list[float]]:
    """ms a step of step(f, i) for i < steps, per pass. The versions take turns step by step
    (which goes first flips every step), so each pair of steps meets the same phase of the
    machine. `before_pass()`, where given, runs before each pass (bandwidth.PassProbe: a read
    of memory, whose rate says which phase the pass met)."""
    ms = {v: [] for v in calls}
    order = list(calls)
    for _ in range(passes):
        if before_pass:
            before_pass()
        spent = dict.fromkeys(calls, 0.0)
        for i in range(steps):
            for v in order if i % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                step(calls[v], i).block_until_ready()
                spent[v] += time.perf_counter() - t
        for v in calls:
            ms[v].append(spent[v] / steps * 1e3)
    return ms


def same_bits(outputs: dict) -> None:
    ref = next(iter(outputs.values()))
    for v, y in outputs.items():
        assert np.array_equal(np.asarray(y), np.asarray(ref)), f"{v}: outputs differ bitwise"


def weights(rng, *shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)


def on_huge_pages(a: jax.Array) -> jax.Array:
    """A copy of `a` on 2 MiB pages (colibri.hugepages), as the engine holds routed experts."""
    h = hugepages.empty(a.shape, a.dtype)
    h[:] = np.asarray(a)
    out = jax.device_put(h)
    assert out.unsafe_buffer_pointer() == h.ctypes.data, "JAX copied the array"
    return out


def compare(
    calls: dict,
    cfg,
    routes: np.ndarray,
    passes: int,
    hold: dict | None = None,
    weight_bytes: float = 4.0,
    exact: tuple[str, ...] | None = None,
    before_pass=None,
) -> dict:
    """Time every version on the routes, alternating; ms a step per pass for each version.
    `hold`: for some versions, where their copy of the weights is put (others: where XLA
    allocates them); by default every version's on huge pages, as in the engine.
    `weight_bytes`: bytes a weight takes as held, for the GB a step reads. `exact`: the
    versions whose outputs must agree bitwise (default: all). `before_pass`: as alternate's."""
    m = cfg.moe
    S, D, F, L = m.num_experts, cfg.hidden, m.moe_ff, routes.shape[1]
    rng = np.random.default_rng(0)
    layers = [
        (weights(rng, S, F, D), weights(rng, S, F, D), weights(rng, S, D, F)) for _ in range(L)
    ]
    x = jnp.asarray(rng.standard_normal((routes.shape[2], D), np.float32))
    ids = [[jnp.asarray(r, jnp.int32) for r in step] for step in routes]
    if hold is None:
        hold = dict.fromkeys(calls, on_huge_pages) if hugepages.enabled() else {}
    held = {
        v: [tuple(map(hold[v], layer)) for layer in layers] if v in hold else layers for v in calls
    }
    same_bits({v: f(*held[v][0], x, ids[0][0]) for v, f in calls.items() if v in (exact or calls)})

    def step(v, i):
        for layer, e in zip(held[v], ids[i], strict=True):
            y = calls[v](*layer, x, e)
        return y

    ms = alternate({v: v for v in calls}, step, len(ids), passes, before_pass)
    distinct = distinct_experts(routes)
    gb = sum(distinct) * 3 * D * F * weight_bytes / 1e9
    gflop = routes.shape[2] * m.top_k * L * 3 * D * F * 2 / 1e9
    return {"ms": ms, "gb_per_step": gb, "gflop_per_step": gflop, "distinct": distinct}


def dense_on_huge_pages(mats: list) -> list:
    """Copies of the matrices as the engine holds its dense weights: together in one mapping
    on huge pages (hugepages.hold), which JAX then uses without a copy."""
    return [jax.device_put(m) for m in hugepages.hold([np.asarray(m) for m in mats])]


def linear_params(cfg) -> int:
    """Weights of a step's linear calls: every layer's qkv and o projections, and lm_head."""
    q, kv = cfg.num_heads * cfg.head_dim, 2 * cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (q + kv + q) * cfg.hidden + cfg.vocab_size * cfg.hidden


def compare_linear(
    calls: dict,
    cfg,
    rows: int,
    passes: int,
    hold: dict | None = None,
    copies: int = 1,
    before_pass=None,
) -> dict:
    """The projections of every layer (qkv, o) and lm_head on `rows` rows, alternating; ms a
    step per pass for each version. `hold`: for each version, what it does to the list of
    random float32 matrices to hold them (quantize them, put them somewhere); by default
    every version's as the engine holds its dense weights (dense_on_huge_pages). Versions
    with the same `hold` share the held matrices. `copies`: distinct copies of a step's
    matrices, step i reading copy i (each version from its own offset in the cycle), so that
    they come from DRAM where one step's would stay in a large last-level cache.
    `before_pass`: as alternate's."""
    D, q = cfg.hidden, cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    rng = np.random.default_rng(0)

    def step_mats():
        mats = [
            w for _ in range(cfg.num_layers) for w in (weights(rng, q + kv, D), weights(rng, D, q))
        ]
        return [*mats, weights(rng, cfg.vocab_size, D)]

    sets = [step_mats() for _ in range(copies)]
    hold = hold or dict.fromkeys(calls, dense_on_huge_pages)
    by_hold = {f: [f(mats) for mats in sets] for f in set(hold.values())}
    held = {v: by_hold[hold[v]] for v in calls}
    offset = {v: k * copies // len(calls) for k, v in enumerate(calls)}
    x = jnp.asarray(rng.standard_normal((rows, D), np.float32))
    xq = jnp.asarray(rng.standard_normal((rows, q), np.float32))

    def program(f):  # one jitted step a version, as the engine's forward holds its calls
        def run(x, xq, mats):
            *layers, head = mats
            qkv, o = layers[0::2], layers[1::2]
            return [f(x, w) for w in qkv] + [f(xq, w) for w in o] + [f(x, head)]

        return jax.jit(run)

    steps = {v: program(f) for v, f in calls.items()}
    same_bits({v: run(x, xq, held[v][0])[-1] for v, run in steps.items()})

    def step(v, i):
        return steps[v](x, xq, held[v][(i + offset[v]) % copies])[-1]

    ms = alternate({v: v for v in calls}, step, STEPS, passes, before_pass)
    params = linear_params(cfg)
    nbytes = sum(a.nbytes for a in jax.tree.leaves(next(iter(held.values()))[0]))
    return {"ms": ms, "gb_per_step": nbytes / 1e9, "gflop_per_step": rows * params * 2 / 1e9}
