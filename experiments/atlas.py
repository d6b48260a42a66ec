"""nice -n 10 python experiments/atlas.py

The expert atlas of the demo model: which topics (corpus domains) each routed expert serves,
whether that holds up across probes, and where each expert sits in a 3-D map. One command
regenerates everything: the probes (`data/atlas/probes.json`, from the held-out corpus when
`data/corpus` is there; otherwise the committed file is used as it is) and the atlas
(`data/experts.json`; its `schema` and `method` fields document every field). The same model and
probes give the same bytes: keys sorted, floats rounded to 6 decimals, no timestamps.

Probes: 11 topics x 6 snippets of 200-400 bytes of each domain's `heldout.txt`, spread evenly
over the file (text, file and byte offset stored). Each probe runs alone through the engine's
`Runner` in this process (`colibri.analysis.RouteTracer`; the stdio engine runs the same code
but reports routing per turn only, as entropy and a heat map, too coarse for per-expert
counts): prefill only, greedy, from an empty KV slot, with usage counters zeroed per probe and
checked against the probe's routes. Per expert: selection counts per (topic, probe), p(topic |
expert) with each topic's counts divided by its tokens, specialisation 1 - H/log C, top topic,
lift over 1/C, and reliability (share of the top topic's probes in which it fires, i.e. is
chosen at >= 2x its mean per-token rate; replicated if >= 2). Leave-one-probe-out: each probe's
topic is guessed from the other probes' per-topic usage profiles (cosine, centred). Positions:
spectral embedding of the co-activation graph. Prints a table per topic, the top specialists,
and ends with the leave-one-probe-out accuracy.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from colibri import atlas
from colibri.bench.atlas_files import CORPUS, MODEL, OUT, PROBES, TOPICS, regenerate


def topic_table(a: dict) -> pd.DataFrame:
    df = atlas.experts_frame(a)
    spec = (df.spec >= a["method"]["specialist_spec"]) & df.replicated
    lopo = np.asarray(a["lopo"]["confusion"])
    rows = []
    for c, cat in enumerate(a["categories"]):
        best = df[(df.top == cat) & df.replicated].sort_values("spec", ascending=False).head(1)
        rows.append(
            {
                "topic": cat,
                "probes": len(a["probes"]["ids"][c]),
                "tokens": a["probes"]["tokens"][c],
                "lopo_correct": f"{lopo[c, c]}/{lopo[c].sum()}",
                "confused_with": ", ".join(
                    f"{a['categories'][j]} {lopo[c, j]}" for j in np.flatnonzero(lopo[c]) if j != c
                ),
                "replicated_specialists": int((spec & (df.top == cat)).sum()),
                "best": "" if best.empty else f"L{best.layer.iat[0]}/E{best.expert.iat[0]}",
                "best_spec": np.nan if best.empty else best.spec.iat[0],
            }
        )
    return pd.DataFrame(rows).set_index("topic")


def report(a: dict) -> None:
    pd.set_option("display.width", 160)
    pd.set_option("display.max_columns", 20)
    print("\nper topic: leave-one-probe-out, replicated specialists, the most specialised one")
    print(topic_table(a).round(3).to_string())
    df = atlas.experts_frame(a)
    cols = ["layer", "expert", "total", "spec", "top", "lift", "reliability", "replicated"]
    print("\nmost specialised experts")
    print(df.sort_values("spec", ascending=False)[cols].head(12).round(3).to_string(index=False))
    s = a["summary"]
    print(
        f"\nspecialists (spec >= {a['method']['specialist_spec']}): {s['specialists']}; "
        f"replicated: {s['replicated']}; replicated specialists: "
        f"{s['replicated_specialists']} (shuffled topic labels: "
        f"{s['replicated_specialists_shuffled']:.2f})"
    )
    print(
        f"3-D layout: nearest expert shares the top topic for "
        f"{s['position_neighbour_same_top']:.0%} of replicated specialists "
        f"(chance {s['position_neighbour_chance']:.0%})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--corpus", default=CORPUS)
    ap.add_argument("--probes", default=PROBES)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--topics", nargs="+", default=TOPICS)
    ap.add_argument("--per-topic", type=int, default=6)
    ap.add_argument("--decode", type=int, default=0, help="greedy tokens after each prefill")
    ap.add_argument("--keep-probes", action="store_true", help="use --probes as it is")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    args = ap.parse_args(argv)

    a = regenerate(
        args.model,
        args.corpus,
        args.probes,
        args.out,
        topics=args.topics,
        per_topic=args.per_topic,
        decode=args.decode,
        keep_probes=args.keep_probes,
        progress=not args.quiet,
    )
    if not args.quiet:
        report(a)
    lo = a["lopo"]
    print(
        f"leave-one-probe-out topic accuracy: {lo['correct']}/{lo['total']} = "
        f"{lo['accuracy']:.1%} (chance {lo['chance']:.1%}, {len(a['categories'])} topics)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
