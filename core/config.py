"""The speculative configuration and its validation (invariant 1, docs/invariants.md)."""

from __future__ import annotations

import math
import numbers

import attrs


def max_tree_nodes(num_steps: int, topk: int) -> int:
    """The most draft nodes an EAGLE-2 tree of depth ``S`` and branching ``K`` can offer: ``K + (S-1)K^2``."""
    return topk + (num_steps - 1) * topk * topk


def _positive(name: str, value: int, upper: int | None = None, lower: int = 1, why: str = "") -> None:
    """``value`` an int in ``[lower, upper]``; the message states exactly that range (and ``why``)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < lower or (upper is not None and value > upper):
        allowed = f"[{lower}, {upper}]" if upper is not None else f">= {lower}"
        raise ValueError(f"{name}={value} is out of range: allowed {allowed}{why}")


@attrs.frozen
class SpecConfig:
    """How much to speculate.

    * ``num_steps`` (``S``): draft depth. ``S == 0`` drafts nothing: each cycle verifies the root alone and
      commits one token, a plain decode step through the cycle (a forward draft still extends over it, so a
      later cycle of a deeper shape finds its state current; `batching.reshape`).
    * ``topk`` (``K``): branching per draft step; ``K == 1`` is a chain.
    * ``num_draft_tokens`` (``N``): verify rows per request, root included. ``None`` picks the chain
      value ``S + 1`` when ``K == 1`` or ``S == 0``, and the largest tree ``1 + K + (S-1)K^2`` capped at 64
      otherwise.
    * ``page_size`` (``P``): tokens per page of the paged KV pool.
    * ``draft_floor``: a chain's verify rows per request cut where the draft's confidence runs out: depth ``d`` is
      verified only while the product of the draft's top-1 probabilities up to ``d`` is at least the floor, so a
      greedy request verifies ``1 + #{d : p_1 ... p_d >= floor}`` rows (its `DraftTree.widths`; the rows past it
      attend nothing). 0 (the default) verifies all ``N``. Lossless at any value (a verify only commits fewer
      tokens); it pays where a verify row costs (many requests: docs/serving.md). Chains of a forward draft
      (EAGLE, layer-skip, MTP) only; sampled requests and lookup drafts keep every row.
    """

    num_steps: int = 4
    topk: int = 1
    num_draft_tokens: int | None = attrs.field(default=None)
    page_size: int = 1
    draft_floor: float = 0.0

    def __attrs_post_init__(self) -> None:
        _positive("num_steps (S)", self.num_steps, 64, lower=0)
        _positive("topk (K)", self.topk, 16)
        _positive("page_size (P)", self.page_size, 1024)
        floor = self.draft_floor
        if isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not 0.0 <= floor < 1.0:
            raise ValueError(f"draft_floor must be a number in [0, 1), got {floor!r}")
        object.__setattr__(self, "draft_floor", float(floor))
        if floor and self.topk != 1:
            raise ValueError(
                f"draft_floor={floor} cuts a chain's rows: it needs topk (K)=1, got K={self.topk} (set draft_floor=0 "
                "for a tree)"
            )
        if self.num_draft_tokens is None:
            n = self.num_steps + 1 if self.is_chain else min(64, 1 + max_tree_nodes(self.num_steps, self.topk))
            object.__setattr__(self, "num_draft_tokens", n)
        n = self.num_draft_tokens
        if self.num_steps == 0:
            if n != 1:
                raise ValueError(
                    f"num_draft_tokens (N)={n} is invalid for num_steps (S)=0 (a cycle that drafts nothing "
                    "verifies the root alone): it must equal 1"
                )
        elif self.topk == 1:
            if n != self.num_steps + 1:
                raise ValueError(
                    f"num_draft_tokens (N)={n} is invalid for a chain: with topk (K)=1 it must equal "
                    f"num_steps (S) + 1 = {self.num_steps + 1}"
                )
        else:
            upper = 1 + max_tree_nodes(self.num_steps, self.topk)
            why = (
                f" for a tree of num_steps (S)={self.num_steps}, topk (K)={self.topk}: the root and at least one "
                f"draft node, at most the root and the tree's {upper - 1} nodes"
            )
            _positive("num_draft_tokens (N)", n, upper, lower=2, why=why)

    @property
    def is_chain(self) -> bool:
        """A chain: ``K == 1``, or ``S == 0`` (the root alone is a chain of one)."""
        return self.topk == 1 or self.num_steps == 0

    @property
    def drafts(self) -> bool:
        """Whether a cycle drafts at all (``S >= 1``)."""
        return self.num_steps > 0

    @property
    def accept_width(self) -> int:
        """Width of ``accept_index``: ``S + 1``, the bonus-token stride (never ``N``)."""
        return self.num_steps + 1

    def draft_scratch_offset(self, pairing: str) -> int:
        """Positions after ``L`` that a draft family keeps before its scratch: 1 for ``aligned`` (the root)."""
        return 1 if pairing == "aligned" else 0

    def reserve_len(self, pairing: str = "shifted") -> int:
        """Positions past ``L`` a request holds during a cycle.

        The ``N`` verify rows, the draft scratch, and for an aligned draft the next root, which its
        draft extend writes at ``L + accept_len`` with ``accept_len <= min(S + 1, N)``.
        """
        offset = self.draft_scratch_offset(pairing)
        scratch = offset + max(self.num_steps - 1, 0) * self.topk
        next_root = min(self.num_steps + 1, self.num_draft_tokens) + offset
        return max(self.num_draft_tokens, scratch, next_root)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)


def _int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _pairs(value) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs (from a dict or pairs), or None when it is not that."""
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (tuple, list, type({}.items()))):
        return None
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            return None
        token, bias = item
        if not (_int(token) and token >= 0 and _real(bias) and math.isfinite(bias)):
            return None
        pairs.append((int(token), float(bias)))
    if len({t for t, _ in pairs}) != len(pairs):
        return None
    return tuple(sorted(pairs))


@attrs.frozen
class SamplingParams:
    """Per-request decoding parameters. ``temperature == 0`` is greedy.

    ``temperature > 0`` samples from the target's distribution after temperature, ``min_p``, ``top_k`` and
    ``top_p`` (`speccycle.backends.torch.sampling.process_logits`), losslessly (docs: sampling).
    ``seed`` makes a sampled request reproducible; None draws a fresh seed at prefill.

    Before that, greedy or sampled, each logits row may be changed by what the request's tokens so far
    say (`speccycle.statemachine.logits`, in this order): ``repetition_penalty`` (> 1 divides a positive
    logit and multiplies a negative one of every token in the prompt or the output), ``frequency_penalty``
    and ``presence_penalty`` (subtract ``count`` times, and once, for each token of the output),
    ``logit_bias`` (added per token id), ``bad_words`` (token sequences never completed: a one-token
    word is masked, a longer one masks its last token after its prefix) and ``logits_processor`` (a
    callable ``(history token ids, logits row [V]) -> logits row``, called per row on the host). A
    speculative verify row sees the history of its own tree path, so each row is what autoregressive
    decoding would see there.

    ``speculate=False`` decodes the request one token a cycle beside speculating ones (no draft work
    for it). ``logprobs`` and ``top_logprobs`` (the ``n`` most likely alternatives) report the
    distribution each token was committed from (docs: sampling).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no truncation
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # on the decoded output text; the rule: statemachine/stops.py
    logprobs: bool = False  # return log p of each committed token (Request.logprobs)
    # grammar-constrained output (docs: constrained), at most one: a JSON schema (a JSON string or a dict), a
    # regular expression, or a Lark / EBNF grammar (llguidance's Lark dialect)
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (0: off)
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences the output never contains
    logits_processor: object = attrs.field(default=None, eq=False)  # (history, logits [V]) -> logits [V]
    speculate: bool = True  # False: one token a cycle, no draft work
    top_logprobs: int = 0  # the n most likely tokens and their logprobs at each output token (Request.top_logprobs)

    def __attrs_post_init__(self) -> None:
        if not _real(self.temperature) or not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r} is out of range: allowed a finite value >= 0")
        if not _int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is out of range: allowed an int >= 0 (0 disables it)")
        if not _real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} is out of range: allowed (0, 1]")
        if not _real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p={self.min_p!r} is out of range: allowed [0, 1] (0 disables it)")
        if not _real(self.repetition_penalty) or not (
            0.0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)
        ):
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty!r} is out of range: "
                "allowed a finite value > 0 (1 disables it)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number (0 disables it)")
        bias = _pairs(self.logit_bias)
        if bias is None:
            raise ValueError(
                f"logit_bias={self.logit_bias!r} must map distinct token ids (ints >= 0) to finite biases, "
                "e.g. {42: -5.0}"
            )
        words = self.bad_words
        if not isinstance(words, (tuple, list)) or not all(
            isinstance(w, (tuple, list)) and w and all(_int(t) and t >= 0 for t in w) for w in words
        ):
            raise ValueError(
                f"bad_words={words!r} must be a tuple of non-empty token-id sequences, e.g. ((13,), (7, 9))"
            )
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise ValueError(
                f"logits_processor={self.logits_processor!r} must be a callable (history, logits row) -> logits row"
            )
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate={self.speculate!r} must be True or False")
        if not _int(self.top_logprobs) or not (0 <= self.top_logprobs <= 20):
            raise ValueError(f"top_logprobs={self.top_logprobs!r} is out of range: allowed an int in [0, 20]")
        if self.seed is not None and not _int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an int or None")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs={self.logprobs!r} must be True or False")
        if not _int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} is out of range: allowed an int >= 1")
        ids, texts = self.stop_token_ids, self.stop_strings
        if not isinstance(ids, (tuple, list)) or not all(_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids={ids!r} must be a tuple of token ids (ints >= 0)")
        if not isinstance(texts, (tuple, list)) or not all(isinstance(s, str) and s for s in texts):
            raise ValueError(f"stop_strings={texts!r} must be a tuple of non-empty strings (not one bare string)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "stop_strings", tuple(texts))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        _check_constraint(self)
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "bad_words", tuple(tuple(int(t) for t in w) for w in words))
        object.__setattr__(self, "top_logprobs", int(self.top_logprobs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logits row depends on the request's history (penalties, bias, bad words, a processor)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.bad_words
            or self.logits_processor is not None
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy argmax of the raw logits with nothing else to report: what the fast paths serve (no logprobs, no
        history-dependent logits, no grammar, speculating)."""
        return self.greedy and self.plain

    @property
    def plain(self) -> bool:
        """Greedy, or sampled from the raw logits after temperature, min-p, top-k and top-p, with nothing else to
        report: what the static executor serves (no logprobs, no history-dependent logits, no grammar, speculating)."""
        return (
            not self.logprobs
            and not self.top_logprobs
            and not self.adjusts_logits
            and self.constraint is None
            and self.speculate
        )

    def token_ids(self) -> tuple[int, ...]:
        """Every token id the parameters name (logit bias, bad words): each must lie in the vocabulary."""
        return tuple(t for t, _ in self.logit_bias) + tuple(t for w in self.bad_words for t in w)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """``(kind, source)`` of the request's grammar (kind ``json_schema``, ``regex`` or ``grammar``), or None."""
        for kind in CONSTRAINT_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None


CONSTRAINT_KINDS = ("json_schema", "regex", "grammar")


def _check_constraint(params: SamplingParams) -> None:
    """At most one grammar, each a string (a JSON schema may come as a dict: it is kept as its JSON text)."""
    import json

    if isinstance(params.json_schema, dict):
        object.__setattr__(params, "json_schema", json.dumps(params.json_schema))
    given = [kind for kind in CONSTRAINT_KINDS if getattr(params, kind) is not None]
    if len(given) > 1:
        raise ValueError(
            f"{' and '.join(given)} are both set: give a request one grammar (json_schema, regex or grammar)"
        )
    for kind in given:
        if not isinstance(getattr(params, kind), str):
            value = getattr(params, kind)
            raise ValueError(f"{kind}={value!r} must be a string (json_schema: a JSON string or a dict)")
