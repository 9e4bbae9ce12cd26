"""Per-request memory: the paged KV pool and the recurrent (Mamba-style) state pool."""
