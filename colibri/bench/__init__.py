"""What more than one benchmark script in experiments/ (or a test) uses. The scripts import
from here and never from one another.

- shapes.py: the peers benchmark's two synthetic shapes and their checkpoints, cached under
  .cache/bench-peers (f32, with their GGUF exports, or in another dtype).
- conversations.py: the fixed prompt, the other conversations that share all but its last 8
  tokens, and BURST, the greedy steps the engine takes a forward.
- accounting.py: the roofline's accounting: bytes of weights and of keys and values one
  decode step reads, and its FLOPs.
- bandwidth.py: the memory bandwidth probe, and the disk's (a cold pread of a checkpoint).
- anatomy.py: where a decode step's time goes: a jax.profiler trace of the decode bursts read
  back against the compiled program's kernel calls.
- workers.py: each peers configuration (colibri, transformers, llama.cpp, the probe) in a
  process of its own (`python -m colibri.bench.workers`), and the parent's side of it.
- sidebyside.py: colibri against a peer on one model, batch 1, in alternating rounds.
- kernel_calls.py: a build of the CPU kernels registered under names of its own.
- replay.py: recorded routes replayed by several versions of the expert call, taking turns;
  weights on huge pages as the engine holds them.
- levels.py: the engine level: one checkpoint loaded under different settings, decoding bursts
  in turn; and the table rows of each way of holding the weights.
- formats.py: the quantized formats (fp8, int4, awq4, int8) and how random experts are
  quantized into them.
- capped.py: one engine (colibri with automatic budgets, or llama.cpp with mmap) in a process
  of its own inside a memory cgroup capped below the model's size, from a cold page cache
  (`python -m colibri.bench.capped`), and the parent's side, which turns a crash or an OOM kill
  into an outcome.
- atlas_files.py: the expert atlas's probes and data/experts.json, made again.

This package sits at the top layer, beside client and gateway: nothing else in colibri imports
it.
"""
