"""xgrammar against llguidance on SmolLM2's vocabulary (49152 tokens), on the host: the choice of the grammar engine.

For each engine and each grammar (a JSON schema, a regex): the time to build the tokenizer's tables once, the
time to compile the grammar, the time to fill one token bitmask (``[ceil(V / 32)]`` int32) at every step of a
valid output (median and 90th percentile), the time to consume one token, and what a draft tree costs: roll a
matcher back by ``d`` tokens after consuming them, and copy a matcher (fork) for a branch.

    python -m speccycle.bench.grammar_engines [--repeats 5]

Writes ``bench/results/grammar_engines-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from .common import write_result

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
SCHEMA_TEXT = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"], '
    '"address": {"city": "London", "zip": "W1"}}'
)
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]) [A-Z][a-z]+ [A-Z][a-z]+, [a-z]+@[a-z]+\.(com|org)"
REGEX_TEXT = "2024-03-15 Grace Hopper, grace@navy.org"


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def _summary(samples: list[float]) -> dict:
    samples = sorted(samples)
    return {
        "median_ms": _ms(statistics.median(samples)),
        "p90_ms": _ms(samples[int(0.9 * (len(samples) - 1))]),
        "n": len(samples),
    }


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, eos: int):
        import llguidance

        self.lib = llguidance
        vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        special = sorted(tokenizer.special_ids)
        for i in special:  # llguidance marks special tokens with a leading 0xff byte
            vocab[i] = b"\xff" + vocab[i]

        class Wrapper:
            eos_token_id, bos_token_id, tokens, special_token_ids = eos, tokenizer.bos_token_id, vocab, special

            def __call__(self, text):
                text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
                return tokenizer.encode(text, add_special_tokens=False, parse_special=False)

        start = time.perf_counter()
        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapper()), n_vocab=len(vocab))
        self.setup_s = time.perf_counter() - start
        self.words = (len(vocab) + 31) // 32

    def compile(self, kind: str, source):
        if kind == "json":
            grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(source))
        else:
            grammar = self.lib.LLMatcher.grammar_from_regex(source)
        matcher = self.lib.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), self.words * 4)

    def consume(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def fork(self, matcher):
        return matcher.deep_copy()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, eos: int):
        import xgrammar

        self.lib = xgrammar
        vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.words = (len(vocab) + 31) // 32

    def compile(self, kind: str, source):
        if kind == "json":
            compiled = self.compiler.compile_json_schema(json.dumps(source))
        else:
            compiled = self.compiler.compile_regex(source)
        return self.lib.GrammarMatcher(compiled, max_rollback_tokens=64)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask[None] if bitmask.dim() == 1 else bitmask)

    def consume(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def fork(self, matcher):
        return matcher.fork()


def measure(engine, tokenizer, kind: str, source, text: str, repeats: int) -> dict:
    tokens = tokenizer.encode(text, add_special_tokens=False)
    compile_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.compile(kind, source)
        compile_s.append(time.perf_counter() - start)
    bitmask = torch.zeros((1, engine.words), dtype=torch.int32)
    fill_s, consume_s, rollback_s, fork_s = [], [], [], []
    for _ in range(repeats):
        matcher = engine.compile(kind, source)
        for token in tokens:
            start = time.perf_counter()
            engine.fill(matcher, bitmask)
            fill_s.append(time.perf_counter() - start)
            word, bit = divmod(token, 32)
            assert (int(bitmask[0, word]) >> bit) & 1, f"{engine.name}: the mask refuses the text's token {token}"
            start = time.perf_counter()
            engine.consume(matcher, token)
            consume_s.append(time.perf_counter() - start)
        # a draft branch of depth 4 from the middle of the text: consume, roll back; and one fork
        matcher = engine.compile(kind, source)
        half = len(tokens) // 2
        for token in tokens[:half]:
            engine.consume(matcher, token)
        for _ in range(20):
            start = time.perf_counter()
            for token in tokens[half : half + 4]:
                engine.consume(matcher, token)
            engine.rollback(matcher, 4)
            rollback_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.fork(matcher)
            fork_s.append(time.perf_counter() - start)
    return {
        "tokens": len(tokens),
        "compile": _summary(compile_s),
        "mask_per_token": _summary(fill_s),
        "consume_per_token": _summary(consume_s),
        "consume4_rollback4": _summary(rollback_s),
        "fork": _summary(fork_s),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from importlib.metadata import version

    from ..engine.tokenizers.tokenizer import Tokenizer
    from ..engine.weights.weights_gguf import default_model_path

    tokenizer = Tokenizer.from_gguf(default_model_path())
    eos = tokenizer.eos_token_id
    results = {}
    for cls in (Xgrammar, Llguidance):
        engine = cls(tokenizer, eos)
        results[cls.name] = {
            "version": version(cls.name),
            "tokenizer_setup_ms": _ms(engine.setup_s),
            "json_schema": measure(engine, tokenizer, "json", SCHEMA, SCHEMA_TEXT, args.repeats),
            "regex": measure(engine, tokenizer, "regex", REGEX, REGEX_TEXT, args.repeats),
        }
        print(cls.name, json.dumps(results[cls.name], indent=1))
    payload = {
        "config": {"vocab_size": tokenizer.vocab_size, "repeats": args.repeats, "threads": torch.get_num_threads()},
        "schema": SCHEMA,
        "regex": REGEX,
        "engines": results,
    }
    print(write_result("grammar_engines", payload))


if __name__ == "__main__":
    main()
