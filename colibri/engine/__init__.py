"""Running a model: loading, KV slots, prefill, batched decode steps, sampling."""
