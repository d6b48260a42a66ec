"""colibri.bench.workers.run_worker with `tree`: the worker process runs the code of the checkout
it is given (experiments/bench_engine_revs.py times two revisions so), not this one's."""

from __future__ import annotations

from pathlib import Path

from colibri.bench import workers

# A stand-in for another revision's worker: says which tree it ran from and what it was given.
FAKE_WORKER = """\
import argparse, json, os
from pathlib import Path
ap = argparse.ArgumentParser()
for a in ("--worker", "--out", "--path", "--tokens", "--prompt-ids"):
    ap.add_argument(a)
a = ap.parse_args()
Path(a.out).write_text(json.dumps({
    "decode_tok_s_1": 1.0, "prefill_tok_s": 2.0, "peak_rss_mb": 3.0,
    "ran_from": os.path.abspath(__file__), "path": a.path, "tokens": int(a.tokens),
    "prompt": json.loads(a.prompt_ids), "env": os.environ.get("COLIBRI_PROBE"),
}))
"""


def test_a_worker_runs_the_code_of_the_tree_it_is_given(tmp_path, monkeypatch):
    tree = tmp_path / "other-revision"
    bench = tree / "colibri" / "bench"
    bench.mkdir(parents=True)
    (tree / "colibri" / "__init__.py").write_text("")
    (bench / "__init__.py").write_text("")
    (bench / "workers.py").write_text(FAKE_WORKER)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # Relative paths (the peers cache, a checkpoint) must survive the worker's other cwd.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(workers, "CACHE", Path("cache"))
    Path("cache").mkdir()

    res = workers.run_worker(
        "colibri", Path("ckpt"), [5, 6], 7, env={"COLIBRI_PROBE": "yes"}, tree=tree
    )

    assert Path(res["ran_from"]) == (bench / "workers.py").resolve()
    assert Path(res["path"]) == ckpt.resolve()
    assert (res["tokens"], res["prompt"], res["env"]) == (7, [5, 6], "yes")
    assert not list(Path("cache").iterdir()), "the worker's result file is left behind"


def test_other_conversations_are_the_conversation_prompts_each_slot_holds(checkpoints):
    """The benchmarks' 16 conversations (colibri's slots, llama.cpp's sequences) are one list:
    each slot other_conversations fills holds its conversation_prompts prompt, as a prefill of
    that prompt alone would."""
    import numpy as np

    from colibri.bench.conversations import conversation_prompts, other_conversations
    from colibri.engine.model import load_model
    from colibri.engine.runner import Runner

    model = load_model(checkpoints("qwen3_moe"), progress=False)
    vocab = model.cfg.vocab_size
    prompt = list(range(3, 23))
    prompts = conversation_prompts(prompt, 4, vocab)
    assert prompts == conversation_prompts(prompt, 4, vocab)  # the same every run
    assert prompts[0] == prompt and len(prompts) == 4
    assert all(p[:-8] == prompt[:-8] and len(p) == len(prompt) for p in prompts)
    assert len({tuple(p[-8:]) for p in prompts}) == 4
    assert all(0 <= t < min(vocab, 4096) for p in prompts for t in p)

    runner = Runner(model, slots=4, capacity=32)
    runner.prefill(0, prompt)
    firsts = other_conversations(runner, prompt, 4)
    alone = Runner(model, slots=1, capacity=32)
    expect = [int(np.argmax(alone.prefill(0, p)[0])) for p in prompts[1:]]
    assert firsts == expect
