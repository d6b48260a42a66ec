"""The engine's telemetry in the JSON shapes the gateway serves: those colibrì's own gateway
gives (its web UI reads them), plus arrays this project's page draws."""

from __future__ import annotations

from colibri.protocol.codec import Hits, HwInfo, Prof, Repin, Tiers
from colibri.protocol.session import Telemetry


def experts_json(t: Telemetry) -> dict:
    """`{rows, cols, map, hits, seq, ...}` with `map` and `hits` as the hex strings colibrì's
    web UI reads (the EMAP bytes; the HITS bitmap, bit `i & 7` of byte `i >> 3`), the same as
    [rows][cols] lists in `map_grid` and `hits_grid`, and `gpus`, `entropy`, `repin`, `tiers`."""
    rows, cols = (t.emap.rows, t.emap.cols) if t.emap else (0, 0)
    emap = t.emap.data if t.emap else b""
    hits = t.hits
    if hits is None or (hits.rows, hits.cols) != (rows, cols):
        hits = Hits(rows, cols, bytes((rows * cols + 7) // 8))
    return {
        "rows": rows,
        "cols": cols,
        "map": emap.hex(),
        "hits": hits.bits.hex(),
        "map_grid": [list(emap[r * cols : (r + 1) * cols]) for r in range(rows)],
        "hits_grid": [[int(hits.hit(r, c)) for c in range(cols)] for r in range(rows)],
        "seq": t.seq,
        "gpus": [gpu_json(d) for d in (t.gpus.devices if t.gpus else ())],
        "entropy": list(t.entropy.values) if t.entropy else [],
        "repin": [repin_json(r) for r in t.repins],
        "tiers": tiers_json(t.tiers),
    }


def profile_json(t: Telemetry) -> dict:
    """`{seq, turns}`: the recent turns' PROF timings, oldest first, as colibrì names them."""
    return {"seq": t.profile_seq, "turns": [prof_json(p) for p in t.profile]}


def prof_json(p: Prof) -> dict:
    return {
        "wall_s": p.wall_s,
        "prompt_tokens": p.prompt_tokens,
        "completion_tokens": p.completion_tokens,
        "expert_disk_s": p.edisk_s,
        "expert_wait_s": p.ewait_s,
        "expert_matmul_s": p.emm_s,
        "attention_s": p.attn_s,
        "lm_head_s": p.head_s,
        "forwards": p.forwards,
    }


def hwinfo_json(h: HwInfo | None) -> dict | None:
    if h is None:
        return None
    return {
        "cores": h.cores,
        "ram_total_gb": h.ram_total_gb,
        "ram_avail_gb": h.ram_avail_gb,
        "gpus": h.ngpu,
        "vram_total_gb": h.vram_total_gb,
        "cpu": h.cpu_name,
        "gpu": h.gpu_name,
    }


def gpu_json(d: tuple[float, float, int]) -> dict:
    return {"used_gb": d[0], "total_gb": d[1], "experts": d[2]}


def repin_json(r: Repin) -> dict:
    return {"layer": r.layer, "expert": r.expert, "old_tier": r.old_tier, "gpu": r.gpu}


def tiers_json(t: Tiers | None) -> dict | None:
    if t is None:
        return None
    return {"vram": t.vram, "ram": t.ram, "disk": t.disk, "vram_gb": t.vram_gb, "ram_gb": t.ram_gb}
