"""A CPU-sized soak of the scheduler under closed-loop load (`bench.load_test`): SmolLM2, float32, n-gram draft,
speculation on, 8 clients over 100 small requests (prompts of 4 to 22 tokens, 2 to 8 new tokens; greedy,
and sampled with temperature, top-k, top-p and seeds; random stop tokens; a fifth cancelled, between steps or
from the streaming callback), in a pool too small for every client at once. Nothing is lost (every request
finishes exactly once, with a reason, none with an error), the streamed tokens add up to every output, every
greedy output equals its prompt's autoregressive greedy output cut by its stops (a cancelled one: a prefix of
it), every sampled one stops where its own tokens say, and the KV pool is empty at the end."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from speccycle.bench.load_test import check_run, make_workload, passed, run_mode
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.engine import Engine

pytestmark = pytest.mark.slow
NEW = 8


@pytest.fixture(scope="module")
def engine():
    from speccycle.engine.errors import ModelLoadError

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # 16 pages of 4 slots: the eight clients' prompts and reservations do not all fit at once
        yield Engine.load(draft="ngram", spec=SpecConfig(num_steps=3, page_size=4), dtype=torch.float32, kv_tokens=64)
    except ModelLoadError as error:
        pytest.skip(str(error))
    finally:
        torch.set_num_threads(threads)


def test_a_cpu_soak_loses_nothing_and_stays_lossless(engine):
    texts = [p["text"] for p in load_prompts(None)]
    prompts = [engine.tokenizer.encode(t)[: 4 + 2 * (i % 10)] for i, t in enumerate(texts)]  # mixed lengths
    references = {i: engine.generate_autoregressive([p], NEW)[0] for i, p in enumerate(prompts)}
    # stop at the references' most frequent tokens, so that greedy and sampled requests do stop at them
    common = Counter(t for out in references.values() for t in out[1:])
    stops = [t for t, _ in common.most_common(3)]
    workload = make_workload(
        len(prompts),
        100,
        seed=7,
        min_new=2,
        max_new=NEW,
        greedy_fraction=0.5,
        cancel_fraction=0.2,
        stop_ids=stops,
        stop_fraction=0.4,
    )
    figures, tracks, done = run_mode(engine, "on", workload, prompts, clients=8)
    checks = check_run(workload, tracks, done, references, engine.stop_token_ids)
    empty = engine.pool.num_free_pages == engine.pool.num_pages
    assert passed(checks, empty), checks
    assert checks["finished"] == 100 and checks["lost"] == 0 and empty
    reasons = checks["finish_reasons"]
    assert reasons["cancelled"] > 5 and reasons["stop"] > 0 and reasons["length"] > 0 and reasons["error"] == 0
    assert checks["greedy"] > 30 and checks["greedy_identical"] == checks["greedy"]
    assert figures["retractions"] > 0  # the pool was short: retracted requests resumed losslessly
    assert figures["output_tokens"] == sum(len(r.output) for r in done.values())
    assert 0 < figures["ttft_ms"]["p50"] <= figures["ttft_ms"]["p99"]
