"""The expert atlas's files, made again: the probes (data/atlas/probes.json, chosen from the
held-out corpus when it is there) and the atlas (data/experts.json). experiments/atlas.py runs
this from the command line; tests/test_atlas.py checks that it writes the same bytes twice."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from colibri import atlas

ROOT = Path(__file__).resolve().parents[2]
TOPICS = "python c javascript shell licenses manpages english german spanish italian french".split()
MODEL = "data/models/demo"
CORPUS = "data/corpus"
PROBES = "data/atlas/probes.json"
OUT = "data/experts.json"


def probes_for(
    corpus: str, probes: str, topics: list[str], per_topic: int, keep_probes: bool
) -> list[atlas.Probe]:
    """Select the probes from the corpus (and write them) or read the committed file."""
    corpus = Path(corpus)
    have_corpus = all((corpus / t / "heldout.txt").exists() for t in topics)
    if keep_probes or not have_corpus:
        if not Path(probes).exists():
            sys.exit(f"no {probes} and no corpus: python experiments/corpus.py --out {corpus}")
        chosen, _ = atlas.load_probes(probes)
        if have_corpus:
            stale = [p.id for p in chosen if not atlas.check_probe(p, corpus)]
            if stale:
                print(f"warning: not found at their offsets in {corpus}: {stale}")
        print(f"probes: {probes} ({len(chosen)}, as committed)")
        return chosen
    chosen = atlas.select_probes(corpus, topics, per_topic)
    meta = {
        "command": "python experiments/atlas.py",
        "corpus": corpus.as_posix(),
        "sources_sha256": {t: atlas.file_sha256(corpus / t / "heldout.txt") for t in topics},
        "selection": f"{per_topic} per topic: snippet i starts at the first blank-line "
        f"boundary after (i + 1/2) / {per_topic} of the file and ends at a line end "
        "200-400 bytes later; offset = byte offset in source",
    }
    atlas.save_probes(probes, chosen, meta)
    print(f"probes: {probes} ({len(chosen)}, selected from {corpus})")
    return chosen


def rel(path: str) -> str:
    """A path relative to the repository when it lies inside it (portable in the JSON)."""
    p = Path(path).resolve()
    return p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.as_posix()


def regenerate(
    model: str = MODEL,
    corpus: str = CORPUS,
    probes: str = PROBES,
    out: str = OUT,
    topics: list[str] = TOPICS,
    per_topic: int = 6,
    decode: int = 0,
    keep_probes: bool = False,
    progress: bool = True,
) -> dict:
    """Write the probes (unless kept) and the atlas `out`; the atlas. Paths are taken from the
    working folder (the repository's root for the defaults)."""
    t0 = time.monotonic()
    chosen = probes_for(corpus, probes, topics, per_topic, keep_probes)
    a = atlas.make_atlas(
        model,
        chosen,
        probes,
        decode=decode,
        progress=progress,
        names=(rel(model), rel(probes)),
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(atlas.dumps(a))
    print(f"wrote {out} in {time.monotonic() - t0:.1f} s")
    return a
