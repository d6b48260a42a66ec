"""The `colibri` command: generate, synth (and the engine, gateway and bench as they land)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("colibri")


def _generate(args: argparse.Namespace) -> int:
    import os

    from colibri.engine.generate import generate_ids
    from colibri.engine.model import load_model
    from colibri.engine.runner import Runner
    from colibri.formats import Holding

    model = load_model(args.model, tiers=_tiers(args), holding=Holding.from_env(os.environ))
    if model.tokenizer is None:
        raise ValueError(f"{args.model}: no tokenizer.json, cannot encode a text prompt")
    ids = model.tokenizer.encode(args.prompt)
    capacity = args.ctx or len(ids) + args.max_tokens
    runner = Runner(model, slots=1, capacity=capacity, profile=args.profile)
    out = sys.stdout.buffer
    for tok in generate_ids(
        runner,
        ids,
        args.max_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        stop_ids=model.cfg.eos_token_ids,
    ):
        out.write(model.tokenizer.token_bytes(tok))
        out.flush()
    out.write(b"\n")
    out.flush()
    st = model.store.stats
    log.info("hit %.1f%% of %d expert lookups; %s", st.hit_pct(), st.lookups, model.store.summary())
    return 0


def _add_tier_flags(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("expert tiers (default: the environment, else auto-sized)")
    t.add_argument("--device-gb", type=float, help="device slot caches, GiB (DEVICE_GB)")
    t.add_argument("--ram-gb", type=float, help="host RAM cache, GiB (RAM_GB)")
    t.add_argument("--pin-gb", type=float, help="pinned hot experts, GiB (PIN_GB)")
    t.add_argument("--cap", type=int, help="most device slots per layer (CAP)")
    t.add_argument("--policy", choices=["lru", "lfru"], help="device eviction (POLICY)")
    t.add_argument("--repin", type=int, help="swap a cold pin for a hot expert every n tokens")
    t.add_argument("--pilot", action="store_const", const=True, help="router lookahead (PILOT)")
    t.add_argument("--direct-io", action="store_const", const=True, help="O_DIRECT (DIRECT_IO)")
    t.add_argument("--profile", action="store_true", help="layer by layer, timing each phase")


def _tiers(args: argparse.Namespace):
    """The environment's tier settings, with the flags given in their place."""
    import dataclasses
    import os

    from colibri.experts.budget import TierConfig, gib_bytes

    given = {k: getattr(args, k) for k in ("cap", "policy", "repin", "pilot", "direct_io")}
    given |= {f"{n}_bytes": getattr(args, f"{n}_gb") for n in ("device", "ram", "pin")}
    given = {
        k: gib_bytes(v) if k.endswith("_bytes") else v for k, v in given.items() if v is not None
    }
    return dataclasses.replace(TierConfig.from_env(os.environ), **given)


def _synth(args: argparse.Namespace) -> int:
    from colibri.synth import SIZES, SynthSpec, synthesize, synthesize_config

    sizes = {k: getattr(args, k) for k in SIZES}
    layout = {k: getattr(args, k) for k in ("dtype", "fp8_block", "group")}
    common = dict(seed=args.seed, shard_mb=args.shard_mb)
    if args.config:
        if args.family:
            raise ValueError("--family with --config: the config's model_type is the family")
        path = synthesize_config(
            args.config, Path(args.out), sets=args.set, **layout, **sizes, **common
        )
    else:
        if args.set:
            raise ValueError("--set needs --config (it sets a field of that config.json)")
        given = {k: v for k, v in {**sizes, **layout}.items() if v is not None}
        spec = SynthSpec(family=args.family or SynthSpec.family, **given, **common)
        path = synthesize(spec, Path(args.out))
    print(path)
    return 0


def _engine(args: argparse.Namespace) -> int:
    import os

    from colibri.engine.settings import EngineSettings
    from colibri.serve.main import run_engine

    return run_engine(args.model, EngineSettings.from_env(os.environ))


def _gateway(args: argparse.Namespace) -> int:
    from colibri.gateway.server import run_gateway

    return run_gateway(args)


def _chat(args: argparse.Namespace) -> int:
    from colibri.chat import chat

    return chat(args.model, verbose=args.verbose)


def engine_main(argv: list[str] | None = None) -> int:
    """`colibri-engine [cap]`: the stdio engine launched as colibrì's C binary is, so that
    colibrì's own gateway can run it as its `--engine`: the model from SNAP (or --model), the
    per-layer expert cap as the one positional argument, every other setting from the same
    environment as `colibri engine`, and the `upstream` wire profile unless WIRE says otherwise.
    """
    import os

    p = argparse.ArgumentParser(prog="colibri-engine", description=engine_main.__doc__)
    p.add_argument("cap", nargs="?", type=int, help="most device slots per layer (CAP); 0: none")
    p.add_argument("--model", help="Hugging Face checkpoint folder (default: $SNAP)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    args = p.parse_args(argv)
    model = args.model or os.environ.get("SNAP", "").strip()
    if not model:
        p.error("no model: set SNAP or pass --model")
    if args.cap is not None and args.cap < 0:
        p.error(f"cap {args.cap}: expected 0 (no cap) or more")
    _logging(args.verbose)
    return _guarded(lambda: _run_upstream(model, args.cap))


def _run_upstream(model: str, cap: int | None) -> int:
    """The engine with the environment's settings, `upstream` unless WIRE says otherwise."""
    import dataclasses
    import os

    from colibri.engine.settings import EngineSettings
    from colibri.serve.main import run_engine

    settings = EngineSettings.from_env(os.environ, wire="upstream")
    if cap is not None:
        tiers = dataclasses.replace(settings.tiers, cap=cap)
        settings = dataclasses.replace(settings, tiers=tiers)
    return run_engine(model, settings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (text only on stdout)")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ctx", type=int, default=0, help="KV capacity (default: prompt + max)")
    _add_tier_flags(g)
    g.set_defaults(run=_generate)

    s = sub.add_parser("synth", help="write a random checkpoint in Hugging Face layout")
    s.add_argument(
        "--config",
        help="a real model's config.json (or its folder, e.g. data/configs/*.json): every field"
        " kept, the sizes given below override it",
    )
    s.add_argument("--family", help="without --config: qwen3_moe (default), ...")
    s.add_argument("--layers", type=int, help="default 4 (with --config: the config's)")
    s.add_argument("--experts", type=int, help="default 16")
    s.add_argument("--top-k", type=int, help="default 4")
    s.add_argument("--hidden", type=int, help="default 128")
    s.add_argument("--moe-ff", type=int, help="routed expert's intermediate size, default 64")
    s.add_argument("--vocab", type=int, help="default 512")
    s.add_argument("--heads", type=int, help="default hidden/64, at least 2")
    s.add_argument("--kv-heads", type=int, help="default heads/2 (--config: its grouping)")
    s.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="--config: set any field, VALUE in JSON (--set kv_lora_rank=32); repeatable",
    )
    s.add_argument(
        "--dtype",
        default=None,
        choices=["f32", "bf16", "f16", "fp8", "int4", "int8", "gptq4", "gptq8", "awq4"],
        help="fp8: linear weights block-quantized to float8_e4m3fn (DeepSeek-V3's layout); "
        "int4, int8: symmetric integers packed as compressed-tensors stores W4A16/W8A16; "
        "gptq4, gptq8: GPTQ's layout (qweight, qzeros, scales, g_idx), awq4: AutoAWQ's GEMM "
        "layout (zero points), the rest float16; default f32 (--config: its quantization_config"
        " when synth writes that layout, else its torch_dtype)",
    )
    s.add_argument("--fp8-block", type=int, help="--dtype fp8: block side (default 128)")
    s.add_argument(
        "--group", type=int, help="--dtype int*/gptq*/awq4: columns a scale (0: a row; 128)"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--shard-mb", type=float, default=512, help="safetensors shard size")
    s.add_argument("--out", required=True)
    s.set_defaults(run=_synth)

    e = sub.add_parser(
        "engine",
        help="the stdio engine: mux protocol with SERVE_BATCH=1, else legacy (settings from env)",
    )
    e.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    e.set_defaults(run=_engine)

    gw = sub.add_parser("gateway", help="OpenAI-compatible HTTP server over the mux engine")
    from colibri.gateway.server import add_arguments

    add_arguments(gw)
    gw.set_defaults(run=_gateway)

    c = sub.add_parser("chat", help="chat in the terminal with an engine on the legacy protocol")
    c.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    c.set_defaults(run=_chat)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _logging(args.verbose)
    return _guarded(lambda: args.run(args))


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("jax").setLevel(logging.WARNING)


def _guarded(run) -> int:
    """run()'s status; a bad setting or checkpoint is one line on stderr and status 2."""
    try:
        return run()
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError and bad arguments
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
