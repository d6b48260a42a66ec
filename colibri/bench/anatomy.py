"""Where a decode step's time goes: the engine's decode bursts profiled with jax.profiler and
read back op by op against the compiled program (experiments/step_anatomy.py).

Every op XLA runs shows in the profile as one event named after its HLO op; the compiled
program's text (XLA's dump, `--xla_dump_to`) says which of them are colibri's kernels, which
kernel, and over what weights. A run of the program is one burst; the ops of its loop's body
run once a step (`colibri_cut_requested`, in the loop's condition, marks a decode burst).
What a step spends, then: each kernel's calls (by kernel and weight shape), XLA's own ops
between them, the time no op runs (the executor going from one op to the next), and the time
between bursts (the host reading a burst's tokens and dispatching the next one)."""

from __future__ import annotations

import gzip
import json
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "u16": 2, "s16": 2, "u8": 1, "s8": 1}
CUT = "colibri_cut_requested"
XLA_OPS = "XLA's ops"

_CALL = re.compile(r'^\s*%?(?P<op>[\w.-]+) = .*custom_call_target="(?P<target>colibri_\w+)"')
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclass(frozen=True)
class Kernel:
    """One of colibri's kernel calls in the compiled program: the target, a label (the kind of
    call and its weights' shape), the bytes of weights one call reads (experts: one expert's
    gate, up and down rows; None where the call reads no weights) and its multiply-adds' FLOPs
    (of the rows the program holds, padding rows too; experts: every row's every chosen
    expert, as the ids operand holds them)."""

    target: str
    label: str
    weight_bytes: float | None
    flops: float | None = None


def operand_shapes(constraints: str) -> list[tuple[str, tuple[int, ...]]]:
    """`f32[1,768]{1,0}, f32[1280,768]{1,0}` -> [("f32", (1, 768)), ("f32", (1280, 768))]."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE.findall(constraints)
    ]


def _nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    n = BYTES[dtype]
    for d in dims:
        n *= d
    return n


def _constraints(line: str) -> str:
    """The text inside `operand_layout_constraints={...}` (shapes carry braces of their own)."""
    start = line.find("operand_layout_constraints={")
    if start < 0:
        return ""
    i = start + len("operand_layout_constraints=")
    depth = 0
    for j in range(i, len(line)):
        depth += {"{": 1, "}": -1}.get(line[j], 0)
        if depth == 0:
            return line[i + 1 : j]
    return ""


def kernel_calls(hlo_text: str) -> dict[str, Kernel]:
    """The colibri kernel calls of a compiled program's text (XLA's after-optimizations dump),
    by HLO op name."""
    calls = {}
    for line in hlo_text.splitlines():
        m = _CALL.match(line)
        if not m:
            continue
        target, ops = m["target"], operand_shapes(_constraints(line))
        for base in ("colibri_linear", "colibri_moe_experts"):
            if target.startswith(base):
                held = target.removeprefix(base).lstrip("_")
                held = f" ({held} rows)" if held else ""
                break
        flops = None
        if target.startswith("colibri_linear_heads"):  # MLA's per-head products of kv_b's rows
            (rows, heads, inputs), (dtype, (_, per_head, cols)) = ops[0][1], ops[1]
            first = re.search(r"first = (\d+)", line)
            read = inputs if target.endswith("_t") else per_head - int(first[1] if first else 0)
            label = f"{target.removeprefix('colibri_')} [{heads} x {read}, {cols}]"
            weight = float(_nbytes(dtype, (heads, read, cols)))
            flops = 2.0 * rows * heads * read * cols
        elif target.startswith("colibri_linear"):
            dtype, dims = ops[1]
            rows, inputs = ops[0][1]
            label = f"linear [{dims[0]}, {inputs}]{held}"
            weight = float(_nbytes(dtype, dims))
            flops = 2.0 * rows * dims[0] * inputs
        elif target.startswith("colibri_moe_experts"):
            label = f"routed experts{held}"
            weight = sum(_nbytes(dt, dims) / dims[0] for dt, dims in ops[:3])
            (rows, hidden), (_, chosen) = ops[3][1], ops[4][1]
            ff = ops[0][1][1]  # gate [E, F, D as held]: F rows of D inputs
            flops = 2.0 * rows * chosen * 3 * ff * hidden
        elif target in ("colibri_attend", "colibri_attend_write", "colibri_mla_attend"):
            label, weight = "attention", None
        elif target == "colibri_rms_norm":
            label, weight = "RMSNorm", None
        elif target == "colibri_route_softmax":
            label, weight = "router's choice", None
        elif target == "colibri_greedy":
            label, weight = "greedy choice", None
        elif target == CUT:
            label, weight = "cut check", None
        else:
            label, weight = target, None
        calls[m["op"]] = Kernel(target, label, weight, flops)
    return calls


def load_trace(trace_dir: Path) -> list[dict]:
    """The complete events of the newest perfetto trace jax.profiler wrote under trace_dir
    (`jax.profiler.trace(dir, create_perfetto_trace=True)`)."""
    traces = sorted(
        Path(trace_dir).glob("**/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime
    )
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(traces[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


@dataclass
class Part:
    """What one kind of work costs a step: µs, and for kernel calls how many and what they read."""

    us: float = 0.0
    calls: float = 0.0
    weight_bytes: float | None = None  # per call
    flops: float | None = None  # per call


@dataclass
class Anatomy:
    steps: int
    runs: int
    parts: dict[str, Part]  # per step: kernels by label, XLA's ops
    between_ops_us: float  # per step: no op running within a burst
    between_bursts_us: float  # per step: from one burst's last op to the next one's first
    # (the mean of those gaps, once a burst)
    overlap_us: float  # per step: ops running at once (counted twice in the parts)
    xla_ops: dict[str, float]  # per step: µs of each of XLA's own ops, by HLO op name

    @property
    def step_us(self) -> float:
        return (
            sum(p.us for p in self.parts.values())
            + self.between_ops_us
            + self.between_bursts_us
            - self.overlap_us
        )


def anatomy(events: list[dict], calls: dict[str, Kernel], module: str) -> Anatomy:
    """The per-step anatomy of every run of `module` (a jitted function's HLO module name, as
    the profile gives it: jit__decode_burst) in a trace's events."""
    runs: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        args = e.get("args", {})
        if args.get("hlo_module") == module and "hlo_op" in args and "run_id" in args:
            runs[args["run_id"]].append((float(e["ts"]), float(e["dur"]), args["hlo_op"]))
    if not runs:
        raise ValueError(f"no op of {module} in the trace")
    ordered = sorted(runs.values(), key=lambda ops: min(t for t, _, _ in ops))
    cut = {op for op, k in calls.items() if k.target == CUT}
    totals: dict[str, Part] = {}
    xla_ops: Counter[str] = Counter()
    steps = between_ops = between_bursts = overlap = 0.0
    gaps = 0
    last_end = None
    for ops in ordered:
        ops.sort()
        # Control flow (a while loop's op) spans the ops it runs: not an op of its own.
        ops[:] = [
            o
            for o, nxt in zip(ops, [*ops[1:], None], strict=True)
            if nxt is None or nxt[0] + nxt[1] > o[0] + o[1]
        ]
        # Each op of the loop's body runs once a step (the cut check, in its condition, once
        # more): the steps of a run are the runs of its most frequent other kernel call.
        seen = Counter(op for _, _, op in ops if op in calls and op not in cut)
        if not seen or not any(op in cut for _, _, op in ops):
            raise ValueError(f"a run of {module} without kernel calls and a {CUT} call")
        n = max(seen.values())
        busy, end = 0.0, None  # the union of the ops' intervals
        for t, d, op in ops:
            kernel = calls.get(op)
            label = kernel.label if kernel else XLA_OPS
            part = totals.setdefault(
                label,
                Part(
                    weight_bytes=kernel.weight_bytes if kernel else None,
                    flops=kernel.flops if kernel else None,
                ),
            )
            part.us += d
            part.calls += 1
            if kernel is None:
                xla_ops[op] += d
            if end is None or t >= end:
                busy += d
                end = t + d
            elif t + d > end:
                busy += t + d - end
                end = t + d
        start = ops[0][0]
        between_ops += (end - start) - busy
        overlap += sum(d for _, d, _ in ops) - busy
        if last_end is not None:
            between_bursts += start - last_end
            gaps += 1
        last_end = end
        steps += n
    for part in totals.values():
        part.us /= steps
        part.calls /= steps
    return Anatomy(
        steps=int(steps),
        runs=len(ordered),
        parts=totals,
        between_ops_us=between_ops / steps,
        # a gap before every burst (the mean of those between the runs), over its steps
        between_bursts_us=between_bursts / gaps * len(ordered) / steps if gaps else 0.0,
        overlap_us=overlap / steps,
        xla_ops={op: us / steps for op, us in xla_ops.most_common()},
    )


AGREE = 0.9  # reads before and after a round this close agree


def steady_reads(rnd: dict) -> bool:
    """Whether the reads before and after a round (its "read_gb_s") agree. Where they do not,
    the machine's memory (which moved between ~30 and ~60 GB/s within seconds on the machines
    measured) changed during the round; where they do, it may still have moved in between."""
    return min(rnd["read_gb_s"]) >= AGREE * max(rnd["read_gb_s"])


def decode_arguments(ap, rounds: int, out: str) -> None:
    """The arguments of the experiments that time decode steps (step_anatomy.py,
    call_trace.py): --shapes, --ckpt, --rows, --tokens, --prompt, --rounds, --out."""
    from colibri.bench.shapes import SHAPES

    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument(
        "--ckpt",
        type=Path,
        action="append",
        help="a checkpoint folder instead of the peers shapes (again for more than one)",
    )
    ap.add_argument("--rows", type=int, default=1, help="conversations decoding at once")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--out", default=out)


def checkpoints(args) -> dict[str, Path]:
    """{name: folder} of decode_arguments' --ckpt folders, else of its --shapes' f32
    checkpoints (made if missing)."""
    from colibri.bench.shapes import ensure_inputs

    if args.ckpt:
        return {c.name: c for c in args.ckpt}
    return {n: ensure_inputs(n)["colibri"] for n in args.shapes.split(",")}


def conversations(
    model, rows: int, tokens: int, prompt_len: int, slots: int | None = None
) -> tuple:
    """(runner, firsts): a Runner with room for `rows` conversations of the prompt and
    `tokens` more (in `slots` slots, by default 16 or `rows`, the more), conversation 0
    prefilled with the peers benchmark's prompt and the others sharing all but its last 8
    tokens (conversations.other_conversations), and each one's first greedy token, for
    decode_bursts."""
    import numpy as np

    from colibri.bench.conversations import other_conversations, prompt_ids
    from colibri.engine.runner import Runner

    prompt = prompt_ids(model.cfg.vocab_size, prompt_len)
    runner = Runner(model, slots=slots or max(16, rows), capacity=prompt_len + tokens + 8)
    logits, _ = runner.prefill(0, prompt)
    firsts = [int(np.argmax(logits))]
    if rows > 1:
        firsts += other_conversations(runner, prompt, rows)
    return runner, firsts


def decode_bursts(
    runner,
    firsts: list[int],
    start: int,
    n: int,
    burst: int,
    routes: list | None = None,
    tokens: list | None = None,
    stream_ms: float | None = None,
) -> float:
    """n greedy steps of slots 0..len(firsts)-1 from position `start` (their tokens there:
    `firsts`), in cuttable bursts of up to `burst` steps, the next dispatched when one lands,
    as the engine decodes greedy requests (Scheduler._burst); tok/s of all rows together.
    `routes`: a list that gets each step's routes ([n_moe, B, K]; the wait is timed too);
    `tokens`: one that gets each step's greedy tokens [B]. `stream_ms`: as the engine's
    STREAM_MS, no burst longer than the last one's steps say fit in it (the first two steps,
    which the engine runs one a forward with no step time yet, one burst: the profiled steps
    all come from one program); None: every burst `burst` steps (but the last)."""
    from colibri.engine.runner import Row

    toks, done, step_s = list(firsts), 0, None
    t = time.perf_counter()
    while done < n:
        at = [Row(s, tok, start + done) for s, tok in enumerate(toks)]
        k = min(burst, n - done)  # (the last as long as the steps left: one program, `most`)
        if stream_ms is not None:
            k = min(k, max(1, int(stream_ms / 1e3 / step_s)) if step_s else 2)
        sent = time.perf_counter()
        fwd = runner.decode_async(at, steps=k, cuttable=k > 1, most=burst)
        if routes is not None:
            got = fwd.result()[1]
            routes += [got] if fwd.steps == 1 else list(got)
        greedy = fwd.tokens()
        if tokens is not None:
            tokens += greedy.tolist()
        step_s = (time.perf_counter() - sent) / fwd.ran()
        toks, done = greedy[-1].tolist(), done + fwd.ran()
    return len(firsts) * done / (time.perf_counter() - t)


def profile(fn, trace_dir: Path) -> list[dict]:
    """Run fn() under jax.profiler; the trace's complete events."""
    import jax

    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        fn()
    return load_trace(trace_dir)
