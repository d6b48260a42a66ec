"""Pure JAX model code: layers, attention (GQA, MLA), routers and the transformer; no I/O."""
