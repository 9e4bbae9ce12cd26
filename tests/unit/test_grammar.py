"""Grammar-constrained decoding through the cycle, on the hashed n-gram models and a 32-token vocabulary.

Greedy constrained output equals constrained autoregressive decoding (each token the argmax of the target's
logits masked by the grammar after the tokens so far), chain and tree, forward and lookup drafts, in checked
mode (invariant 16 at every boundary). A grammar that does not compile fails its request alone; one that
allows only the end token ends its request at once. The rows call the mask op they declare.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from speccycle.backends.torch import TorchBackend
from speccycle.core import Admitted, Ports, Request, SamplingParams, SpecConfig
from speccycle.engine.grammar import LlguidanceCompiler
from speccycle.statemachine import generate, select, step
from speccycle.statemachine.checks import InvariantViolation, check_record
from speccycle.statemachine.static_rows import static_covers
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft, TreeLookupDraft
from speccycle.testing.grammar import SmallVocab

pytest.importorskip("llguidance")

VOCAB = SmallVocab([*"abcdefghijklmnop", *"01234", "{", "}", '"', ":", ",", "[", "]", " ", "ab", "cd"])
END = VOCAB.eos_token_id  # 31
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
GRAMMARS = [
    SamplingParams(regex="[a-e]+(0|1)[f-j]*[2-4]", max_new_tokens=20),
    SamplingParams(json_schema=SCHEMA, max_new_tokens=24),
    SamplingParams(grammar='start: "{" item ("," item)* "}"\nitem: /[a-h]+/ ":" /[0-4]/', max_new_tokens=24),
    SamplingParams(max_new_tokens=12),  # unconstrained beside them
]


def _ports(config: SpecConfig, family: str) -> Ports:
    pool = FingerprintPool(num_pages=512, page_size=config.page_size)
    target = HashedNgramTarget(pool, vocab_size=VOCAB.vocab_size, n=3)
    draft = TreeLookupDraft(target, 0.6) if family == "lookup" else NoisyDraft(target, 0.7, family)
    compiler = LlguidanceCompiler(VOCAB, VOCAB.vocab_size, [END])
    return Ports(target=target, draft=draft, kv_pool=pool, grammar=compiler)


def constrained_autoregressive(target: HashedNgramTarget, compiler, request: Request) -> list[int]:
    """The reference: the argmax of the target's logits after the tokens so far, masked by the grammar."""
    matcher = compiler.compile(*request.sampling.constraint) if request.sampling.constraint else None
    output = []
    while len(output) < request.sampling.max_new_tokens:
        logits = target.next_logits(list(request.prompt) + output)
        if matcher is not None:
            mask = torch.zeros(1, dtype=torch.int32)
            matcher.fill_mask(mask)
            allowed = torch.tensor([(int(mask[0]) >> t) & 1 for t in range(VOCAB.vocab_size)], dtype=torch.bool)
            logits = logits.masked_fill(~allowed, float("-inf"))
        token = int(logits.argmax())
        output.append(token)
        if matcher is not None:
            assert matcher.try_consume([token]) == 1
            if matcher.is_stopped():
                break
    return output


CONFIGS = [
    ("shifted", SpecConfig(num_steps=3, topk=1, page_size=2)),
    ("shifted", SpecConfig(num_steps=3, topk=3, num_draft_tokens=8, page_size=1)),
    ("aligned", SpecConfig(num_steps=4, topk=2, num_draft_tokens=7, page_size=4)),
    ("lookup", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=2)),
    ("lookup", SpecConfig(num_steps=4, topk=1, page_size=1)),
    ("shifted", SpecConfig(num_steps=0, page_size=2)),  # S == 0 (adaptive shapes): the root row is masked too
]


@pytest.mark.parametrize(
    "family, config", CONFIGS, ids=[f"{f}-S{c.num_steps}K{c.topk}N{c.num_draft_tokens}" for f, c in CONFIGS]
)
def test_constrained_greedy_equals_constrained_autoregressive(family, config):
    ports = _ports(config, family)
    requests = [Request(i, (3 + i, 7, 1 + 2 * i), params) for i, params in enumerate(GRAMMARS)]
    done = generate(requests, config, ports, checked=True)
    assert ports.kv_pool.num_free_pages == ports.kv_pool.num_pages
    for request, result in zip(requests, done):
        expected = constrained_autoregressive(ports.target, ports.grammar, request)
        assert list(result.output) == expected, f"request {request.request_id} diverged from constrained greedy"
        assert result.error is None
    text = b"".join(VOCAB.token_bytes(t) for t in done[1].output).decode()
    if done[1].finish_reason == "stop":  # the schema's object is complete: it parses and has its keys
        assert set(json.loads(text)) == {"a", "b"}


def test_a_grammar_that_does_not_compile_fails_its_request_alone():
    config = SpecConfig(num_steps=2, topk=1)
    ports = _ports(config, "shifted")
    requests = [
        Request(0, (1, 2), SamplingParams(json_schema='{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}')),
        Request(1, (1, 2), SamplingParams(grammar="start: undefined_rule")),
        Request(2, (1, 2), SamplingParams(regex="[a-c]+", max_new_tokens=6)),
    ]
    done = generate(requests, config, ports, checked=True)
    assert [r.finish_reason for r in done[:2]] == ["error", "error"]
    assert "json_schema does not compile" in done[0].error and "nope" in done[0].error
    assert "grammar does not compile" in done[1].error and "\n" not in done[1].error
    assert done[2].error is None and len(done[2].output) == 6
    assert all(VOCAB.token_bytes(t) in (b"a", b"b", b"c", b"ab") for t in done[2].output)


def test_a_grammar_that_allows_only_the_end_token_ends_the_request_cleanly():
    config = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)
    ports = _ports(config, "shifted")
    requests = [Request(0, (4, 5), SamplingParams(regex="")), Request(1, (4, 5), SamplingParams(max_new_tokens=5))]
    done = generate(requests, config, ports, checked=True)
    assert done[0].output == (END,) and done[0].finish_reason == "stop" and done[0].error is None
    assert len(done[1].output) == 5 and done[1].finish_reason == "length"


def test_a_constrained_request_without_a_grammar_engine_fails_saying_what_to_install():
    config = SpecConfig(num_steps=2, topk=1)
    ports = attrs.evolve(_ports(config, "shifted"), grammar=None)
    done = generate([Request(0, (1, 2), SamplingParams(regex="a+"))], config, ports)
    assert done[0].finish_reason == "error" and "pip install" in done[0].error


def test_sampling_params_take_one_grammar():
    assert json.loads(SamplingParams(json_schema=SCHEMA).json_schema) == SCHEMA
    assert SamplingParams(regex="a+").constraint == ("regex", "a+")
    with pytest.raises(ValueError, match="json_schema and regex are both set"):
        SamplingParams(json_schema="{}", regex="a")
    with pytest.raises(ValueError, match="must be a string"):
        SamplingParams(grammar=3)


def test_static_forms_refuse_constrained_batches():
    """A constrained batch runs eagerly: its masks come from the host each cycle."""

    class Static:
        pairing, kind = "shifted", "forward"

    config = SpecConfig(num_steps=2, topk=1)
    ports = _ports(config, "shifted")
    record = step(Admitted(config=config, requests=(Request(0, (1, 2), SamplingParams(regex="a+")),)), ports)
    plain = attrs.evolve(record, requests=(Request(0, (1, 2)),))
    from speccycle.statemachine import static_rows

    original = static_rows.static_forwards
    try:
        static_rows.static_forwards = lambda ports: object()  # as if the ports declared static forwards
        assert static_covers(plain, ports) and not static_covers(record, ports)
    finally:
        static_rows.static_forwards = original


def test_apply_token_mask_sets_refused_tokens_to_minus_infinity():
    backend = TorchBackend()
    logits = torch.randn(3, 40)
    bitmask = torch.tensor([[0b1011, 0], [-1, 0b1], [0, 1 << 7]], dtype=torch.int32)
    out = backend.apply_token_mask(logits, bitmask)
    for r in range(3):
        for t in range(40):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert (out[r, t] == logits[r, t]) if allowed else out[r, t] == float("-inf")
    vocab_map = torch.tensor([32, 0, 3])  # a draft vocabulary of three target ids
    mapped = backend.apply_token_mask(logits[:, :3], bitmask, vocab_map)
    assert torch.isinf(mapped).tolist() == [[True, False, False], [False, False, False], [True, True, True]]


class RecordingBackend(TorchBackend):
    def __init__(self):
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if callable(attr) and not name.startswith("_") and name in dir(TorchBackend):
            object.__getattribute__(self, "calls").append(name)
        return attr


@pytest.mark.parametrize("family", ["shifted", "lookup"])
def test_constrained_rows_call_the_mask_op_they_declare(family):
    config = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)
    ports, backend = _ports(config, family), RecordingBackend()
    record = Admitted(config=config, requests=(Request(0, (1, 2), GRAMMARS[0]), Request(1, (2, 3), GRAMMARS[3])))
    masked = set()
    for _ in range(30):
        if not record.requests:
            break
        row = select(record, ports)
        backend.calls.clear()
        record = step(record, ports, backend)
        assert set(backend.calls) <= set(row.ops), f"{row.event} called {set(backend.calls) - set(row.ops)}"
        if "apply_token_mask" in backend.calls:
            masked.add(row.event)
            assert row.grammar, f"{row.event} masks logits and names no grammar step"
    assert masked >= ({"prefill", "verify", "extend", "draft"} if family == "shifted" else {"prefill", "verify"})


def test_invariant_16_checked_mode_catches_a_matcher_off_the_committed_tokens():
    config = SpecConfig(num_steps=2, topk=1)
    ports = _ports(config, "shifted")
    record = step(Admitted(config=config, requests=(Request(0, (1, 2), SamplingParams(regex="[a-c]+")),)), ports)
    check_record(record, ports)
    record.requests[0].grammar.matcher.try_consume([0])  # one token past the committed ones
    with pytest.raises(InvariantViolation, match="invariant 16"):
        check_record(record, ports)


def test_the_scheduler_keeps_constrained_requests_lossless_through_retraction_and_staggered_arrival():
    """A pool too small for every request at once: constrained requests are retracted and resumed (the prefill
    recompiles the grammar and walks the output again), requests join between cycles."""
    from speccycle.engine.serving.scheduler import Scheduler

    config = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5, page_size=2)
    ports = attrs.evolve(_ports(config, "shifted"), kv_pool=FingerprintPool(num_pages=40, page_size=2))
    ports = attrs.evolve(ports, target=HashedNgramTarget(ports.kv_pool, vocab_size=VOCAB.vocab_size, n=3))
    ports = attrs.evolve(ports, draft=NoisyDraft(ports.target, 0.7, "shifted"))
    scheduler = Scheduler(ports, config, checked=True)
    prompts = [(3, 7, 1), (4, 7, 3), (5, 7, 5), (6, 7, 7)]
    ids = [scheduler.submit(prompts[0], GRAMMARS[0]), scheduler.submit(prompts[1], GRAMMARS[1])]
    scheduler.step()
    ids += [scheduler.submit(prompts[2], GRAMMARS[2]), scheduler.submit(prompts[3], GRAMMARS[3])]
    scheduler.run()
    assert scheduler.stats.retractions > 0, "the pool was meant to be too small for every request at once"
    for rid, prompt, params in zip(ids, prompts, GRAMMARS):
        expected = constrained_autoregressive(ports.target, ports.grammar, Request(rid, prompt, params))
        assert list(scheduler.finished[rid].output) == expected
    assert ports.kv_pool.num_free_pages == ports.kv_pool.num_pages
