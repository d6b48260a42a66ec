"""`colibri engine`: build the engine from the environment, run the mux or legacy loop on stdio."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from colibri.config import load_config
from colibri.engine import lockstep
from colibri.engine.factory import default_ctx, make_runner, state_dir
from colibri.engine.kvstore import KVStore, fingerprint
from colibri.engine.scheduler import Scheduler, SchedulerConfig
from colibri.engine.settings import EngineSettings
from colibri.model import parallel
from colibri.serve import legacy, mux
from colibri.serve.stdio import LineWriter, claim_stdout
from colibri.tokenizer import Tokenizer

log = logging.getLogger("colibri")

TOPK = 5  # candidates per TOPK line


def run_engine(model_dir: str | Path, settings: EngineSettings) -> NoReturn:
    """Serve on stdin/stdout until input ends, then exit the process (status 0).

    An unloadable model raises ValueError/OSError before anything is served.
    """
    model_dir = Path(model_dir)
    parallel.simulate_cpu_devices(settings.devices)
    several = settings.processes > 1
    if several:
        if settings.warmup:
            raise ValueError("WARMUP=1 is not supported with PROCESSES > 1")
        lockstep.initialize(settings.coordinator, settings.processes, settings.process_id)
    cfg = load_config(model_dir)
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.exists():
        raise ValueError(f"{model_dir}: no tokenizer.json, the engine cannot encode prompts")
    tokenizer = Tokenizer(tok_path)
    out = LineWriter(claim_stdout())  # every process's; only process 0 writes to it
    ctx = settings.ctx or default_ctx(cfg.max_position_embeddings)
    runner = make_runner(model_dir, settings, ctx)
    if several:
        if not runner.store.all_resident:
            raise ValueError(
                f"PROCESSES={settings.processes}: every routed expert must be resident "
                f"({runner.store.summary()})"
            )
        if settings.process_id != 0:  # repeat process 0's calls; the protocol is its alone
            log.info("engine: process %d follows process 0", settings.process_id)
            lockstep.follow(runner)
            _exit(0)
        runner = lockstep.Leader(runner)
    sched = Scheduler(
        runner,
        tokenizer.token_bytes,
        SchedulerConfig(
            ngen=settings.ngen,
            seed=settings.seed,
            topk=TOPK if settings.serve_topk else 0,
            gates=_gates(settings),
            stop_ids=cfg.eos_token_ids,
            burst=settings.burst,
            burst_ms=settings.burst_ms,
            stream_ms=settings.stream_ms,
        ),
        kv_store=_kv_store(settings, model_dir),
    )
    restored = sched.restore()
    log.info(
        "engine: %s protocol, %d slots x %d positions%s",
        f"mux ({settings.wire} wire)" if settings.serve_batch else "legacy",
        settings.kv_slots,
        ctx,
        f", {restored} cached positions restored" if restored else "",
    )
    stdin = sys.stdin.buffer
    try:
        if settings.serve_batch:
            status = mux.serve(
                sched, tokenizer, settings.kv_slots, stdin, out, settings.wire, settings.warmup
            )
        else:
            status = legacy.serve(sched, tokenizer, settings.ngen, stdin, out)
    except KeyboardInterrupt:  # Ctrl-C in a terminal reaches the engine too (`colibri chat`)
        status = 130
    if several:
        runner.stop()
    _exit(status)


def _exit(status: int) -> NoReturn:
    """Leave without interpreter teardown: after SIGTERM the stdin reader thread is still blocked
    in a read that holds stdin's lock, and finalizing stdin under it aborts the process."""
    logging.shutdown()
    sys.stderr.flush()
    os._exit(status)


def _gates(settings: EngineSettings) -> int:
    """SERVE_GATES where a GATES line can go out: on the mux protocol's full wire. Elsewhere
    nothing is traced, so the steps stay the untraced programs (and bursts)."""
    if settings.serve_gates and not (settings.serve_batch and settings.wire == "full"):
        log.info("engine: SERVE_GATES=%d ignored (no GATES on this wire)", settings.serve_gates)
        return 0
    return settings.serve_gates


def _kv_store(settings: EngineSettings, model_dir: Path) -> KVStore | None:
    if not settings.kvsave:
        return None
    return KVStore(state_dir(model_dir, settings) / "kv", fingerprint(model_dir))
