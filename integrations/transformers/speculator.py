"""`TransformersSpeculator`: a transformers causal LM decoded speculatively by the library's cycle.

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    spec = TransformersSpeculator(model, draft="ngram", config=SpecConfig(num_steps=4, topk=2, num_draft_tokens=8))
    outputs, stats = spec.generate([prompt_ids], max_new_tokens=64)

The model, its weights and its attention stay transformers' (`ports.TransformersTarget`); the library runs the
cycle's table (`statemachine.step`) over the ports, with its paged pool holding every model's KV. Drafts: ``ngram``
(prompt lookup, `engine.drafters.ngram.NgramDraft`: any target), ``model`` (an assistant transformers model with the
target's tokenizer, `ports.TransformersDraft`), ``eagle`` (an EAGLE head, `engine.drafters.eagle.EagleHead`, reading
the target's residual streams through ``output_hidden_states``: a Llama-family target).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import torch

from ...backends.registry import get_backend
from ...core import Admitted, Ports, Request, SamplingParams, SpecConfig
from ...engine.drafters.eagle import EagleDraft, EagleHead
from ...engine.drafters.ngram import NgramDraft
from ...engine.memory.kv_pool import PagedKVPool
from ...engine.stepping import GenerationStats, check_batch_fits, run_batch
from .ports import EagleTargetParts, TransformersDraft, TransformersTarget, text_config

DRAFTS = ("ngram", "model", "eagle")


def stop_ids_of(model) -> tuple[int, ...]:
    """The EOS ids of a transformers model's generation config (its config's where it has none)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(text_config(model), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


class TransformersSpeculator:
    """A transformers causal LM, a draft and the library's pool, wired to the ports (module docstring).

    ``config``: the tree (`SpecConfig`; ``topk == 1`` a chain). ``draft``: ``ngram``, ``model`` (pass
    ``draft_model``, a transformers causal LM on the target's device and dtype) or ``eagle`` (pass ``eagle_head``,
    an `EagleHead` or its file). ``kv_tokens``: the pool's size in tokens, every model's cache alike.
    """

    def __init__(
        self,
        model,
        draft: str = "ngram",
        config: SpecConfig | None = None,
        draft_model=None,
        eagle_head: EagleHead | str | os.PathLike | None = None,
        kv_tokens: int = 16384,
        stop_token_ids: Sequence[int] | None = None,
        max_ngram: int | None = None,
    ) -> None:
        if draft not in DRAFTS:
            raise ValueError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFTS)}")
        self.config = config or SpecConfig()
        device = next(model.parameters()).device
        page = self.config.page_size
        self.pool = PagedKVPool(num_pages=-(-kv_tokens // page), page_size=page, device=device)
        feature_layers = None
        head = None
        if draft == "eagle":
            if eagle_head is None:
                raise ValueError("draft='eagle' needs an EAGLE head: pass eagle_head (an EagleHead or its file)")
            dtype = next(model.parameters()).dtype
            head = eagle_head if isinstance(eagle_head, EagleHead) else EagleHead.load(eagle_head, dtype, device)
            if head.config.version != 3:
                raise ValueError(
                    "the transformers adapter runs EAGLE-3 heads (features from output_hidden_states); this head is "
                    f"EAGLE-{head.config.version}: use draft='ngram' or an assistant model"
                )
            feature_layers = head.config.feature_layers
        self.target = TransformersTarget(model, self.pool, feature_layers=feature_layers)
        vocab = self.target.vocab_size
        if draft == "ngram":
            options = {} if max_ngram is None else {"max_ngram": max_ngram}
            self.draft = NgramDraft.for_device(vocab, device, **options)
        elif draft == "model":
            if draft_model is None:
                raise ValueError("draft='model' needs an assistant: pass draft_model (a transformers causal LM)")
            self.draft = TransformersDraft(draft_model, self.pool, target_vocab_size=vocab)
        else:
            self.draft = EagleDraft(head, EagleTargetParts(self.target), self.pool)
        self.stop_token_ids = tuple(stop_ids_of(model) if stop_token_ids is None else stop_token_ids)
        self.backend = get_backend(device)
        self.ports = Ports(target=self.target, draft=self.draft, kv_pool=self.pool)
        self._ids = itertools.count()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, checked: bool = False
    ) -> tuple[list[list[int]], GenerationStats]:
        """Greedy speculative decoding of a batch of token-id prompts: each output stops at an EOS id (kept) or
        ``max_new_tokens``; equal to the model's own greedy ``generate`` token for token."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("pass at least one prompt, each a non-empty list of token ids")
        advice = "build the speculator with a larger kv_tokens or send fewer tokens"
        check_batch_fits(self.pool, self.config, prompts, max_new_tokens, advice)
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=self.stop_token_ids)
        ids = [next(self._ids) for _ in prompts]
        record = Admitted(
            config=self.config,
            requests=tuple(Request(rid, tuple(int(t) for t in p), params) for rid, p in zip(ids, prompts)),
        )
        done, stats = run_batch(record, self.ports, self.backend, checked=checked)
        return [list(done[rid].output) for rid in ids], stats


@torch.inference_mode()
def transformers_greedy(model, prompt: Sequence[int], max_new_tokens: int, **options) -> list[int]:
    """The model's own greedy ``generate`` (``options``: e.g. ``prompt_lookup_num_tokens``, ``assistant_model``):
    the new tokens, up to and including an EOS id."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **options,
    )
    new = out[0, input_ids.shape[1] :].tolist()
    stops = set(stop_ids_of(model))
    for i, token in enumerate(new):
        if token in stops:
            return new[: i + 1]
    return new
