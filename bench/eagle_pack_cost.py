"""What int8 storage (`eagle_pack`) costs an EAGLE head: the same measurements of the plain and the packed file.

On the same sequences (held-out training prompts from ``data.npz`` and Spec-Bench prompts by category,
answered greedily by the target, float32), each head runs teacher-forced (`TrainableEagleHead.unroll`,
the trainer's metric) and reports, per prompt set:

* ``tf_acc_by_step``: teacher-forced accuracy of draft steps ``0..S-1`` over the answer positions;
* ``replayed_tau``: the greedy chain cycle replayed from those predictions (`bench.eagle_gap.replay_chain`);
* ``agree_with_first_by_step``: share of positions where this head drafts the same token as the first
  head (the plain file) at each step.

Then the real cycle (engine, float32) runs each head on a handful of Spec-Bench prompts, chain and
tree, and reports tau and whether the output is identical to autoregressive decoding. A CPU run is
an accuracy measurement, not a timing.

    .venv/bin/python -m bench.eagle_pack_cost --heads eagle3.safetensors,eagle3.int8.safetensors \\
        --data data.npz --held-out 24 --eval-prompts spec_bench_dev.jsonl --per-category 2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.drafters.eagle import EagleDraft, EagleHead
from speccycle.engine.engine import Engine, load_model
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import default_model_path
from speccycle.train.data import SelfDistilledData
from speccycle.train.evaluate import accept_lengths, summarize
from speccycle.train.features import target_outputs
from speccycle.train.head import TrainableEagleHead
from speccycle.train.trainer import TrainConfig, split_validation

from .common import write_result
from .eagle_gap import _argmax, replay_chain


@torch.no_grad()
def drafts_of_heads(heads: dict, model: LlamaModel, seqs: list[list[int]], steps: int, batch: int) -> dict:
    """Per head, per sequence ``(drafts [steps, T], greedy [T])`` as `bench.eagle_gap.unrolled_drafts`,
    with one target forward per batch shared by every head."""
    out = {name: [None] * len(seqs) for name in heads}
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        ids = torch.zeros((len(chunk), max(len(seqs[i]) for i in chunk)), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        layers = next(iter(heads.values())).config.feature_layers
        target = target_outputs(model, ids.to(model.device), layers)
        for name, head in heads.items():
            hidden = head.unroll(model, ids.to(model.device), target.features, steps)
            drafts = torch.stack([_argmax(head, model, h) for h in hidden])  # [steps, B, T]
            if not head.config.target_lm_head:
                drafts = head.draft_to_target[drafts]
            for row, i in enumerate(chunk):
                n = len(seqs[i])
                out[name][i] = (drafts[:, row, :n].cpu(), target.greedy[row, :n].cpu())
    return out


def teacher_forced(heads, model, prompts, categories, answers, steps, batch) -> dict:
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    predictions = drafts_of_heads(heads, model, seqs, steps, batch)
    first = next(iter(heads))
    result = {}
    for name in heads:
        hits = defaultdict(lambda: [[0, 0] for _ in range(steps)])
        agree = [[0, 0] for _ in range(steps)]
        lens = defaultdict(list)
        for seq, prompt, cat, (drafts, greedy), (ref, _) in zip(
            seqs, prompts, categories, predictions[name], predictions[first]
        ):
            p, end = len(prompt), len(seq)
            for key in (cat, "all"):
                lens[key] += replay_chain(drafts, greedy, p, end, steps)
            for s in range(steps):
                anchors = slice(p - 1, end - 2 - s)  # step s at anchor k drafts the token at k + s + 2
                if anchors.start >= anchors.stop:
                    continue
                hit = drafts[s, anchors] == greedy[p + s : end - 1]
                for key in (cat, "all"):
                    hits[key][s][0] += int(hit.sum())
                    hits[key][s][1] += hit.numel()
                same = drafts[s, anchors] == ref[s, anchors]
                agree[s][0] += int(same.sum())
                agree[s][1] += same.numel()
        rows = {}
        for key in sorted(hits, key=lambda k: (k == "all", k)):
            summary = summarize([key], [lens[key]], steps)
            rows[key] = {
                "positions": hits[key][0][1],
                "tf_acc_by_step": [round(h / max(n, 1), 4) for h, n in hits[key]],
                "replayed_tau": summary["tau"],
                "replayed_accept_rate_by_position": summary["accept_rate_by_position"],
            }
        rows["all"]["agree_with_first_by_step"] = [round(a / max(n, 1), 4) for a, n in agree]
        result[name] = rows
    return result


def real_cycle(head_paths: dict, config, weights, prompts, categories, reference, new_tokens, specs) -> dict:
    """Each head in the engine's cycle (float32, CPU): tau per spec and identity with ``reference``."""
    out = {}
    for name, path in head_paths.items():
        head = EagleHead.load(path, torch.float32)
        layers = head.config.feature_layers if head.config.version == 3 else None
        target = LlamaModel(config, weights, feature_layers=layers)
        out[name] = {}
        for spec in specs:
            tokens = sum(len(x) for x in prompts) + len(prompts) * (new_tokens + 2 * spec.num_draft_tokens + 64)
            pool = PagedKVPool(num_pages=-(-tokens // spec.page_size), page_size=spec.page_size)
            engine = Engine(target, pool, lambda e, head=head: EagleDraft(head, e.model, e.pool), spec)
            outputs, lens = accept_lengths(engine, prompts, new_tokens)
            summary = summarize(categories, lens, spec.num_steps)
            key = f"S{spec.num_steps}_K{spec.topk}_N{spec.num_draft_tokens}"
            out[name][key] = {
                "tau": summary["tau"],
                "tau_by_category": summary["tau_by_category"],
                "accept_rate_by_position": summary["accept_rate_by_position"],
                "verifies": summary["verifies"],
                "identical_to_ar": sum(list(o) == list(r) for o, r in zip(outputs, reference)),
                "prompts": len(prompts),
            }
            print(
                f"[cycle] {name} {key}: tau {summary['tau']} identical {out[name][key]['identical_to_ar']}/"
                f"{len(prompts)}",
                flush=True,
            )
    return out


def per_category(items: list[dict], count: int) -> list[dict]:
    taken: dict = defaultdict(int)
    picked = []
    for item in items:
        if taken[item["category"]] < count:
            taken[item["category"]] += 1
            picked.append(item)
    return picked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", required=True, help="comma-separated head files, the plain (reference) one first")
    p.add_argument("--data", default=None, help="generated data.npz: its held-out prompts are the first set")
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--eval-prompts", default=None, help="Spec-Bench JSONL (default: the 13-prompt sample)")
    p.add_argument("--per-category", type=int, default=2, help="Spec-Bench prompts per category (teacher forcing)")
    p.add_argument("--cycle-per-category", type=int, default=1, help="of those, per category in the real cycle")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="draft steps of the teacher-forced unroll and replay")
    p.add_argument("--specs", default="5x1x6,6x4x32", help="real-cycle S x K x N, comma-separated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    paths = {Path(h).name: h for h in args.heads.split(",")}
    config, weights, path = load_model(None, torch.float32)
    tokenizer = Tokenizer.from_gguf(path if path.suffix == ".gguf" else default_model_path())
    model = LlamaModel(config, weights, dtype=torch.float32)
    heads = {name: TrainableEagleHead.from_eagle_head(EagleHead.load(h)) for name, h in paths.items()}

    def answer(prompts):
        tokens = sum(len(x) for x in prompts) + len(prompts) * (args.new_tokens + 64)
        engine = Engine(model, PagedKVPool(num_pages=-(-tokens // 16), page_size=16), None, SpecConfig(page_size=16))
        start = time.perf_counter()
        out = engine.generate_autoregressive(prompts, args.new_tokens)
        print(f"answered {len(prompts)} prompts ({time.perf_counter() - start:.0f}s)", flush=True)
        return out

    result = {
        "heads": {name: {"file": h, "bytes": Path(h).stat().st_size} for name, h in paths.items()},
        "new_tokens": args.new_tokens,
        "steps": args.steps,
        "dtype": "float32",
        "note": "CPU accuracy measurement of the same sequences for each head; not a timing",
        "sets": {},
    }
    if args.data:
        data = SelfDistilledData.load(args.data)
        _, val = split_validation(data, TrainConfig())
        prompts = [val.items_at(i)[1] for i in range(min(args.held_out, len(val)))]
        answers = answer(prompts)
        result["sets"]["held_out_training"] = teacher_forced(
            heads, model, prompts, ["train"] * len(prompts), answers, args.steps, args.batch
        )
    items = per_category(load_prompts(args.eval_prompts), args.per_category)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": i["text"]}]) for i in items]
    cats = [i["category"] for i in items]
    answers = answer(prompts)
    result["sets"]["spec_bench"] = teacher_forced(heads, model, prompts, cats, answers, args.steps, args.batch)
    for set_name, rows in result["sets"].items():
        for name, r in rows.items():
            print(
                f"[{set_name}] {name}: tf_acc {r['all']['tf_acc_by_step']} replayed tau {r['all']['replayed_tau']} "
                f"agree {r['all']['agree_with_first_by_step']}",
                flush=True,
            )
    picked = set(map(id, per_category(items, args.cycle_per_category)))
    chosen = [k for k, item in enumerate(items) if id(item) in picked]
    specs = []
    for text in args.specs.split(","):
        s, k, n = (int(x) for x in text.split("x"))
        specs.append(SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, page_size=16))
    result["real_cycle"] = real_cycle(
        paths,
        config,
        weights,
        [prompts[k] for k in chosen],
        [cats[k] for k in chosen],
        [answers[k] for k in chosen],
        args.new_tokens,
        specs,
    )
    out = write_result("eagle_pack_cost", result, "cpu", args.out)
    print(f"wrote {out}")
    print(json.dumps({n: {k: v["tau"] for k, v in r.items()} for n, r in result["real_cycle"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
