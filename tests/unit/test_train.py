"""Draft-head training (speccycle.train) on a tiny random Llama, on CPU.

The tiny model has SmolLM2's vocabulary size so the real tokenizer (from the embedded GGUF) writes
its prompts. Checked: the dense target forward gives the engine's features and greedy tokens; the
unrolled trainable head computes what `EagleDraft` computes at inference (extend and draft steps);
a train step lowers the loss; the whole pipeline (generate, train, eval) runs and its heads load
into the engine, which stays lossless; ``--draft eagle`` finds a shipped head.
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from speccycle.core import SpecConfig
from speccycle.engine.drafters import eagle_heads
from speccycle.engine.drafters.eagle import EagleDraft, EagleHead
from speccycle.engine.engine import Engine
from speccycle.engine.greedy import extend_batch
from speccycle.engine.kv_pool import PagedKVPool
from speccycle.engine.llama import LlamaModel, random_llama_weights
from speccycle.engine.weights_gguf import LlamaConfig
from speccycle.engine.weights_hf import save_hf
from speccycle.train.data import EngineGenerator, SelfDistilledData, load_train_prompts
from speccycle.train.features import target_outputs
from speccycle.train.head import TrainableEagleHead
from speccycle.train.trainer import TrainConfig, batch_loss, collate, head_config

TINY = LlamaConfig(
    architecture="llama",
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=64,
    intermediate_size=96,
    num_layers=8,  # EAGLE-3 reads layers (2, 4, 5)
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)
PROMPTS = [
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write one sentence about the sea.",
    "Translate 'good morning' into French.",
    "List two uses of a paperclip.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(TINY, seed=3, scale=0.08)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from speccycle.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def sequences(weights, tokenizer):
    """Greedy self-distilled sequences of the tiny model (prompt + 12 new tokens)."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    generator = EngineGenerator(TINY, weights, "cpu", torch.float32, TINY.eos_token_ids)
    responses = generator(prompts, 12, 0.0)
    return SelfDistilledData.from_sequences(
        [(i, p, r) for i, (p, r) in enumerate(zip(prompts, responses))], TINY.vocab_size
    )


def test_data_round_trip_and_spec_bench_refused(tmp_path, sequences):
    path = sequences.save(tmp_path / "data.npz")
    back = SelfDistilledData.load(path)
    assert back.tokens.dtype.name == "uint16" and len(back) == len(PROMPTS)
    assert [s[1:] for s in back.items()] == [s[1:] for s in sequences.items()]
    assert all(len(r) > 0 for _, _, r in back.items())
    bench = tmp_path / "bench.jsonl.gz"
    with gzip.open(bench, "wt") as f:
        f.write(json.dumps({"question_id": 1, "category": "writing", "turns": ["hi"]}) + "\n")
    with pytest.raises(ValueError, match="Spec-Bench"):
        load_train_prompts(bench)


@pytest.mark.parametrize("features", [None, (2, 4, 5)])
def test_dense_target_forward_gives_the_engines_features_and_greedy_tokens(weights, sequences, features):
    model = LlamaModel(TINY, weights, feature_layers=features)
    seq = sequences.sequence(0).tolist()
    pool = PagedKVPool(num_pages=64, page_size=4)
    kv = pool.add_cache("target", TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, torch.float32)
    ref = model.forward(extend_batch(pool, [0], [seq], [0], last_logits_only=False), kv)
    out = target_outputs(model, torch.tensor([seq]), features or (TINY.num_layers,))
    torch.testing.assert_close(out.features[0], ref.hidden, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.greedy[0], ref.logits.argmax(-1))


def _draft_step_batch(pool, token, position, prefix_len, scratch_slots):
    """One chain draft forward: the row at ``position`` sees ``[0, prefix_len)`` plus ``scratch_slots``."""
    from speccycle.core import ForwardBatch

    return ForwardBatch(
        input_ids=torch.tensor([token]),
        positions=torch.tensor([position]),
        row_request=torch.tensor([0]),
        out_slots=scratch_slots[-1:].clone(),
        prefix_lens=torch.tensor([prefix_len]),
        extra_slots=scratch_slots[None, :].clone(),
        page_table=pool.page_table([0]),
        page_size=pool.page_size,
        request_ids=(0,),
    )


@pytest.mark.parametrize("version", [1, 3])
def test_unrolled_head_computes_what_eagle_draft_computes(weights, sequences, version):
    """Step 0 equals the draft extend at every anchor; steps 1, 2 equal chain draft forwards at L, L + 1."""
    cfg = TrainConfig(version=version, draft_vocab_size=256, intermediate_size=48)
    hcfg = head_config(TINY, cfg)
    d2t = torch.randperm(TINY.vocab_size, generator=torch.Generator().manual_seed(0))[:256].sort().values
    head = TrainableEagleHead.init(hcfg, d2t if version == 3 else None, seed=1, std=0.1)
    model = LlamaModel(TINY, weights, feature_layers=hcfg.feature_layers if version == 3 else None)
    seq = sequences.sequence(1).tolist()
    ids = torch.tensor([seq])
    with torch.no_grad():
        feats = target_outputs(model, ids, hcfg.feature_layers).features
        outs = head.unroll(model, ids, feats, 3)
    pool = PagedKVPool(num_pages=128, page_size=4)
    draft = EagleDraft(head.to_eagle_head(), model, pool)
    anchor = len(seq) - 5  # the last extend row; L = anchor + 1
    extend = draft.extend(
        extend_batch(pool, [0], [seq[1 : anchor + 2]], [0], last_logits_only=False), feats[0, : anchor + 1]
    )
    torch.testing.assert_close(extend.hidden, outs[0][0, : anchor + 1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        dense_logits = head.logits(model, outs[0][0, : anchor + 1]).float()
    got = extend.logits if version == 1 else extend.logits[:, head.draft_to_target]
    torch.testing.assert_close(got, dense_logits, atol=1e-4, rtol=1e-4)
    length = anchor + 1
    pool.allocate(0, length + 2)
    scratch = pool.slots_for([0], torch.arange(length, length + 2)[None])[0]
    parent = extend.hidden[-1:]
    for step in (1, 2):
        batch = _draft_step_batch(pool, seq[anchor + step + 1], length + step - 1, length, scratch[:step])
        parent = draft.step(batch, parent).hidden
        torch.testing.assert_close(parent[0], outs[step][0, anchor], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", [1, 3])
def test_train_steps_lower_the_loss_on_a_repeated_batch(weights, sequences, version):
    import attrs
    from speccycle.train.trainer import draft_vocabulary, validate

    torch.manual_seed(0)
    cfg = TrainConfig(version=version, ttt_steps=3, draft_vocab_size=512, intermediate_size=48, ce_chunk_rows=64)
    hcfg = head_config(TINY, cfg)
    d2t = draft_vocabulary(sequences, 512, TINY.vocab_size) if version == 3 else None
    head = TrainableEagleHead.init(hcfg, d2t)
    t2d = None
    if version == 3:
        t2d = torch.full((TINY.vocab_size,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(len(d2t))
    model = LlamaModel(TINY, weights)
    ids, lengths, prompt_lens = collate(sequences, torch.arange(len(sequences)).numpy(), 640, "cpu")
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss, metrics = batch_loss(head, model, ids, lengths, prompt_lens, cfg, t2d)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert metrics["rows"][0] > 0 and len(metrics["acc"]) == 3
    assert losses[-1] < 0.7 * losses[0], losses
    # held-out style accuracy: any batching of the same sequences gives the same per-step accuracy
    with torch.no_grad():
        _, metrics = batch_loss(head, model, ids, lengths, prompt_lens, cfg, t2d)
    small_batches = attrs.evolve(cfg, batch_tokens=int(lengths.max()) * 2)
    assert validate(head, model, sequences, small_batches, t2d) == pytest.approx(metrics["acc"], abs=1e-6)


def test_pipeline_end_to_end_and_the_heads_run_lossless(tmp_path, weights, model_path):
    from speccycle.engine.bench import SAMPLE_PROMPTS
    from speccycle.train import pipeline

    model_dir = save_hf(tmp_path / "tiny-llama", TINY, weights)
    prompts = tmp_path / "prompts.jsonl.gz"
    with gzip.open(prompts, "wt") as f:
        f.writelines(json.dumps({"source": "test", "prompt": p}) + "\n" for p in PROMPTS)
    from importlib import resources

    bench = resources.files("speccycle.engine").joinpath("data", SAMPLE_PROMPTS)
    out = tmp_path / "out"
    argv = f"""--stage all --out {out} --model {model_dir} --prompts {prompts} --device cpu --work-dir {tmp_path / "w"}
        --generator engine --max-new-tokens 10 --gen-batch 4 --steps 3 --batch-tokens 1024 --ttt-steps 3
        --versions 1,3 --draft-vocab 128 --v3-intermediate 32 --v1-intermediate 48
        --eval-prompts {bench} --eval-limit 2 --eval-new-tokens 8 --chains 3 --trees 3x2x5"""
    assert pipeline.main(argv.split()) == 0
    data = SelfDistilledData.load(out / "data.npz")
    assert len(data) == len(PROMPTS) and data.response_tokens > 0
    result = json.loads((out / "eval.json").read_text())
    (record,) = out.glob("train_draft_eval-*.json")  # the benchmark record (device, commit), written into OUT
    assert json.loads(record.read_text())["heads"] == result["heads"]
    assert set(result["heads"]) == {"eagle1", "eagle3"} and result["best"] in result["heads"]
    for entry in result["heads"].values():
        for row in entry["configs"]:
            assert row["identical_to_ar"] == 2, row  # lossless: speculative output equals autoregressive
            assert 1.0 <= row["tau"] <= row["S"] + 1 and len(row["accept_rate_by_position"]) == row["S"]
    for version in (1, 3):
        head = EagleHead.load(out / f"eagle{version}.safetensors")
        assert head.config.version == version and head.config.hidden_size == TINY.hidden_size
    assert "[train] wrote" in (out / "pipeline.log").read_text()
    readme = (out / "HEAD_README.md").read_text()
    assert "--stage all" in readme and "| 3 | 1 | 4 |" in readme


def test_draft_eagle_loads_the_shipped_head_by_default(tmp_path, weights, monkeypatch):
    model_dir = save_hf(tmp_path / "tiny-llama", TINY, weights)
    with pytest.raises(ValueError, match="train-draft"):
        Engine.load(str(model_dir), draft="eagle")
    head = TrainableEagleHead.init(head_config(TINY, TrainConfig(version=1, intermediate_size=48)), seed=2)
    head.to_eagle_head().save(tmp_path / "tiny.eagle.safetensors")
    monkeypatch.setattr(eagle_heads, "SHIPPED", {"tiny-llama": "tiny.eagle.safetensors"})
    monkeypatch.setattr(eagle_heads, "HEADS_DIR", tmp_path)
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)
    engine = Engine.load(str(model_dir), draft="eagle", spec=spec, kv_tokens=2048)
    assert isinstance(engine.draft, EagleDraft) and engine.draft.head.config.intermediate_size == 48
    prompts = [[1, 5, 9, 200, 3000], [7, 7, 7, 40000]]
    results, _ = engine.generate(prompts, 9)
    assert [list(r.output) for r in results] == engine.generate_autoregressive(prompts, 9)


def test_generate_counts_each_verify_once_when_requests_retire_apart(weights):
    """A retire re-emits the compacted record without the finished requests: their verifies count once."""
    import attrs
    from speccycle.core import Compacted
    from speccycle.engine.drafters.ngram import NgramDraft

    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11, 12, 13], [300, 4000]]
    greedy = Engine(LlamaModel(TINY, weights), PagedKVPool(num_pages=512, page_size=4), None, SpecConfig())
    stop = greedy.generate_autoregressive(prompts[1:2], 6)[0][-1]  # request 1 stops early on this token
    model = LlamaModel(attrs.evolve(TINY, eos_token_ids=(stop,)), weights)
    pool = PagedKVPool(num_pages=512, page_size=4)
    engine = Engine(model, pool, NgramDraft(TINY.vocab_size), SpecConfig(num_steps=4, page_size=4))
    parted = []
    on_step = lambda r: parted.append(isinstance(r, Compacted) and bool(r.retired) and bool(r.requests))  # noqa: E731
    results, stats = engine.generate(prompts, 20, on_step=on_step)
    assert any(parted), "the requests must finish in different cycles for this test to mean anything"
    # each request's output is its prefill token plus the tokens of its verifies
    assert stats.committed == sum(len(r.output) for r in results) - len(prompts)


def test_transformers_generator_answers_like_the_engine(tmp_path, weights, tokenizer):
    """The GPU data path (transformers, left padding, batched) gives the engine's greedy answers."""
    pytest.importorskip("transformers")
    from speccycle.train.data import HFGenerator

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    model_dir = save_hf(tmp_path / "tiny-llama", TINY, weights)
    hf = HFGenerator(model_dir, "cpu", torch.float32, TINY.eos_token_ids)
    engine = EngineGenerator(TINY, weights, "cpu", torch.float32, TINY.eos_token_ids)
    assert hf(prompts, 8, 0.0) == engine(prompts, 8, 0.0)


def test_the_head_shipped_for_smollm2_loads_and_stays_lossless(model_path):
    """Runs once a trained head is shipped in engine/data/eagle (skipped before)."""
    if eagle_heads.shipped_eagle_head(model_path) is None:
        pytest.skip("no EAGLE head shipped for SmolLM2 yet (speccycle train-draft, then engine/data/eagle/)")
    engine = Engine.load(None, draft="eagle", spec=SpecConfig(num_steps=4, page_size=16), kv_tokens=4096)
    prompts = [engine.chat_prompt("What is the capital of France?")]
    results, stats = engine.generate(prompts, 16)
    assert list(results[0].output) == engine.generate_autoregressive(prompts, 16)[0]
    assert stats.tau > 1.0, "a trained head should get some drafts accepted"
