"""`colibri gateway`: check the bind, start the engine subprocesses (one per replica), serve
HTTP with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from dataclasses import replace
from pathlib import Path

from colibri.engine.settings import EngineSettings
from colibri.gateway.settings import DEFAULT_EXPERTS_JSON, DEFAULT_WEB, GatewaySettings, is_loopback

log = logging.getLogger("colibri.gateway")

API_KEY_ENV = "COLIBRI_API_KEY"  # keeps the key out of the process list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--kv-slots", type=int, default=4, help="conversations each engine decodes at once (1-16)"
    )
    p.add_argument(
        "--max-queue", type=int, default=None, help="waiting requests per replica (2*slots)"
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine subprocesses, each with its own KV slots; conversations keep theirs",
    )
    p.add_argument("--api-key", default=None, help=f"required Bearer key (or ${API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, help="a file holding the key (not in ps)")
    p.add_argument("--ctx", type=int, default=None, help="positions per KV slot (engine CTX)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="request body cap, bytes")
    p.add_argument("--name", default=None, help="model id to serve (default: folder name)")
    p.add_argument("--web", default=str(DEFAULT_WEB), help="static site folder ('' = none)")
    p.add_argument("--experts-json", default=str(DEFAULT_EXPERTS_JSON), help="/experts.json file")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for READY")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a whole request once begun (then 408, closed)",
    )


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    model = Path(args.model)
    if not model.is_dir():
        raise ValueError(f"--model {model}: not a folder")
    return GatewaySettings(
        model_dir=model,
        model_id=args.name or model.resolve().name,
        kv_slots=args.kv_slots,
        max_waiting=2 * args.kv_slots if args.max_queue is None else args.max_queue,
        replicas=args.replicas,
        api_key=_api_key(args),
        max_body=args.max_body,
        web_root=Path(args.web) if args.web else None,
        experts_json=Path(args.experts_json) if args.experts_json else None,
        bind_host=args.host,
        request_timeout=args.request_timeout,
    )


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else the environment's; None: none."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        lines = Path(args.api_key_file).read_text().splitlines()
        return (lines[0].strip() if lines else "") or None
    return os.environ.get(API_KEY_ENV) or None


def run_gateway(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. A non-loopback bind without a key is refused (ValueError:
    the CLI prints it and exits 2) before anything starts."""
    settings = settings_from_args(args)
    if not is_loopback(args.host) and settings.api_key is None:
        raise ValueError(
            f"refusing to bind {args.host}, which is not a loopback address, without an API key:"
            f" pass --api-key or --api-key-file (or set ${API_KEY_ENV}), or bind 127.0.0.1"
        )
    return asyncio.run(_serve(settings, args))


async def _serve(settings: GatewaySettings, args: argparse.Namespace) -> int:
    import uvicorn

    from colibri.gateway.app import create_app
    from colibri.gateway.deadline import deadline_protocol
    from colibri.gateway.engine_client import EngineClient
    from colibri.gateway.replicas import replica_env, replica_settings
    from colibri.gateway.schema import ApiError

    # the environment's engine settings, the slots and context the gateway was given
    engine_settings = replace(EngineSettings.from_env(os.environ), kv_slots=settings.kv_slots)
    if args.ctx:
        engine_settings = replace(engine_settings, ctx=args.ctx)
    n = settings.replicas
    engines = [
        EngineClient.for_model(
            settings.model_dir,
            replica_settings(engine_settings, settings.model_dir, i, n),
            env=replica_env(engine_settings, i, n),
            name="the engine" if n == 1 else f"replica {i}",
        )
        for i in range(n)
    ]
    supervisors: list[asyncio.Task] = []
    try:
        await asyncio.gather(*(e.start(timeout=args.start_timeout) for e in engines))
        supervisors = [asyncio.create_task(e.supervise(args.start_timeout)) for e in engines]
        app = create_app(engines, settings)
        level = "info" if log.isEnabledFor(logging.DEBUG) else "warning"
        late = f"the request did not arrive whole within {settings.request_timeout:g} s"
        late_body = ApiError(408, late, code="request_timeout").body()
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=level,
            timeout_graceful_shutdown=5,
            http=deadline_protocol(settings.request_timeout, late_body),  # half-sent: 408
        )
        server = uvicorn.Server(config)
        log.info(
            "gateway: %s on http://%s:%d%s",
            settings.model_id,
            args.host,
            args.port,
            f" ({n} replicas)" if n > 1 else "",
        )
        _absorb_resent_signals()
        await server.serve()
        return 0 if server.started else 1
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        for supervisor in supervisors:  # (each restarts its engine when it is lost)
            supervisor.cancel()
        await asyncio.gather(*(e.close() for e in engines))


def _absorb_resent_signals() -> None:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-sends the signal to the handler
    it found; make that one a no-op, so the engine is still closed and the status is 0."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
