"""The engine's side of the wire: `colibri engine` and `colibri-engine` (main), the mux and
legacy loops, and the process plumbing they share (stdio). The formats are `colibri.protocol`'s."""
