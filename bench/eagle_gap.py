"""Where an EAGLE head's training estimate and its measured tau part: teacher forcing vs the cycle, per prompt set.

The trainer logs teacher-forced accuracy per draft step on held-out training sequences; the eval stage
measures tau with the real cycle on Spec-Bench. This puts both on the same footing. For each prompt
set (held-out training prompts from ``data.npz``, Spec-Bench prompts by category) the target answers
greedily with the engine; the trainer's head (`TrainableEagleHead.unroll`) then runs teacher-forced over
prompt + answer, and a greedy chain cycle is replayed from its predictions: a verify at ``L`` drafts the
unrolled steps at anchor ``L - 1``, accepts while they equal the target's greedy tokens, and moves ``L``
on by the accept length. That replay is the cycle's own arithmetic (tests/unit/test_eagle_train_cycle_parity.py
checks that every draft the cycle builds is the unrolled head's); ``--check-cycle`` also runs the real
cycle on the Spec-Bench prompts and prints both taus. Reported per set and category:

* ``tf_acc``: teacher-forced step-0 accuracy over every answer position (the training log's first number);
* ``tau`` and ``accept_rate_by_position`` of the replayed chain (``P(depth d | depth d - 1)``, per verify:
  verifies crowd where the head is wrong, so position 0 sits below ``tf_acc``);
* ``tf_acc_by_64``: step-0 accuracy per 64 answer tokens; ``draft_vocab_coverage`` (EAGLE-3): share
  of answer tokens the head's reduced vocabulary holds; ``prompt_tokens`` (median).

    .venv/bin/python -m bench.eagle_gap --heads out/eagle3.safetensors --data out/data.npz \\
        --eval-prompts spec_bench_dev.jsonl --per-category 5 --held-out 24
"""

from __future__ import annotations

import argparse
import json
import statistics
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


@torch.no_grad()
def unrolled_drafts(head: TrainableEagleHead, model: LlamaModel, seqs: list[list[int]], steps: int, batch: int):
    """Per sequence ``(drafts [steps, T], greedy [T])``: target ids; step ``s`` at anchor ``k`` drafts
    position ``k + s + 2``, ``greedy[k]`` is the target's argmax at ``k``. Right-padded batches."""
    out: list = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        width = max(len(seqs[i]) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        ids = ids.to(model.device)
        target = target_outputs(model, ids, head.config.feature_layers)
        hidden = head.unroll(model, ids, target.features, steps)
        drafts = torch.stack([_argmax(head, model, h) for h in hidden])  # [steps, B, T]
        if not head.config.target_lm_head:  # EAGLE-3's own reduced vocabulary
            drafts = head.draft_to_target[drafts]
        for row, i in enumerate(chunk):
            n = len(seqs[i])
            out[i] = (drafts[:, row, :n].cpu(), target.greedy[row, :n].cpu())
    return out


def _argmax(head: TrainableEagleHead, model: LlamaModel, hidden: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """The head's greedy token at each row of ``hidden [B, T, H]`` -> ``[B, T]`` (logits over the target's head
    are 49k wide)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return torch.cat([head.logits(model, chunk).argmax(-1) for chunk in flat.split(rows)]).view(hidden.shape[:2])


def replay_chain(drafts: torch.Tensor, greedy: torch.Tensor, prompt_len: int, end: int, steps: int) -> list[int]:
    """Accept lengths of a greedy chain cycle over committed tokens ``[0, end)`` (answer from ``prompt_len``).

    After prefill ``L = prompt_len`` (the first answer token is the root). A verify at ``L`` feeds the
    drafts of anchor ``L - 1``; depth ``d + 1`` is accepted while each equals ``greedy`` at ``L + d``;
    nothing past ``end`` is committed (max tokens or the stop token ended the answer there).
    """
    drafts, greedy = drafts.tolist(), greedy.tolist()
    lens, L = [], prompt_len
    while L + 1 < end:
        k, accepted = L - 1, 0
        while accepted < steps and L + 1 + accepted < end and drafts[accepted][k] == greedy[L + accepted]:
            accepted += 1
        lens.append(accepted + 1)
        L += accepted + 1
    return lens


def measure(name, heads, model, prompts, categories, answers, steps, batch, log) -> dict:
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    result = {}
    for head_name, head in heads.items():
        per = defaultdict(lambda: {"lens": [], "hits": 0, "n": 0, "by64": defaultdict(lambda: [0, 0]), "cov": [0, 0]})
        keep = None
        if not head.config.target_lm_head:
            keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
            keep[head.draft_to_target.cpu()] = True
        predictions = unrolled_drafts(head, model, seqs, steps, batch)
        for seq, prompt, cat, (drafts, greedy) in zip(seqs, prompts, categories, predictions):
            p, end = len(prompt), len(seq)
            for key in dict.fromkeys((cat, "all")):
                entry = per[key]
                entry["lens"] += replay_chain(drafts, greedy, p, end, steps)
                for k in range(p - 1, end - 2):  # step 0 at anchor k drafts the answer token at k + 2
                    hit = int(drafts[0, k]) == int(greedy[k + 1])
                    entry["hits"] += hit
                    entry["n"] += 1
                    entry["by64"][(k - p + 1) // 64][0] += hit
                    entry["by64"][(k - p + 1) // 64][1] += 1
                if keep is not None:
                    entry["cov"][0] += int(keep[torch.tensor(seq[p:], dtype=torch.long)].sum())
                    entry["cov"][1] += end - p
        rows = {}
        for key, entry in per.items():
            summary = summarize([key], [entry["lens"]], steps)
            lens_p = [len(x) for x, c in zip(prompts, categories) if key in (c, "all")]
            rows[key] = {
                "prompts": len(lens_p),
                "prompt_tokens": int(statistics.median(lens_p)),
                "tf_acc": round(entry["hits"] / max(entry["n"], 1), 4),
                "tf_acc_by_64": [round(h / n, 4) for _, (h, n) in sorted(entry["by64"].items())],
                "tau": summary["tau"],
                "accept_rate_by_position": summary["accept_rate_by_position"],
                "verifies": summary["verifies"],
            }
            if keep is not None:
                rows[key]["draft_vocab_coverage"] = round(entry["cov"][0] / max(entry["cov"][1], 1), 4)
        result[head_name] = rows
        for key in sorted(rows, key=lambda k: (k == "all", k)):
            r = rows[key]
            cov = f" vocab {r['draft_vocab_coverage']:.3f}" if "draft_vocab_coverage" in r else ""
            log(
                f"[{name}] {head_name} {key:15s} prompts {r['prompts']:3d} (median {r['prompt_tokens']:4d} tok) "
                f"tf_acc {r['tf_acc']:.3f} by64 {r['tf_acc_by_64']} tau {r['tau']} "
                f"accept {r['accept_rate_by_position']}{cov}"
            )
    return result


def check_cycle(name: str, rows: dict, args, prompts, categories, log) -> None:
    """The real chain cycle (engine, float32) on the same prompts: its tau beside the replayed one."""
    config, weights, _ = load_model(None, torch.float32)
    for head_name, head_path in zip(rows, args.heads.split(",")):
        head = EagleHead.load(head_path, torch.float32, args.device)
        layers = head.config.feature_layers if head.config.version == 3 else None
        target = LlamaModel(config, weights, device=args.device, feature_layers=layers)
        tokens = sum(len(x) for x in prompts) + len(prompts) * (args.new_tokens + 4 * args.steps + 64)
        pool = PagedKVPool(num_pages=-(-tokens // 16), page_size=16, device=args.device)
        spec = SpecConfig(num_steps=args.steps, page_size=16)
        engine = Engine(target, pool, lambda e, head=head: EagleDraft(head, e.model, e.pool), spec)
        _, lens = accept_lengths(engine, prompts, args.new_tokens)
        real = summarize(categories, lens, args.steps)
        rows[head_name]["all"]["real_cycle"] = {k: real[k] for k in ("tau", "accept_rate_by_position", "verifies")}
        log(
            f"[{name}] {head_name} real cycle: tau {real['tau']} accept {real['accept_rate_by_position']} "
            f"(replayed: tau {rows[head_name]['all']['tau']})"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", required=True, help="comma-separated EAGLE head files")
    p.add_argument("--data", default=None, help="generated data.npz: its held-out prompts are the first set")
    p.add_argument("--held-out", type=int, default=24, help="held-out training prompts to answer")
    p.add_argument("--eval-prompts", default=None, help="Spec-Bench JSONL (default: the 13-prompt sample)")
    p.add_argument("--per-category", type=int, default=None, help="Spec-Bench prompts per category (default all)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="chain depth S of the replayed cycle")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8, help="sequences per teacher-forced batch")
    p.add_argument("--check-cycle", action="store_true", help="also run the real chain cycle on each set")
    p.add_argument("--out", default=None, help="result directory (default bench/results)")
    args = p.parse_args(argv)
    dtype = torch.float32  # the eval stage's dtype; the trainer's bf16 gives the same accuracy to 0.01
    log = lambda m: print(m, flush=True)  # noqa: E731
    config, weights, path = load_model(None, dtype)
    tokenizer = Tokenizer.from_gguf(path if path.suffix == ".gguf" else default_model_path())
    model = LlamaModel(config, weights, dtype=dtype, device=args.device)
    heads = {
        Path(h).stem: TrainableEagleHead.from_eagle_head(EagleHead.load(h)).to(args.device)
        for h in args.heads.split(",")
    }

    def answer(prompts):
        tokens = sum(len(x) for x in prompts) + len(prompts) * (args.new_tokens + 64)
        pool = PagedKVPool(num_pages=-(-tokens // 16), page_size=16, device=args.device)
        engine = Engine(model, pool, None, SpecConfig(page_size=16))
        start = time.perf_counter()
        out = engine.generate_autoregressive(prompts, args.new_tokens)
        log(f"answered {len(prompts)} prompts in {time.perf_counter() - start:.0f}s")
        return out

    result = {"new_tokens": args.new_tokens, "steps": args.steps, "dtype": "float32", "sets": {}}
    if args.data:
        data = SelfDistilledData.load(args.data)
        _, val = split_validation(data, TrainConfig())
        prompts = [val.items_at(i)[1] for i in range(min(args.held_out, len(val)))]
        result["sets"]["held_out_training"] = measure(
            "held-out", heads, model, prompts, ["train"] * len(prompts), answer(prompts), args.steps, args.batch, log
        )
        if args.check_cycle:
            check_cycle("held-out", result["sets"]["held_out_training"], args, prompts, ["train"] * len(prompts), log)
    items = load_prompts(args.eval_prompts)
    if args.per_category:
        taken: dict = defaultdict(int)
        picked = []
        for item in items:
            if taken[item["category"]] < args.per_category:
                taken[item["category"]] += 1
                picked.append(item)
        items = picked
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": i["text"]}]) for i in items]
    cats = [i["category"] for i in items]
    answers = answer(prompts)
    result["sets"]["spec_bench"] = measure(
        "spec-bench", heads, model, prompts, cats, answers, args.steps, args.batch, log
    )
    if args.check_cycle:
        check_cycle("spec-bench", result["sets"]["spec_bench"], args, prompts, cats, log)
    path = write_result("eagle_gap", result, args.device, args.out)
    log(f"wrote {path}")
    log(json.dumps({k: {h: v[h]["all"]["tau"] for h in v} for k, v in result["sets"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
