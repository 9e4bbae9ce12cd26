"""The attention kernels' launch at a serving batch's shapes: programs per row, alone, on a GPU.

`attention_triton`'s rows kernel runs ``P`` programs per (row, KV head), each taking every ``P``-th chunk of the
row's keys (`default_programs_per_row` picks ``P``); the exact prefill kernel runs ``P`` programs per (block of 16
rows, query head). ``P`` moves work between programs and changes no bit. This times both at the shapes the
continuous-batching scheduler gives them:

* **rows**: ``--requests`` requests (SmolLM2's 9 / 3 heads of 64, bfloat16, pages of 16, 64 pages a request) whose
  key counts are the shipped prompts' lengths (chat-templated, 44 to 767 tokens, cycled) plus 0-127 generated
  tokens (a fixed seed); ``n`` rows a request (``--rows-per-request``): 1 is a decode (prefix ``L + 1``), more a
  chain verify (row ``d``: prefix ``L`` and the request's first ``d + 1`` speculative slots as extra slots, the
  keys of the decode row at ``L + d``);
* **exact**: the prefill of the 13 shipped prompts (every row of each: prefix ``1 .. len``).

Per case: µs per call at the default launch and at each fixed ``--programs`` (20 calls captured in one CUDA
graph, replayed: the median of rounds), each output checked bitwise against the default launch's.

    python -m bench.attention_launch
"""

from __future__ import annotations

import argparse
import random

import torch

from .common import write_result
from .row_linear_bench import graph_us

HEADS, KV_HEADS, HEAD_DIM, PAGE, PAGES = 9, 3, 64, 16, 64


def prompt_lengths() -> list[int]:
    """The shipped prompts' token counts, chat-templated (as the scheduler benchmarks submit them)."""
    from speccycle.engine.bench import load_prompts
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path

    tokenizer = Tokenizer.from_gguf(default_model_path())
    return [len(tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}])) for p in load_prompts(None)]


def cache(requests: int, gen: torch.Generator):
    """A page table of `PAGES` shuffled pages per request and random bfloat16 K / V caches over them."""
    table = torch.randperm(requests * PAGES, generator=gen).view(requests, PAGES).cuda()
    shape = (requests * PAGES * PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen, dtype=torch.float32).to("cuda", torch.bfloat16)
    v = torch.randn(shape, generator=gen, dtype=torch.float32).to("cuda", torch.bfloat16)
    return table, k, v


def rows_case(lengths: list[int], requests: int, n: int, seed: int):
    """The rows kernel's arguments for ``requests`` requests of ``n`` rows each (module docstring)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    table, k, v = cache(requests, gen)
    keys = torch.tensor(
        [min(lengths[i % len(lengths)] + rng.randint(0, 127), PAGES * PAGE - n) for i in range(requests)], device="cuda"
    )
    row_request = torch.arange(requests, device="cuda").repeat_interleave(n)
    if n == 1:
        prefix, extra = keys + 1, torch.empty(requests, 0, dtype=torch.long, device="cuda")
    else:
        prefix = keys.repeat_interleave(n)
        positions = keys[:, None] + torch.arange(n, device="cuda")[None, :]
        slots = (table.gather(1, positions // PAGE) * PAGE + positions % PAGE).repeat_interleave(n, 0)
        depth = torch.arange(n, device="cuda").repeat(requests)
        extra = torch.where(torch.arange(n, device="cuda")[None, :] <= depth[:, None], slots, -1)
    q = torch.randn(requests * n, HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    return q, k, v, row_request, prefix, extra, table, PAGE


def exact_case(lengths: list[int], seed: int):
    """The exact prefill kernel's arguments for every row of the prompts (no cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    table, k, v = cache(len(lengths), gen)
    row_request = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).cuda()
    prefix = torch.cat([torch.arange(1, n + 1) for n in lengths]).cuda()
    q = torch.randn(len(row_request), HEADS, HEAD_DIM, generator=gen).to("cuda", torch.bfloat16)
    extra = torch.empty(len(row_request), 0, dtype=torch.long, device="cuda")
    return q, k, v, row_request, prefix, extra, table, PAGE


def sweep(fn, args, keyword: str, programs: list[int]) -> dict:
    """µs per call at the default launch and at each fixed count; whether every output equals the default's."""
    reference = fn(*args)
    figures, same = {"default": round(graph_us(fn, *args), 2)}, True
    for p in programs:
        same &= bool(torch.equal(fn(*args, **{keyword: p}), reference))
        figures[str(p)] = round(graph_us(fn, *args, **{keyword: p}), 2)
    return {"us": figures, "same_bits_as_default": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default="16,64,256")
    parser.add_argument("--rows-per-request", default="1,3,4,5")
    parser.add_argument("--programs", default="4,6,8,12,16", help="fixed programs per row (and per block) to time")
    parser.add_argument(
        "--lengths",
        default=None,
        help="comma-separated prompt lengths (default: the shipped prompts', which needs the model)",
    )
    parser.add_argument("--no-exact", action="store_true", help="skip the exact prefill kernel")
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_launch times Triton kernels on a GPU: run it on a machine with CUDA")
    from speccycle.engine.kernels.attention_prefill import paged_attention_prefill_exact
    from speccycle.engine.kernels.attention_triton import paged_attention_rows_triton

    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else prompt_lengths()
    programs = [int(p) for p in args.programs.split(",")]
    cases = []
    for requests in (int(r) for r in args.requests.split(",")):
        for n in (int(r) for r in args.rows_per_request.split(",")):
            found = sweep(paged_attention_rows_triton, rows_case(lengths, requests, n, requests), "programs_per_row",
                          programs)  # fmt: skip
            cases.append({"kernel": "rows", "requests": requests, "rows_per_request": n, **found})
            print("rows", requests, n, found, flush=True)
    if not args.no_exact:
        found = sweep(paged_attention_prefill_exact, exact_case(lengths, 0), "programs_per_block", programs)
        cases.append({"kernel": "exact", "requests": len(lengths), "rows": sum(lengths), **found})
        print("exact", len(lengths), found, flush=True)
    payload = {
        "config": {
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "page_size": PAGE,
            "pages_per_request": PAGES,
            "prompt_lengths": lengths,
            "programs": programs,
        },
        "cases": cases,
    }
    print("wrote", write_result("attention_launch", payload, "cuda", args.out))
    if not all(c["same_bits_as_default"] for c in cases):
        raise SystemExit("a launch changed an output's bits")


if __name__ == "__main__":
    main()
