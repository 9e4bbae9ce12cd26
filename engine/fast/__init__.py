"""The fast path: static-buffer forwards, CUDA graphs, the host control plane and the graphed executor (the
fused cycles). `path.accelerate` turns it on for an engine."""
