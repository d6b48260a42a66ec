"""Each engine in a process of its own inside a memory cgroup capped below the model's size,
from a cold page cache: the cgroup (v1 `memory.limit_in_bytes`, or v2 `memory.max`, made under
this process's own), the work one process does (colibri with automatic budgets, or llama.cpp on
a GGUF file with mmap on: a warm-up, the prompt, a sampled decode for speed, then greedy tokens
to compare), and the parent's side, which starts `python -m colibri.bench.capped`, watches the
cgroup and reads back what the worker wrote, whatever became of it (exit code, signal, OOM
kills): a worker that dies is an outcome, not an exception.

The llama.cpp worker imports neither JAX nor colibri's engine: what it holds is llama.cpp's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri import memlimit
from colibri.experts.budget import TierConfig

# Tier settings the engine would read from the environment: the workers run without them, so
# colibri's budgets are the automatic ones.
TIER_VARIABLES = TierConfig.VARIABLES
WARMUP_STEPS = 4  # decode steps of the warm-up conversation (compiles the decode programs)


# -- memory cgroups ---------------------------------------------------------------------------


@dataclass
class MemoryCgroup:
    """A memory cgroup this process made, capped at `limit` bytes."""

    path: Path
    v2: bool
    limit: int

    @classmethod
    def create(cls, name: str, limit: int) -> tuple[MemoryCgroup | None, str]:
        """A new cgroup `name` under this process's own memory cgroup, capped at `limit`; or
        None and why none could be made (v1 tried first where both are mounted)."""
        tried = []
        groups = sorted(memlimit.own_cgroups(), key=lambda g: g[2])  # v1 first
        for folder, _, v2 in groups:
            child = folder / name
            try:
                if v2:
                    if "memory" not in (folder / "cgroup.controllers").read_text().split():
                        raise OSError(f"no memory controller in {folder}/cgroup.controllers")
                    sub = folder / "cgroup.subtree_control"
                    if "memory" not in sub.read_text().split():
                        sub.write_text("+memory")
                    child.mkdir(exist_ok=True)
                    (child / "memory.max").write_text(str(limit))
                    swap = child / "memory.swap.max"
                    if swap.exists():
                        swap.write_text("0")
                else:
                    child.mkdir(exist_ok=True)
                    (child / "memory.limit_in_bytes").write_text(str(limit))
            except OSError as err:
                tried.append(f"cgroup {'v2' if v2 else 'v1'} under {folder}: {err}")
                try:
                    child.rmdir()
                except OSError:
                    pass
                continue
            return cls(child, v2, limit), ""
        return None, "; ".join(tried) or "this process is in no memory cgroup"

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def _stat(self) -> dict[str, int]:
        text = self._read("memory.stat") or ""
        pairs = (line.split() for line in text.splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}

    def usage(self) -> int:
        raw = self._read("memory.current" if self.v2 else "memory.usage_in_bytes")
        return int(raw) if raw and raw.strip().isdigit() else 0

    def peak(self) -> int | None:
        """Most bytes charged at once (page cache included); None where the kernel keeps no
        high-water mark (v2 before memory.peak)."""
        raw = self._read("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(raw) if raw and raw.strip().isdigit() else None

    def anon(self) -> int:
        """Anonymous memory charged now (the processes' own, not the page cache)."""
        st = self._stat()
        return st.get("anon", 0) if self.v2 else st.get("total_rss", st.get("rss", 0))

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.v2 else "memory.oom_control") or ""
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "oom_kill" and parts[1].isdigit():
                return int(parts[1])
        return 0

    def remove(self) -> None:
        """Kill what is left in it (only the worker this process started) and remove it."""
        for _ in range(50):
            pids = [int(p) for p in (self._read("cgroup.procs") or "").split()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# -- the page cache ---------------------------------------------------------------------------


def cached_fraction(files: list[Path]) -> float:
    """Share of the files' pages in the page cache now (mincore over a read-only mapping;
    nothing is read). NaN where mincore is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]  # fmt: skip
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return float("nan")
    page = os.sysconf("SC_PAGE_SIZE")
    total = cached = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return float("nan")
            try:
                n = -(-size // page)
                vec = (ctypes.c_ubyte * n)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return float("nan")
                cached += int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1))
                total += n
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return cached / total if total else 0.0


def read_ahead_kb(path: Path) -> int | None:
    """The read-ahead of the block device holding `path`, KiB (what a read fault on a mapped
    file, or a sequential read, brings in around it); None where sysfs does not say."""
    st = path.stat()
    dev = Path("/sys/dev/block") / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for queue in (dev / "queue", dev / ".." / "queue"):  # a disk, or a partition's disk
        try:
            return int((queue / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return None


def cold_cache(files: list[Path]) -> dict:
    """Forget the files' pages: write back what is dirty, drop them (posix_fadvise DONTNEED);
    where some stay cached and this process is root, drop the whole clean page cache too
    (/proc/sys/vm/drop_caches). What share of the pages remained cached, and how."""
    from colibri.experts.disk import drop_page_cache

    os.sync()
    drop_page_cache(files)
    left, how = cached_fraction(files), "posix_fadvise(DONTNEED) on the model's files"
    if not left < 0.01 and os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            left, how = cached_fraction(files), how + ", then vm.drop_caches=1"
        except OSError:
            pass
    return {"cached_after_drop": left, "how": how}


# -- in the worker process --------------------------------------------------------------------


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (read_bytes: bytes it caused to be read from
    storage, page faults on mapped files included; rchar: bytes its read calls returned)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    pairs = (line.split(":") for line in text.splitlines())
    return {k.strip(): int(v) for k, v in pairs if v.strip().isdigit()}


def vm_hwm_bytes() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Recorder:
    """The worker's result, written again (atomically) after each phase, so that a worker
    killed part-way leaves what it had measured and the phase it was in."""

    def __init__(self, out: Path):
        self.out, self.res = out, {"phase": "started"}
        self.write()

    def write(self, phase: str | None = None, **values) -> None:
        self.res.update(values)
        if phase:
            self.res["phase"] = phase
        self.res["vm_hwm_bytes"] = vm_hwm_bytes()
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.res, default=float))
        tmp.replace(self.out)


def _sample(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Temperature 1, no nucleus: colibri's sampler (colibri.engine.sampling), for both."""
    from colibri.engine.sampling import sample

    return sample(logits, 1.0, 1.0, rng)


def _per_token(before: dict, after: dict, tokens: int) -> dict:
    n = max(1, tokens)
    return {k: (after[k] - before[k]) / n for k in before if k in after and k != "t"}


def work_colibri(path: Path, spec: dict, rec: Recorder) -> None:
    """colibri with its automatic budgets (no tier settings): warm-up, then the prompt
    (TTFT) and `tokens` sampled decode steps, then `greedy` greedy tokens."""
    from colibri.engine.model import load_model
    from colibri.engine.runner import Row, Runner

    prompt, warm, tokens, greedy = spec["prompt"], spec["warm"], spec["tokens"], spec["greedy"]
    rec.write(available_at_start=memlimit.available(), limit_seen=memlimit.limit())
    t0 = time.perf_counter()
    model = load_model(path, progress=False)
    store, stats, disk = model.store, model.store.stats, model.store.disk
    runner = Runner(model, slots=3, capacity=len(prompt) + max(tokens, greedy) + 8)
    rec.write(
        "loaded",
        load_s=time.perf_counter() - t0,
        slots_per_layer=store.plan.slots_per_layer,
        ram_cache_bytes=store.plan.ram_bytes,
        experts_per_layer=store.E,
        moe_layers=len(store.layer_ids),
        expert_bytes_held=store.expert_bytes,
        expert_bytes_disk=store.disk.slab(store.layer_ids[0], 0).nbytes,
        all_resident=store.all_resident,
        held=str(np.dtype(store.held)),
    )

    t0 = time.perf_counter()
    logits, _ = runner.prefill(1, warm)  # compiles the prompt's programs: not the TTFT
    nxt = int(np.argmax(logits))
    for i in range(WARMUP_STEPS):
        logits, _ = runner.decode([Row(1, nxt, len(warm) + i)])
        nxt = int(np.argmax(logits[0]))
    rec.write("warmed", warmup_s=time.perf_counter() - t0)

    def snap() -> dict:
        return {
            "t": time.perf_counter(),
            "read_bytes": proc_io().get("read_bytes", 0),
            "store_bytes": disk.bytes_read,
            "reads": disk.reads,
            "lookups": stats.lookups,
            "hits": stats.hits,
            "misses": stats.misses,
            **runner.timers.snapshot(),
        }

    rng = np.random.default_rng(spec["seed"])
    s0 = snap()
    logits, _ = runner.prefill(0, prompt)
    sampled = [_sample(logits, rng)]
    s1 = snap()
    rec.write("prefilled", ttft_s=s1["t"] - s0["t"], prefill=_per_token(s0, s1, 1))
    routes = []
    for i in range(tokens):
        logits, r = runner.decode([Row(0, sampled[-1], len(prompt) + i)])
        routes.append(np.asarray(r).reshape(np.shape(r)[0], -1))  # [MoE layers, top-k]
        sampled.append(_sample(logits[0], rng))
    s2 = snap()
    per = _per_token(s1, s2, tokens)
    rec.write(
        "decoded",
        decode_s=s2["t"] - s1["t"],
        decode_tok_s=tokens / (s2["t"] - s1["t"]),
        decode=per,
        hit_pct=100.0 * (s2["hits"] - s1["hits"]) / max(1, s2["lookups"] - s1["lookups"]),
        sampled_tokens=sampled,
        **route_spread(np.stack(routes) if routes else np.zeros((0, 0, 0), np.int64)),
    )

    t0 = time.perf_counter()
    logits, _ = runner.prefill(2, prompt)
    out = [int(np.argmax(logits))]
    t1 = time.perf_counter()
    for i in range(greedy - 1):
        logits, _ = runner.decode([Row(2, out[-1], len(prompt) + i)])
        out.append(int(np.argmax(logits[0])))
    t2 = time.perf_counter()
    rec.write(
        "done",
        greedy_tokens=out,
        greedy_prefill_s=t1 - t0,
        greedy_tok_s=(greedy - 1) / (t2 - t1) if greedy > 1 else float("nan"),
        io_total=proc_io(),
    )


def route_spread(routes: np.ndarray) -> dict:
    """How far the sampled decode spread over the experts: routes [tokens, MoE layers, top-k].
    distinct_per_token: (layer, expert) pairs one token touches; distinct_per_layer_run: the
    experts of one layer the whole decode touched (mean over layers); reuse_pct: share of a
    token's pairs that the token before touched as well."""
    if routes.size == 0:
        return {}
    T, L, _ = routes.shape
    sets = [{(li, int(e)) for li in range(L) for e in routes[t, li]} for t in range(T)]
    reuse = [len(sets[t] & sets[t - 1]) / len(sets[t]) for t in range(1, T)]
    per_layer = [len(np.unique(routes[:, li])) for li in range(L)]
    return {
        "distinct_per_token": float(np.mean([len(s) for s in sets])),
        "distinct_per_layer_run": float(np.mean(per_layer)),
        "reuse_pct": 100.0 * float(np.mean(reuse)) if reuse else float("nan"),
    }


def work_llama(path: Path, spec: dict, rec: Recorder) -> None:
    """llama.cpp (llama-cpp-python) on the GGUF file, mmap on, the same steps as
    work_colibri: warm-up, the prompt (TTFT), sampled decode, greedy tokens. Unless
    spec["repack"], with llama.cpp's weight repacking off (`--no-repack`): on x86 it copies
    Q4_0 matrices into anonymous memory at load, so nothing of them stays mapped from the file
    and a model bigger than the memory cannot load."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    if not spec.get("repack", False):
        defaults = lib.llama_model_default_params

        def no_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        lib.llama_model_default_params = no_repack  # what Llama() starts its params from

    prompt, warm, tokens, greedy = spec["prompt"], spec["warm"], spec["tokens"], spec["greedy"]
    threads = os.cpu_count() or 1
    n_ctx = len(prompt) + max(tokens, greedy) + 8
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=max(512, n_ctx),
        n_threads=threads,
        n_threads_batch=threads,
        type_k=llama_cpp.GGML_TYPE_F32,  # an f32 KV cache, as colibri keeps
        type_v=llama_cpp.GGML_TYPE_F32,
        use_mmap=True,
        verbose=False,
    )
    vocab = llm.n_vocab()
    rec.write("loaded", load_s=time.perf_counter() - t0, jax_imported="jax" in sys.modules)

    def last() -> np.ndarray:
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(vocab,)).copy()

    t0 = time.perf_counter()
    llm.eval(list(warm))
    nxt = int(np.argmax(last()))
    for _ in range(WARMUP_STEPS):
        llm.eval([nxt])
        nxt = int(np.argmax(last()))
    llm.reset()  # the next eval starts at position 0 (eval drops the cache past it)
    rec.write("warmed", warmup_s=time.perf_counter() - t0)

    def snap() -> dict:
        return {"t": time.perf_counter(), "read_bytes": proc_io().get("read_bytes", 0)}

    rng = np.random.default_rng(spec["seed"])
    s0 = snap()
    llm.eval(list(prompt))
    sampled = [_sample(last(), rng)]
    s1 = snap()
    rec.write("prefilled", ttft_s=s1["t"] - s0["t"], prefill=_per_token(s0, s1, 1))
    for _ in range(tokens):
        llm.eval([sampled[-1]])
        sampled.append(_sample(last(), rng))
    s2 = snap()
    rec.write(
        "decoded",
        decode_s=s2["t"] - s1["t"],
        decode_tok_s=tokens / (s2["t"] - s1["t"]),
        decode=_per_token(s1, s2, tokens),
        sampled_tokens=sampled,
    )

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(list(prompt))
    out = [int(np.argmax(last()))]
    t1 = time.perf_counter()
    for _ in range(greedy - 1):
        llm.eval([out[-1]])
        out.append(int(np.argmax(last())))
    t2 = time.perf_counter()
    llm.close()
    rec.write(
        "done",
        greedy_tokens=out,
        greedy_prefill_s=t1 - t0,
        greedy_tok_s=(greedy - 1) / (t2 - t1) if greedy > 1 else float("nan"),
        io_total=proc_io(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description="one engine's capped run (started by run_capped)")
    ap.add_argument("--worker", required=True, choices=("colibri", "llama"))
    ap.add_argument("--path", required=True)
    ap.add_argument(
        "--spec", required=True, help="JSON: prompt, warm, tokens, greedy, seed (llama: repack)"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rec = Recorder(Path(args.out))
    work = work_colibri if args.worker == "colibri" else work_llama
    work(Path(args.path), json.loads(args.spec), rec)


# -- in the parent ----------------------------------------------------------------------------


def run_capped(
    kind: str,
    path: Path,
    spec: dict,
    *,
    cap: int | None,
    files: list[Path],
    work_dir: Path,
    label: str,
    timeout: float,
) -> dict:
    """One worker (`kind` "colibri" or "llama") on `path`, from a cold page cache for
    `files`, in a fresh memory cgroup capped at `cap` bytes (None: uncapped; where no cgroup
    can be made, uncapped, and the result says why). Returns what the worker recorded, with
    `outcome` ("ok", "OOM-killed", "killed by SIGSEGV", "exit code 1", "timeout"), the exit
    status, the cgroup's peak usage (page cache included), peak anonymous memory (polled) and
    OOM kill count, and the tail of the worker's log when it failed."""
    work_dir.mkdir(parents=True, exist_ok=True)
    out, log_path = work_dir / f"{label}.json", work_dir / f"{label}.log"
    out.unlink(missing_ok=True)
    group, why = (None, "no cap asked for")
    if cap is not None:
        group, why = MemoryCgroup.create(f"colibri-bench-{os.getpid()}-{label}", cap)
    cache = cold_cache(files)
    cmd = [sys.executable, "-m", "colibri.bench.capped", "--worker", kind, "--path", str(path)]
    cmd += ["--spec", json.dumps(spec), "--out", str(out)]
    if group is not None:  # the shell joins the cgroup, then becomes the worker
        cmd = ["sh", "-c", f'echo $$ > {shlex.quote(str(group.procs))} && exec "$@"', "sh", *cmd]
    env = {k: v for k, v in os.environ.items() if k not in TIER_VARIABLES}
    peak_anon, last_io, timed_out = 0, 0, False
    t0 = time.perf_counter()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            while proc.poll() is None:
                if group is not None:
                    peak_anon = max(peak_anon, group.anon())
                try:  # the worker's read_bytes so far, for a worker that is killed
                    io = Path(f"/proc/{proc.pid}/io").read_text()
                    last_io = int(io.split("read_bytes:")[1].split()[0])
                except (OSError, IndexError, ValueError):
                    pass
                if time.perf_counter() - t0 > timeout:
                    timed_out = True
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.2)
        rc = proc.returncode
        res = json.loads(out.read_text()) if out.exists() else {"phase": "not started"}
        oom = group.oom_kills() if group is not None else 0
        peak = group.peak() if group is not None else None
    finally:
        if group is not None:
            group.remove()
    if timed_out:
        outcome = "timeout"
    elif rc == 0 and res.get("phase") == "done":
        outcome = "ok"
    elif oom and rc == -signal.SIGKILL:
        outcome = "OOM-killed"
    elif rc is not None and rc < 0:
        outcome = f"killed by {signal.Signals(-rc).name}"
    else:
        outcome = f"exit code {rc}"
    res.update(
        outcome=outcome,
        returncode=rc,
        wall_s=time.perf_counter() - t0,
        capped=group is not None,
        cgroup=str(group.path) if group is not None else None,
        cgroup_version=(2 if group.v2 else 1) if group is not None else None,
        uncapped_why=None if group is not None else why,
        cap_bytes=cap,
        cgroup_peak_bytes=peak,
        cgroup_peak_anon_bytes=peak_anon if group is not None else None,
        oom_kills=oom,
        read_bytes_seen=last_io,
        cold=cache,
    )
    if outcome != "ok":
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        res["log_tail"] = tail
    return res


if __name__ == "__main__":
    main()
