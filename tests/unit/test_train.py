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

import attrs
import numpy as np
import pytest
import torch
from speccycle.core import SpecConfig
from speccycle.engine.drafters import eagle_heads
from speccycle.engine.drafters.eagle import EagleDraft, EagleHead
from speccycle.engine.engine import Engine
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.engine.weights.weights_hf import save_hf
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
    from speccycle.engine.tokenizers.tokenizer import Tokenizer

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


HEADS = {"1": (1, 0), "3": (3, 256), "3full": (3, 0)}  # name: (version, draft vocabulary); 3full: the target's head


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("name", HEADS)
def test_unrolled_head_computes_what_eagle_draft_computes(weights, sequences, name, layers):
    """Step 0 equals the draft extend at every anchor; steps 1, 2 equal chain draft forwards at L, L + 1
    (one decoder layer, and a deeper head's two)."""
    version, vocab = HEADS[name]
    cfg = TrainConfig(version=version, draft_vocab_size=vocab, intermediate_size=48, num_layers=layers)
    hcfg = head_config(TINY, cfg)
    assert hcfg.target_lm_head == (name != "3")
    d2t = torch.randperm(TINY.vocab_size, generator=torch.Generator().manual_seed(0))[:256].sort().values
    head = TrainableEagleHead.init(hcfg, None if hcfg.target_lm_head else d2t, seed=1, std=0.1)
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
    got = extend.logits if hcfg.target_lm_head else extend.logits[:, head.draft_to_target]
    torch.testing.assert_close(got, dense_logits, atol=1e-4, rtol=1e-4)
    length = anchor + 1
    pool.allocate(0, length + 2)
    scratch = pool.slots_for([0], torch.arange(length, length + 2)[None])[0]
    parent = extend.hidden[-1:]
    for step in (1, 2):
        batch = _draft_step_batch(pool, seq[anchor + step + 1], length + step - 1, length, scratch[:step])
        parent = draft.step(batch, parent).hidden
        torch.testing.assert_close(parent[0], outs[step][0, anchor], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", HEADS)
def test_train_steps_lower_the_loss_on_a_repeated_batch(weights, sequences, name):
    import attrs
    from speccycle.train.trainer import draft_vocabulary, validate

    torch.manual_seed(0)
    version, vocab = HEADS[name]
    vocab = vocab and 512
    cfg = TrainConfig(version=version, ttt_steps=3, draft_vocab_size=vocab, intermediate_size=48, ce_chunk_rows=64)
    hcfg = head_config(TINY, cfg)
    d2t = draft_vocabulary(sequences, 512, TINY.vocab_size) if vocab else None
    head = TrainableEagleHead.init(hcfg, d2t)
    t2d = None
    if vocab:
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


@pytest.mark.parametrize("name", HEADS)
def test_fused_cross_entropy_trains_as_the_checkpointed_reference(weights, sequences, name):
    """`batch_loss` with ``ce="fused"`` and ``ce="reference"``: the same loss, accuracies and gradients."""
    from speccycle.train.trainer import draft_ids, draft_vocabulary

    version, vocab = HEADS[name]
    base = TrainConfig(version=version, ttt_steps=3, draft_vocab_size=vocab and 300, intermediate_size=48)
    hcfg = head_config(TINY, base)
    head = TrainableEagleHead.init(hcfg, draft_vocabulary(sequences, 300, TINY.vocab_size) if vocab else None, std=0.1)
    model = LlamaModel(TINY, weights, feature_layers=hcfg.feature_layers if version == 3 else None)
    batch = collate(sequences, torch.arange(len(sequences)).numpy(), 640, "cpu")
    results = []
    for ce in ("fused", "reference"):
        head.zero_grad(set_to_none=True)
        loss, metrics = batch_loss(
            head, model, *batch, attrs.evolve(base, ce=ce, ce_chunk_rows=16), draft_ids(head, 49152)
        )
        loss.backward()
        results.append((loss.detach(), metrics, {k: p.grad.clone() for k, p in head.params.items()}))
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = results
    assert metrics["rows"] == ref_metrics["rows"] and metrics["rows"][0] > 16  # several chunks
    assert metrics["acc"] == pytest.approx(ref_metrics["acc"], abs=1e-9)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert set(grads) == set(ref_grads) and ("lm_head__weight" in grads) == (name == "3")
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], atol=1e-5, rtol=1e-4, msg=key)


def test_training_stops_within_its_time_budget_when_steps_slow_down(tmp_path, weights, sequences, monkeypatch):
    """A fake clock: steps take ~4 s until the schedule is fitted, then 8 s; with no log line to refit the schedule
    at, the hard stop ends training inside the budget, the final write included."""
    from speccycle.train import trainer

    class Clock:
        t, calls = 0.0, 0

        def perf_counter(self):
            self.calls += 1
            self.t += 0.5 if self.calls < 150 else 4.0  # about two reads per step
            return self.t

    clock = Clock()
    monkeypatch.setattr(trainer, "time", clock)
    cfg = TrainConfig(version=3, draft_vocab_size=0, intermediate_size=32, ttt_steps=2, steps=10_000, warmup_steps=2,
                      batch_tokens=256, time_budget_s=200.0, save_every_s=1e9, log_every_s=1e9)  # fmt: skip
    logs: list[str] = []
    model = LlamaModel(TINY, weights)
    _, record = trainer.train_head(cfg, sequences, model, tmp_path / "h.safetensors", log=logs.append)
    text = "\n".join(logs)
    assert "steps fit the 200s budget" in text and "time budget reached" in text, text
    assert record["step"] == record["total_steps"] < 200
    end = next(float(line.split()[-1][:-1]) for line in logs if line.startswith("[train] wrote"))
    assert end <= 200.0, text  # the final write included


def test_a_finished_schedule_resumes_as_a_new_one_with_its_own_warmup(tmp_path, weights, sequences):
    """--resume of a head whose schedule ended trains on (a warm restart from that step), and the learning rate
    warms up again from where the new schedule begins; a sequence longer than max_len keeps its answer."""
    from speccycle.train import trainer

    cfg = TrainConfig(version=3, draft_vocab_size=0, intermediate_size=32, ttt_steps=2, steps=3, warmup_steps=2,
                      batch_tokens=256, save_every_s=1e9, log_every_s=1e9)  # fmt: skip
    model = LlamaModel(TINY, weights)
    out = tmp_path / "h.safetensors"
    _, first = trainer.train_head(cfg, sequences, model, out, log=lambda _: None)
    logs: list[str] = []
    _, second = trainer.train_head(cfg, sequences, model, out, log=logs.append, resume=True)
    assert first["step"] == 3 and second["step"] == 6 and second["schedule_begin"] == 3, logs
    assert any("continuing with a new one" in line for line in logs)
    assert trainer.lr_at(3, 6, cfg, begin=3) == pytest.approx(cfg.lr / 2)  # warmup restarts at the new schedule
    ids, lengths, prompt_lens = trainer.collate(sequences, np.array([0]), 4, "cpu")
    full = sequences.sequence(0)
    assert ids[0].tolist() == full[-4:].tolist() and int(lengths[0]) == 4
    assert int(prompt_lens[0]) == max(0, int(sequences.prompt_lens[0]) - (len(full) - 4))


def test_resume_with_a_larger_draft_vocabulary_widens_the_head_keeping_its_trained_rows(tmp_path, weights, sequences):
    """--resume --draft-vocab N of a head with fewer draft ids: its ids stay (logits of theirs unchanged), the
    most frequent response tokens it lacked join, sorted; a smaller N is refused with what to pass."""
    from speccycle.train import trainer

    base = dict(version=3, intermediate_size=32, ttt_steps=2, steps=2, warmup_steps=1, batch_tokens=256,
                save_every_s=1e9, log_every_s=1e9)  # fmt: skip
    model = LlamaModel(TINY, weights)
    out = tmp_path / "h.safetensors"
    narrow, _ = trainer.train_head(TrainConfig(draft_vocab_size=8, **base), sequences, model, out, log=lambda _: None)
    wide = trainer.widen_draft_vocabulary(narrow, 20, sequences, model)
    old, new = narrow.draft_to_target.tolist(), wide.draft_to_target.tolist()
    assert wide.config == attrs.evolve(narrow.config, draft_vocab_size=20) and new == sorted(new)
    assert set(old) <= set(new) and len(set(new)) == 20
    counts = np.bincount(
        np.concatenate([sequences.sequence(i)[int(sequences.prompt_lens[i]) :] for i in range(len(sequences))]),
        minlength=TINY.vocab_size,
    )
    added = sorted(set(new) - set(old))
    others = [t for t in range(TINY.vocab_size) if t not in set(new)]
    assert min(counts[added]) >= max(counts[others])  # the most frequent response tokens it lacked
    x = torch.randn(5, TINY.hidden_size)
    before, after = narrow.logits(model, x), wide.logits(model, x)
    rows = [new.index(t) for t in old]
    assert torch.equal(wide.w("lm_head.weight")[rows], narrow.w("lm_head.weight"))  # the trained rows, unchanged
    torch.testing.assert_close(after[:, rows], before)
    logs: list[str] = []
    _, record = trainer.train_head(
        TrainConfig(draft_vocab_size=20, **base), sequences, model, out, log=logs.append, resume=True
    )
    assert any("widened" in line for line in logs) and EagleHead.load(out).config.draft_vocab_size == 20
    with pytest.raises(ValueError, match="--draft-vocab >= 20"):
        trainer.widen_draft_vocabulary(wide, 8, sequences, model)


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


def test_train_and_eval_stages_start_from_a_folder_holding_only_data_npz(tmp_path, weights, sequences):
    """What the GPU run does: data.npz from an earlier generation, ``--stage train`` of 3full, then a short eval."""
    from importlib import resources

    from safetensors import safe_open
    from speccycle.engine.bench import SAMPLE_PROMPTS, load_prompts
    from speccycle.engine.drafters.eagle import LM_HEAD_KEY
    from speccycle.train import pipeline

    model_dir = save_hf(tmp_path / "tiny-llama", TINY, weights)
    out = tmp_path / "out"
    out.mkdir()
    sequences.save(out / "data.npz")
    common = f"--out {out} --model {model_dir} --device cpu --work-dir {tmp_path / 'w'} --versions 3full"
    train = f"--stage train {common} --steps 2 --batch-tokens 1024 --ttt-steps 2 --v3-intermediate 40 --train-minutes 5"
    assert pipeline.main(train.split()) == 0
    assert sorted(p.name for p in out.iterdir()) == ["data.npz", "eagle3full.safetensors", "pipeline.log"]
    head = EagleHead.load(out / "eagle3full.safetensors")
    assert head.config.version == 3 and head.config.draft_vocab_size == 0 and head.config.target_lm_head
    assert head.config.intermediate_size == 40
    with safe_open(str(out / "eagle3full.safetensors"), framework="pt") as f:
        assert f.metadata()[LM_HEAD_KEY] == "target"
        assert not {"lm_head.weight", "norm.weight", "draft_to_target"} & set(f.keys())
    bench = resources.files("speccycle.engine").joinpath("data", SAMPLE_PROMPTS)
    categories = {p["category"] for p in load_prompts(str(bench))}
    evaluate = f"--stage eval {common} --eval-prompts {bench} --eval-per-category 1 --eval-new-tokens 6 --chains 3"
    assert pipeline.main([*evaluate.split(), "--trees", ""]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["prompts"] == len(categories) and set(result["heads"]) == {"eagle3full"}
    (entry,) = result["heads"].values()
    assert entry["lm_head"] == "target" and len(entry["configs"]) == 1
    assert entry["configs"][0]["identical_to_ar"] == len(categories)
    assert "logits from the target's final norm and LM head" in (out / "HEAD_README.md").read_text()


SMOLLM2 = attrs.evolve(TINY, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64, rope_theta=100000.0)  # fmt: skip


@pytest.mark.parametrize("name", ["3", "3full"])
def test_default_eagle3_heads_for_smollm2_stay_under_10_mb(tmp_path, name):
    """The files `--versions 3` and `--versions 3full` write for SmolLM2-135M, counted: bf16, metadata included."""
    import argparse

    from speccycle.train.pipeline import _train_config, add_arguments
    from speccycle.train.trainer import save_head

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--versions", name])
    cfg = _train_config(args, name)
    hcfg = head_config(SMOLLM2, cfg)
    d2t = None if hcfg.target_lm_head else torch.arange(cfg.draft_vocab_size) * 7
    head = TrainableEagleHead.init(hcfg, d2t)
    info = {"command": "speccycle train-draft " + " ".join(f"--option-{i} value" for i in range(40)), "acc": [0.5] * 6}
    path = save_head(head, tmp_path / f"eagle{name}.safetensors", {**info, "config": attrs.asdict(cfg)})
    size = path.stat().st_size
    assert size < 10_000_000, size
    assert 0 <= size - head.num_bytes() < 20_000  # the header: names, config, training record
    params = sum(p.numel() for p in head.parameters())
    if name == "3full":  # the bytes EAGLE-3's own LM head took go to the MLP: 1408 wide instead of 384
        assert hcfg.intermediate_size == 1408 and params == 4_867_776
    else:
        assert hcfg.intermediate_size == 384 and hcfg.draft_vocab_size == 3072 and params == 4_868_352
    loaded = EagleHead.load(path)
    assert loaded.config == hcfg


def test_an_eagle3_file_saved_before_the_lm_head_key_loads_unchanged(tmp_path):
    """Files written before ``speccycle.eagle.lm_head`` existed carry only the config: they load as they did."""
    import json as json_

    from safetensors.torch import save_file
    from speccycle.engine.drafters.eagle import METADATA_KEY

    hcfg = head_config(TINY, TrainConfig(version=3, draft_vocab_size=64, intermediate_size=32))
    head = EagleHead.random(hcfg, seed=4, target_vocab=TINY.vocab_size)
    save_file(head.state(), str(tmp_path / "old.safetensors"), metadata={METADATA_KEY: json_.dumps(attrs.asdict(hcfg))})
    loaded = EagleHead.load(tmp_path / "old.safetensors")
    assert loaded.config == hcfg and not loaded.config.target_lm_head
    assert all(torch.equal(loaded.state()[k], v) for k, v in head.state().items())


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


@pytest.mark.parametrize("name", ["1", "3"])
def test_resume_with_a_wider_mlp_keeps_the_trained_units_and_the_heads_function(tmp_path, weights, sequences, name):
    """--resume --v3-intermediate N (or --v1-) of a head with fewer MLP units: the trained units stay, the new
    ones start with zero down-projection columns, so loss and accuracies are those of the narrow head; training
    then moves them. A narrower N is refused with what to pass; with a wider draft vocabulary too, both grow."""
    from speccycle.train import trainer

    version, vocab = HEADS[name]
    vocab = vocab and 8
    base = dict(version=version, ttt_steps=2, steps=2, warmup_steps=1, batch_tokens=256, save_every_s=1e9,
                log_every_s=1e9)  # fmt: skip
    model = LlamaModel(TINY, weights)
    out = tmp_path / "h.safetensors"
    narrow_cfg = TrainConfig(draft_vocab_size=vocab, intermediate_size=16, **base)
    narrow, _ = trainer.train_head(narrow_cfg, sequences, model, out, log=lambda _: None)
    wide = trainer.widen_mlp(narrow, 40)
    assert wide.config == attrs.evolve(narrow.config, intermediate_size=40)
    for unit in ("gate_proj", "up_proj"):
        assert torch.equal(wide.w(f"layer.{unit}.weight")[:16], narrow.w(f"layer.{unit}.weight"))
    assert torch.equal(wide.w("layer.down_proj.weight")[:, :16], narrow.w("layer.down_proj.weight"))
    assert not wide.w("layer.down_proj.weight")[:, 16:].any() and wide.w("layer.up_proj.weight")[16:].abs().sum() > 0
    t2d = trainer.draft_ids(narrow, TINY.vocab_size)
    ids, lengths, prompt_lens = collate(sequences, np.arange(len(sequences)), 640, "cpu")
    with torch.no_grad():
        loss_narrow, m_narrow = batch_loss(narrow, model, ids, lengths, prompt_lens, narrow_cfg, t2d)
        loss_wide, m_wide = batch_loss(wide, model, ids, lengths, prompt_lens, narrow_cfg, t2d)
    torch.testing.assert_close(loss_wide, loss_narrow)
    assert m_wide["acc"] == pytest.approx(m_narrow["acc"], abs=1e-6)
    logs: list[str] = []
    wider_cfg = TrainConfig(draft_vocab_size=vocab and 20, intermediate_size=40, **base)
    trained, record = trainer.train_head(wider_cfg, sequences, model, out, log=logs.append, resume=True)
    assert any("widened" in line and "MLP from 16 to 40" in line for line in logs), logs
    assert (name == "3") == any("draft vocabulary from 8 to 20" in line for line in logs)
    loaded = EagleHead.load(out).config
    assert loaded.intermediate_size == 40 and record["step"] == 4
    assert loaded.draft_vocab_size == (20 if name == "3" else None)
    assert trained.w("layer.down_proj.weight")[:, 16:].abs().sum() > 0  # the new units trained
    with pytest.raises(ValueError, match=">= 40"):
        trainer.widen_mlp(trained, 16)


def test_resume_with_more_layers_keeps_the_heads_function_then_trains_them(tmp_path, weights, sequences):
    """--resume --head-layers 2 of a one-layer head: the trained layer stays, the new one starts with zero O and
    down projections, so loss and accuracies are the one-layer head's; training then moves it. The two-layer
    file round-trips through int8 storage and drafts lossless in the engine; one-layer files keep their
    metadata without the new field; fewer layers are refused with what to pass."""
    from speccycle.engine.drafters.eagle import file_metadata
    from speccycle.engine.drafters.eagle_pack import pack_file
    from speccycle.train import trainer

    base = dict(version=3, draft_vocab_size=8, intermediate_size=24, ttt_steps=2, steps=2, warmup_steps=1,
                batch_tokens=256, save_every_s=1e9, log_every_s=1e9)  # fmt: skip
    model = LlamaModel(TINY, weights, feature_layers=head_config(TINY, TrainConfig(**base)).feature_layers)
    out = tmp_path / "h.safetensors"
    one, _ = trainer.train_head(TrainConfig(**base), sequences, model, out, log=lambda _: None)
    assert "num_layers" not in json.loads(file_metadata(one.config)["speccycle.eagle"])
    two = trainer.deepen(one, 2)
    assert two.config == attrs.evolve(one.config, num_layers=2)
    assert all(torch.equal(two.w(k), v) for k, v in one.state().items() if k != "draft_to_target")
    assert not two.w("layers.1.self_attn.o_proj.weight").any() and not two.w("layers.1.mlp.down_proj.weight").any()
    assert two.w("layers.1.self_attn.q_proj.weight").abs().sum() > 0
    t2d = trainer.draft_ids(one, TINY.vocab_size)
    ids, lengths, prompt_lens = collate(sequences, np.arange(len(sequences)), 640, "cpu")
    with torch.no_grad():
        loss_one, m_one = batch_loss(one, model, ids, lengths, prompt_lens, TrainConfig(**base), t2d)
        loss_two, m_two = batch_loss(two, model, ids, lengths, prompt_lens, TrainConfig(**base), t2d)
    torch.testing.assert_close(loss_two, loss_one)
    assert m_two["acc"] == pytest.approx(m_one["acc"], abs=1e-6)
    wide = trainer.widen_mlp(two, 40)  # every layer's MLP grows, each new unit's output zero
    assert wide.w("layers.1.mlp.down_proj.weight").shape == (TINY.hidden_size, 40)
    with torch.no_grad():
        loss_wide, _ = batch_loss(wide, model, ids, lengths, prompt_lens, TrainConfig(**base), t2d)
    torch.testing.assert_close(loss_wide, loss_one)
    logs: list[str] = []
    trained, record = trainer.train_head(
        TrainConfig(**{**base, "num_layers": 2}), sequences, model, out, log=logs.append, resume=True
    )
    assert any("deepened" in line and "from 1 to 2 decoder layers" in line for line in logs), logs
    assert record["step"] == 4 and trained.w("layers.1.mlp.down_proj.weight").abs().sum() > 0
    head = EagleHead.load(out)
    assert head.config.num_layers == 2 and len(head.extra_layers) == 1
    packed = tmp_path / "h.int8.safetensors"
    pack_file(out, packed)
    assert EagleHead.load(packed).config == head.config
    with pytest.raises(ValueError, match=">= 2"):
        trainer.deepen(trained, 1)
    # the deeper head drafts in the engine, chain and tree, and the output is the target's own greedy output
    prompt = sequences.sequence(0)[: int(sequences.prompt_lens[0])].tolist()
    for spec in (
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
        SpecConfig(num_steps=3, topk=2, num_draft_tokens=6),
    ):
        pool = PagedKVPool(num_pages=256, page_size=4)
        engine = Engine(model, pool, lambda e: EagleDraft(EagleHead.load(packed), e.model, e.pool), spec)
        (request,), stats = engine.generate([prompt], max_new_tokens=10, checked=True)
        assert list(request.output) == engine.generate_autoregressive([prompt], 10)[0] and stats.verifies > 0
        assert pool.num_free_pages == pool.num_pages
