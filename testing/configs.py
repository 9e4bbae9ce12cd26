"""Model shapes the tests build random weights for."""

from __future__ import annotations

from ..engine.weights.weights_gguf import LlamaConfig

# a three-layer Llama: grouped-query attention (4 heads over 2 KV heads), 64 tokens, tied embeddings
TINY_LLAMA = LlamaConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=256,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)
