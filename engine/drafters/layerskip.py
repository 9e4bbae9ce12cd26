"""Self-speculative drafts that run a Llama model forward: layer skip and a smaller model.

Both are ``aligned`` drafts (token ``t[p]`` at position ``p``, like the target), with a KV cache of
their own in the shared pool: the draft extend writes the committed tokens and the root, each tree
level writes its nodes into the cycle's scratch slots.
"""

from __future__ import annotations

import torch

from ...core.ports import ForwardBatch, ModelOutput
from ..memory.kv_pool import PagedKVPool
from ..models.llama import LlamaModel


class LlamaDraft:
    """`DraftModel` that runs the first ``num_layers`` layers of ``model``, its final norm and head.

    With ``num_layers < model.config.num_layers`` and the target's own model this is layer skip (no
    training, no extra weights); with a separate smaller model it is a standalone draft.
    """

    kind = "forward"
    pairing = "aligned"

    def __init__(self, model: LlamaModel, pool: PagedKVPool, num_layers: int | None = None, cache_name: str = "draft"):
        depth = model.config.num_layers if num_layers is None else num_layers
        if not 1 <= depth <= model.config.num_layers:
            raise ValueError(
                f"a draft of {depth} layers is out of range: the model has {model.config.num_layers} layers"
            )
        self.model, self.num_layers = model, depth
        self.vocab_size = model.config.vocab_size
        c = model.config
        self.kv = pool.add_cache(cache_name, depth, c.num_kv_heads, c.head_dim, model.dtype)

    def _forward(self, batch: ForwardBatch) -> ModelOutput:
        out = self.model.forward(batch, self.kv, num_layers=self.num_layers)
        return ModelOutput(logits=out.logits, hidden=None)  # aligned drafts feed no hidden state

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        return self._forward(batch)

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        return self._forward(batch)
