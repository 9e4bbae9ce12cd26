"""Broader training prompts (`train.augment`), self-generated prompts (`train.self_prompts`), several data files.

The augment tests run on a few prompts shaped like the training file's templates (T0, GSM8K,
Self-Instruct; written here); the self-prompt tests on a tiny random Llama with SmolLM2's vocabulary
whose LM head favours a few word tokens and the end-of-turn token, so sampled user turns end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re

import numpy as np
import pytest
import torch
from speccycle.engine.models.llama import random_llama_weights
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.engine.weights.weights_hf import save_hf
from speccycle.train.augment import OverlapFilter, augment, excluded_texts, main
from speccycle.train.augment_kinds import KINDS
from speccycle.train.data import EngineGenerator, SelfDistilledData, load_train_prompts
from speccycle.train.self_prompts import sample_user_turns, user_turn_prefix
from speccycle.train.trainer import TrainConfig, split_validation

HARBOR = (
    "The harbor town of Eastwick opened a new ferry terminal on Monday after three years of construction. "
    "Mayor Linda Osei said the terminal would cut travel times to the islands by half. The project cost "
    "42 million dollars and was paid for by the regional government. Local fishermen worried that the "
    "larger ferries would disturb the fishing grounds near the northern pier."
)
GLACIER = (
    "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow is "
    "pressed into dense ice, which begins to flow slowly downhill under its own weight. As a glacier moves, "
    "it scrapes the rock beneath it and carries stones far from where they started. Scientists measure "
    "glaciers to learn how the climate has changed."
)
BAKERY = (
    "I stopped at this bakery on a rainy afternoon and it was a wonderful surprise. The cinnamon rolls were "
    "still warm, the coffee was strong, and the staff remembered my name on the second visit. Prices are a "
    "little high, and the seating is cramped at lunch time. Still, I will come back for the rye bread."
)
PROMPTS = [
    {"source": "t0:xsum_DOC_tldr", "prompt": f"{HARBOR}\n\nTL;DR:"},
    {"source": "t0:cnn_dailymail_3_0_0_news_summary", "prompt": f"Summarise the article:\n\n{GLACIER}"},
    {
        "source": "t0:adversarial_qa_dbert_answer_the_following_q",
        "prompt": f'Given the following passage\n\n"{HARBOR}",\n\nanswer the following question. Note that the '
        "answer is present within the text.\n\nQuestion: How much did the ferry terminal cost?",
    },
    {
        "source": "t0:quoref_Given_Context_Answer_Question",
        "prompt": "What do scientists learn by measuring glaciers?\n\nAnswer the above question based on the context "
        f"below:\n\n{GLACIER}",
    },
    {"source": "t0:yelp_review_full_this_place", "prompt": f"{BAKERY} My rating for this place is"},
    {
        "source": "t0:samsum_Summarize_",
        "prompt": "Summarize: Anna: Are we still meeting at six?\nTom: Yes, at the cafe by the station.\n"
        "Anna: Great, I will bring the tickets.\nTom: Perfect, see you there.",
    },
    {
        "source": "t0:trec_trec1",
        "prompt": "What is the longest river in South America ?\n\nIs this asking about Description, Entity, "
        "Abbreviation, Person, Quantity, Location?",
    },
    {
        "source": "t0:kilt_tasks_hotpotqa_straighforward_qa",
        "prompt": "Which composer wrote the opera that premiered in the city where Mozart was born?",
    },
    {
        "source": "t0:sciq_Direct_Question_Closed_Book_",
        "prompt": "Q: What gas do plants take in from the air during photosynthesis?\n\n\nA:",
    },
    {
        "source": "t0:common_gen_Put_together",
        "prompt": "Put the concepts together to form a sentence: river, boat, bridge.",
    },
    {
        "source": "t0:gigaword_write_its_sentence",
        "prompt": "the city council approved a new budget for public libraries on tuesday , officials said .\n\n===\n\n"
        "Given the above sentence, write its title:",
    },
    {
        "source": "gsm8k_train",
        "prompt": "Mia buys 4 boxes of pencils with 12 pencils each. She gives away 9. How many are left?",
    },
    {
        "source": "gsm8k_train",
        "prompt": "A bus carries 38 people. At the first stop 11 get off and 6 get on. How many now?",
    },
    {"source": "self_instruct_user", "prompt": "Suggest three names for a new bakery.\n\nIt sells bread and cakes."},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_augment_is_deterministic_balanced_and_covers_every_kind():
    rows, report = augment(PROMPTS, count=10 * len(KINDS), seed=3)
    again, _ = augment(PROMPTS, count=10 * len(KINDS), seed=3)
    other, _ = augment(PROMPTS, count=10 * len(KINDS), seed=4)
    assert rows == again and rows != other
    assert report["kinds"] == {kind: 10 for kind in KINDS} and not report["short"]
    assert {row["source"].split(":")[1] for row in rows} == set(KINDS)
    assert all(re.fullmatch(r"aug:[a-z]+:.+", row["source"]) for row in rows)
    keys = [" ".join(re.findall(r"[a-z0-9]+", row["prompt"].lower())) for row in rows]
    training = {" ".join(re.findall(r"[a-z0-9]+", p["prompt"].lower())) for p in PROMPTS}
    assert len(set(keys)) == len(keys) and not set(keys) & training  # no repeats, no training prompt repeated
    # material from the prompts is reused: the passage, the dialogue and a GSM8K problem all reappear
    text = "\n".join(row["prompt"] for row in rows)
    assert "Eastwick" in text and "Anna:" in text and "pencils" in text


ORCHARD = (
    "The orchard on the hill has grown apples for four generations of the Moreno family. This year a late frost "
    "damaged half of the blossoms, and the harvest fell to its lowest level in a decade. The family sold cider "
    "and jam at the weekend market to make up the difference, and neighbours helped pick what fruit remained."
)
ROBOT = (
    "Engineers at a small university lab built a robot that sorts recycling by touch rather than by sight. Its "
    "gripper measures how much each item bends, which tells paper from plastic and metal. In a month of tests "
    "it sorted household waste with fewer mistakes than a camera system, though it worked more slowly."
)
LIBRARY = (
    "The city library reopened its reading room after a year of repairs to the roof and windows. Visitors found "
    "new lamps, wider desks and a corner for children with picture books in six languages. The librarians also "
    "started evening hours on Thursdays so that people who work during the day can borrow books."
)


def test_long_context_kinds_stitch_passages_and_are_only_made_when_asked_for():
    from speccycle.train.augment import estimate_tokens
    from speccycle.train.augment_kinds import LONG_KINDS

    prompts = PROMPTS + [{"source": "t0:xsum_DOC_tldr", "prompt": f"{text}\n\nTL;DR:"} for text in
                         (ORCHARD, ROBOT, LIBRARY)]  # fmt: skip
    rows, report = augment(prompts, count=40, seed=1, max_tokens=2000, kinds=list(LONG_KINDS))
    assert report["kinds"] == {"longsummary": 20, "longrag": 20} and not report["short"]
    assert augment(prompts, count=40, seed=1, max_tokens=2000, kinds=list(LONG_KINDS))[0] == rows
    names = ("Eastwick", "Glaciers", "cinnamon", "Moreno", "gripper", "reading room")
    for row in rows:
        kind = row["source"].split(":")[1]
        stitched = sum(name in row["prompt"] for name in names)
        assert stitched >= (4 if kind == "longsummary" else 3), row["prompt"]
        assert 150 < estimate_tokens(row["prompt"]) <= 2000
    # the default kinds are unchanged, and a cap below their length refuses them
    assert set(augment(prompts, count=22, seed=1)[1]["kinds"]) == set(KINDS)
    _, capped = augment(prompts, count=10, seed=1, max_tokens=120, kinds=["longsummary"])
    assert capped["kinds"] == {"longsummary": 0} and capped["refused"]["too_long"] > 0
    with pytest.raises(ValueError, match="longrag"):
        augment(prompts, count=2, kinds=["longer"])


def test_augment_refuses_prompts_sharing_eight_words_with_spec_bench(tmp_path):
    leak = "Mayor Linda Osei said the terminal would cut travel times to the islands by half."
    bench = _write_jsonl(tmp_path / "bench.jsonl", [{"question_id": 2, "category": "summarization", "turns": [leak]}])
    exclude = OverlapFilter(excluded_texts([bench]))
    rows, report = augment(PROMPTS, count=20 * len(KINDS), seed=0, exclude=exclude)
    assert report["refused"]["spec_bench_overlap"] > 0
    leaked = re.findall(r"[a-z0-9]+", leak.lower())
    grams = {tuple(leaked[i : i + 8]) for i in range(len(leaked) - 7)}
    for row in rows:
        words = re.findall(r"[a-z0-9]+", row["prompt"].lower())
        assert not {tuple(words[i : i + 8]) for i in range(len(words) - 7)} & grams, row
    assert OverlapFilter([leak]).overlaps("x " + leak.upper()) and not OverlapFilter([leak]).overlaps(leak[:30])


def test_augment_cli_writes_gzip_jsonl_and_refuses_a_spec_bench_file(tmp_path, capsys):
    prompts = _write_jsonl(tmp_path / "train.jsonl", PROMPTS)
    out = tmp_path / "aug.jsonl.gz"
    argv = ["--prompts", str(prompts), "--out", str(out), "--count", "44", "--estimate-tokens", "--max-tokens", "200"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "prompts per kind:" in printed and "refused:" in printed
    rows = load_train_prompts(out)  # the generate stage reads it as it is
    assert len(rows) == 44 and all(row["source"].startswith("aug:") for row in rows)
    first = out.read_bytes()
    assert main(argv) == 0 and out.read_bytes() == first  # same bytes: no timestamp in the gzip header
    with gzip.open(out, "rt") as f:
        assert all(len(json.loads(line)["prompt"]) * 10 // 32 + 24 <= 200 for line in f)
    bench = _write_jsonl(tmp_path / "bench.jsonl", [{"question_id": 1, "category": "qa", "turns": ["Why?"]}])
    assert main(["--prompts", str(bench), "--out", str(tmp_path / "x.jsonl"), "--estimate-tokens"]) == 2
    assert "Spec-Bench" in capsys.readouterr().err


def _data(seed: int, n: int) -> SelfDistilledData:
    rng = np.random.default_rng(seed)
    items = [(i, rng.integers(3, 900, 5).tolist(), rng.integers(3, 900, 4 + i % 3).tolist()) for i in range(n)]
    return SelfDistilledData.from_sequences(items, 49152, {"prompts_file": f"p{seed}.jsonl"})


def test_several_data_files_load_as_one_with_a_deterministic_held_out_split(tmp_path):
    from speccycle.train import pipeline

    a, b = _data(0, 30), _data(1, 25)
    a.save(tmp_path / "a.npz")
    b.save(tmp_path / "b.npz")
    both = SelfDistilledData.load_many(f"{tmp_path / 'a.npz'},{tmp_path / 'b.npz'}")
    assert len(both) == 55 and both.response_tokens == a.response_tokens + b.response_tokens
    for i in range(30):
        assert both.sequence(i).tolist() == a.sequence(i).tolist()
    for i in range(25):
        assert both.items_at(30 + i) == b.items_at(i)
    assert [p["file"] for p in both.meta["parts"]] == ["a.npz", "b.npz"]
    assert [p["first_sequence"] for p in both.meta["parts"]] == [0, 30]
    args = argparse.Namespace(data=f"{tmp_path / 'a.npz'},{tmp_path / 'b.npz'}", out=str(tmp_path))
    loaded = pipeline._load_data(args)
    assert np.array_equal(loaded.tokens, both.tokens) and np.array_equal(loaded.offsets, both.offsets)
    train, held = split_validation(loaded, TrainConfig(val_sequences=3))
    train2, held2 = split_validation(pipeline._load_data(args), TrainConfig(val_sequences=3))
    assert len(held) == 2 and np.array_equal(held.tokens, held2.tokens) and np.array_equal(train.tokens, train2.tokens)
    with pytest.raises(ValueError, match="writes one file"):
        pipeline._data_path(args)


# ---- self-generated prompts ---------------------------------------------------------------------------------
TINY = LlamaConfig(
    architecture="llama",
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)
WORDS = "the a cat dog sat ran on under big small red house tree river today please write explain why how".split()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from speccycle.engine.tokenizers.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def talkative(tokenizer):
    """Random weights whose LM head prefers a few word tokens and <|im_end|> (id 2): sampled turns end."""
    weights = random_llama_weights(TINY, seed=5, scale=0.05)
    weights["model.embed_tokens.weight"][:, 0] = 4.0  # the residual stream (and the final norm's output) leans on dim 0
    chosen = [tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in WORDS] + [2]
    weights["lm_head.weight"][:, 0] = -1.0
    weights["lm_head.weight"][chosen, 0] = 1.0
    weights["lm_head.weight"][2, 0] = 1.15  # about one token in seven ends the turn
    return weights


def test_the_user_turn_prefix_is_the_chat_template_up_to_the_users_words(tokenizer):
    prefix = user_turn_prefix(tokenizer)
    full = tokenizer.render_chat([{"role": "user", "content": "Hello there"}], add_generation_prompt=False)
    assert prefix.text.endswith("<|im_start|>user\n") and full.startswith(prefix.text)
    assert tokenizer.decode(list(prefix.ids)) == prefix.text and prefix.end_ids == (2,)  # <|im_end|>


@pytest.mark.parametrize("generator", ["engine", "hf"])
def test_self_prompts_on_a_tiny_random_llama_are_well_formed_and_seeded(tmp_path, tokenizer, talkative, generator):
    if generator == "hf":  # the GPU path: transformers sampling (temperature, top-p), seeded
        pytest.importorskip("transformers")
        from speccycle.train.data import HFGenerator

        generate = HFGenerator(save_hf(tmp_path / "tiny", TINY, talkative), "cpu", torch.float32, TINY.eos_token_ids)
    else:
        generate = EngineGenerator(TINY, talkative, "cpu", torch.float32, TINY.eos_token_ids)
    prefix = user_turn_prefix(tokenizer)
    exclude = OverlapFilter(["the cat sat on the big red house today under the tree"])
    run = dict(count=12, batch_size=6, max_new_tokens=24, seed=7, stop_ids=(2,), exclude=exclude, log=lambda _: None)
    texts, stats = sample_user_turns(generate, tokenizer, prefix, **run)
    again, _ = sample_user_turns(generate, tokenizer, prefix, **run)
    other, _ = sample_user_turns(generate, tokenizer, prefix, **{**run, "seed": 8})
    assert texts == again and texts != other
    assert stats["sampled"] == 12 and stats["kept"] == len(texts) >= 4
    assert stats["kept"] + sum(stats["refused"].values()) == 12
    keys = [" ".join(t.lower().split()) for t in texts]
    assert len(set(keys)) == len(keys)
    for text in texts:
        assert text == text.strip() and len(text.split()) >= 2 and "<|" not in text
        assert set(text.lower().split()) <= set(WORDS)
        assert not exclude.overlaps(text)


def test_pipeline_generate_answers_self_prompts_and_records_them(tmp_path, talkative):
    from speccycle.train import pipeline

    model_dir = save_hf(tmp_path / "tiny-llama", TINY, talkative)
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"source": "t", "prompt": p} for p in ["Hi.", "Name a color."]])
    more = _write_jsonl(tmp_path / "q.jsonl", [{"source": "t", "prompt": "Count to three."}])
    out = tmp_path / "out"
    argv = f"""--stage generate --out {out} --model {model_dir} --prompts {prompts},{more} --device cpu
        --work-dir {tmp_path / "w"} --generator engine --max-new-tokens 4 --gen-batch 8 --self-prompts 12
        --self-prompt-tokens 24""".split()
    assert pipeline.main(argv) == 0
    data = SelfDistilledData.load(out / "data.npz")
    record = data.meta["self_prompts"]
    assert data.meta["prompts_file"] == "p.jsonl,q.jsonl" and record["sampled"] == 12 and record["kept"] >= 3
    rows = load_train_prompts(out / "data.self_prompts.jsonl")
    assert len(rows) == record["kept"] and all(r["source"] == "self:tiny-llama" for r in rows)
    assert len(data) == 3 + len(rows) and sorted(data.prompt_index.tolist()) == list(range(3 + len(rows)))
    assert f"{record['kept']} of 12 kept" in (out / "pipeline.log").read_text()
    assert pipeline.main([*argv, "--resume"]) == 0  # reloads the self-prompts; nothing left to answer
    resumed = SelfDistilledData.load(out / "data.npz")
    assert len(resumed) == len(data) and resumed.meta["self_prompts"] == record
