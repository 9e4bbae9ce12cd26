"""The grammar engine behind constrained requests: llguidance over the engine's tokenizer (docs: constrained).

`LlguidanceCompiler` is the engine's `core.ports.GrammarCompiler`: it builds llguidance's token tables from the
tokenizer's bytes once (on the first constrained request, ~0.1 s for SmolLM2's 49152 tokens) and compiles each
request's JSON schema, regex or Lark grammar into an `LlguidanceMatcher`. Why llguidance and not xgrammar:
docs/decisions.md (measured by ``bench/grammar_engines.py``).

`constrained_greedy` is the reference the speculative cycle must equal: plain autoregressive decoding, one target
forward per token, each token the argmax of the masked logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.config import SamplingParams
from ..statemachine.grammar import INSTALL, GrammarRefused, mask_words


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarRefused(f"constrained decoding needs llguidance: {INSTALL}") from None
    return llguidance


class LlguidanceMatcher:
    """One request's `llguidance.LLMatcher` behind the cycle's `GrammarMatcher` protocol."""

    def __init__(self, matcher, words: int):
        self._matcher, self._bytes = matcher, words * 4
        self.position = 0  # tokens consumed and not rolled back (checked mode compares it with the output)

    def try_consume(self, tokens: Sequence[int]) -> int:
        done = self._matcher.try_consume_tokens(list(tokens)) if tokens else 0
        self.position += done
        return done

    def rollback(self, count: int) -> None:
        if count and not self._matcher.rollback(count):
            raise RuntimeError(f"the grammar matcher cannot roll back {count} tokens: {self._matcher.get_error()}")
        self.position -= count

    def fill_mask(self, out: torch.Tensor) -> None:
        if (
            out.dtype != torch.int32
            or out.device.type != "cpu"
            or not out.is_contiguous()
            or out.numel() * 4 != self._bytes
        ):
            raise ValueError(f"a token bitmask is a contiguous int32 host tensor of {self._bytes // 4} words")
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), self._bytes)

    def is_stopped(self) -> bool:
        return self._matcher.is_stopped()


class LlguidanceCompiler:
    """Compiles ``json_schema``, ``regex`` and ``grammar`` (Lark) sources against a tokenizer's vocabulary.

    ``vocab_size``: the target's (its logits' width; ids past the tokenizer's are never allowed); ``eos_ids``:
    the ids that end a grammar's output (the model's EOS tokens).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        if not eos_ids:
            raise ValueError("constrained decoding needs the model's end-of-sequence token id(s)")
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self.words = mask_words(vocab_size)
        self._tables = None

    def _tokenizer_tables(self):
        if self._tables is None:
            llg = _llguidance()
            tok = self.tokenizer
            vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
            special = sorted(tok.special_ids)
            for i in special:  # llguidance's mark of a special token: a leading 0xff byte
                vocab[i] = b"\xff" + vocab[i]

            class Wrapper:
                eos_token_id, bos_token_id, tokens, special_token_ids = (
                    self.eos_ids[0],
                    tok.bos_token_id,
                    vocab,
                    special,
                )

                def __call__(self, text):
                    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
                    return tok.encode(text, add_special_tokens=False, parse_special=False)

            wrapper = llg.TokenizerWrapper(Wrapper())
            self._tables = llg.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._tables

    def compile(self, kind: str, source: str) -> LlguidanceMatcher:
        llg = _llguidance()
        tables = self._tokenizer_tables()
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(source)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(source)
            elif kind == "grammar":
                grammar = llg.grammar_from("lark", source)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}: use json_schema, regex or grammar")
        except (ValueError, TypeError) as err:
            raise ValueError(_one_line(str(err))) from None
        matcher = llg.LLMatcher(tables, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(_one_line(matcher.get_error()))
        return LlguidanceMatcher(matcher, self.words)


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:2] if line.strip())


def constrained_greedy(
    target, pool, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], compiler, first_request_id: int
) -> list[list[int]]:
    """Constrained autoregressive greedy decoding, the reference: one target forward per token, the argmax of
    its logits masked by the request's grammar; a request ends at a stop id, at ``max_new_tokens`` or where its
    grammar is finished. A request whose grammar does not compile gets no output. Frees its pages at the end."""
    from .greedy import extend_batch

    request_ids = [first_request_id + i for i in range(len(prompts))]
    matchers, outputs, live = [], [[] for _ in prompts], []
    for i, p in enumerate(params):
        try:
            matchers.append(compiler.compile(*p.constraint) if p.constraint is not None else None)
            live.append(i)
        except ValueError:
            matchers.append(None)
    lengths = [len(p) for p in prompts]
    words = mask_words(target.vocab_size)
    try:
        if live:
            batch = extend_batch(
                pool, [request_ids[b] for b in live], [prompts[b] for b in live], [0] * len(live), prefill=True
            )
        while live:
            logits = target.forward(batch).logits
            masks = torch.full((len(live), words), -1, dtype=torch.int32)
            for row, b in enumerate(live):
                if matchers[b] is not None:
                    matchers[b].fill_mask(masks[row])
                    if not bool(masks[row].any()):
                        masks[row].fill_(-1)
            bits = torch.arange(32, dtype=torch.int32)
            allowed = ((masks[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]
            tokens = logits.masked_fill(~allowed.to(logits.device), float("-inf")).argmax(-1).tolist()
            still = []
            for b, token in zip(live, tokens):
                outputs[b].append(token)
                finished = token in params[b].stop_token_ids or len(outputs[b]) >= params[b].max_new_tokens
                if matchers[b] is not None:
                    if matchers[b].try_consume([token]) != 1:
                        continue  # the grammar refuses it: the request fails (the cycle errors it)
                    finished = finished or matchers[b].is_stopped()
                if not finished:
                    still.append(b)
            live = still
            if live:
                batch = extend_batch(
                    pool, [request_ids[b] for b in live], [[outputs[b][-1]] for b in live], [lengths[b] for b in live]
                )
                for b in live:
                    lengths[b] += 1
    finally:
        for request_id in request_ids:
            if pool.has_request(request_id):
                pool.free(request_id)
    return outputs
