"""Self-generated prompts: the target writes user turns itself, sampled from the opening of a user turn.

An instruction-tuned model given only its chat template up to where a user's words begin (for
ChatML, ``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n``) writes a plausible user request and
closes the turn with its end-of-turn token (the "Magpie" recipe). Those requests are the kind of
prompt the model itself expects, so its greedy answers to them (the generate stage answers them like
any other prompt) are self-distillation data from its own prompt distribution.

    prefix = user_turn_prefix(tokenizer)
    texts, stats = sample_user_turns(generate, tokenizer, prefix, count=5000, batch_size=512, seed=0)

Kept: turns that ended with an end-of-turn token within ``max_new_tokens``, hold no other special
token, have at least two words, repeat no earlier turn, and share no ``NGRAM``-word run with an
excluded (Spec-Bench) prompt.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

import attrs

from .augment import OverlapFilter, normalized_words

MARKER = "\ue000speccycle-user-turn\ue000"  # private-use characters: no template writes them


@attrs.frozen
class UserTurnPrefix:
    ids: tuple[int, ...]  # the chat template up to where a user's words begin
    text: str
    end_ids: tuple[int, ...]  # the token(s) that close a user turn (ChatML: <|im_end|>)


def user_turn_prefix(tokenizer) -> UserTurnPrefix:
    """How the tokenizer's chat template opens a user turn of a new conversation, and how it closes it.

    Renders a one-message conversation whose content is a marker and cuts it there: whatever the
    template writes before a user's words (a default system turn included) is the prefix; the first
    token after the marker, when it is a special token, ends the turn.
    """
    text = tokenizer.render_chat([{"role": "user", "content": MARKER}], add_generation_prompt=False)
    if MARKER not in text:
        raise ValueError("the chat template does not write the user's message verbatim: no self-prompts for it")
    before, after = text.split(MARKER, 1)
    after_ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    end = (after_ids[0],) if after_ids and after_ids[0] in tokenizer.special_ids else ()
    return UserTurnPrefix(ids=tuple(tokenizer.encode(before, add_special_tokens=False)), text=before, end_ids=end)


def sample_user_turns(
    generate: Callable[..., list[list[int]]],
    tokenizer,
    prefix: UserTurnPrefix,
    count: int,
    batch_size: int,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    exclude: OverlapFilter | None = None,
    seen: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> tuple[list[str], dict]:
    """Sample ``count`` user turns in batches (batch ``b`` seeded ``seed + b``); keep the well-formed ones.

    ``generate(prompts, max_new_tokens, temperature, top_p=, seed=)`` is the generate stage's
    generator (`HFGenerator` or `EngineGenerator`), which must stop on ``prefix.end_ids`` (pass them
    in its stop ids). ``seen``: texts already prompts (a repeat is refused). Returns the kept texts
    and ``stats``: ``sampled``, ``kept``, ``refused`` (per reason), the sampling settings.
    """
    if count < 1:
        raise ValueError(f"--self-prompts {count}: pass a positive number of user turns to sample")
    ends = set(prefix.end_ids) | set(stop_ids)
    if not ends:
        raise ValueError("no end-of-turn token to stop a sampled user turn: the template closes turns with text")
    others = set(tokenizer.special_ids) - ends
    keys = {" ".join(normalized_words(text)): None for text in seen}
    kept: list[str] = []
    refused: Counter = Counter()
    sampled = 0
    for number, start in enumerate(range(0, count, batch_size)):
        n = min(batch_size, count - start)
        outputs = generate([list(prefix.ids)] * n, max_new_tokens, temperature, top_p=top_p, seed=seed + number)
        sampled += n
        for ids in outputs:
            reason, text = _check(ids, tokenizer, ends, others, keys, exclude)
            if reason:
                refused[reason] += 1
                continue
            keys[" ".join(normalized_words(text))] = None
            kept.append(text)
        log(f"[self-prompts] batch {number + 1}: {sampled} sampled, {len(kept)} kept")
    stats = {
        "sampled": sampled,
        "kept": len(kept),
        "refused": dict(refused),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "prefix": prefix.text,
    }
    return kept, stats


def _check(ids, tokenizer, ends, others, keys, exclude) -> tuple[str | None, str]:
    """Why a sampled turn is refused (None: kept) and its text."""
    if not ids or ids[-1] not in ends:
        return "not_ended", ""
    body = list(ids[:-1])
    if any(i in others or i in ends for i in body):
        return "special_token", ""
    text = tokenizer.decode(body).strip()
    if len(re.findall(r"\w+", text)) < 2:
        return "empty", text
    if " ".join(normalized_words(text)) in keys:
        return "duplicate", text
    if exclude is not None and exclude.overlaps(text):
        return "spec_bench_overlap", text
    return None, text
