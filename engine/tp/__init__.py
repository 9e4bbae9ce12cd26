"""Tensor parallelism: one rank's shard of a Llama model, the process group's collectives, and the
tensor-parallel engine that ``torchrun`` starts (`engine`)."""
