"""The models the engine runs: Llama, Gemma 3, the hybrid attention + Mamba decoder, RoPE, the `TargetModel`
port over a model, and which class runs a config and the models found by name (`catalog`)."""
