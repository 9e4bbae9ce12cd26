"""The worked example of the transition pages, computed at build time by the reference backend.

One cycle of two requests with ``S = 2``, ``K = 2``, ``N = 5``, ``P = 4``. The models' outputs are
given by hand (a few draft probabilities, the target's next tokens); every number derived from them
(tree rows, positions, slots, the mask, ``accept_index``, the bonus, the KV moves) comes from the
`TorchBackend` ops that the transition table names, so the pages cannot drift from the code.
`docs/hooks.py` replaces ``<!-- speccycle:example:NAME -->`` markers with `render(NAME)`.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from speccycle.backends.torch import TorchBackend
from speccycle.core import SpecConfig
from speccycle.core.tree import draft_position, draft_scratch_positions

WORDS = ("<pad> the cat sat on mat . and It The purred slept was it a nice good great day idea deal").split()
TOKEN = {w: i for i, w in enumerate(WORDS)}
CONFIG = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5, page_size=4)
PROMPTS = (("the", "cat", "sat", "on", "the"), ("it", "was"))
MAX_NEW_TOKENS = (64, 2)
PAGE_TABLE = ((2, 5, 0), (4, 1))  # pages each request holds during the cycle (the pool's choice)

# The models, by hand. The target's first token after each prompt (the root):
FIRST = ("mat", "a")
# The draft extend's distribution at each request's last row (depth 1), and the draft forward's
# distribution at each depth-1 node (depth 2); the rest of the mass is spread over the vocabulary.
DEPTH1 = ({".": 0.6, "and": 0.3}, {"good": 0.5, "great": 0.4})
DEPTH2 = (
    {".": {"It": 0.45, "The": 0.3}, "and": {"purred": 0.8, "slept": 0.1}},
    {"good": {"day": 0.5, "idea": 0.4}, "great": {"day": 0.7, "deal": 0.2}},
)
# The target's greedy next token after each verify row's context, by the row's token path.
TARGET = (
    {
        ("mat",): "and",
        ("mat", "."): "The",
        ("mat", "and"): "purred",
        ("mat", ".", "It"): "was",
        ("mat", "and", "purred"): ".",
        ("mat", ".", "The"): "cat",
        ("mat", "and", "slept"): ".",
    },
    {
        ("a",): "nice",
        ("a", "good"): "day",
        ("a", "great"): "deal",
        ("a", "good", "day"): ".",
        ("a", "great", "day"): ".",
        ("a", "good", "idea"): ".",
        ("a", "great", "deal"): ".",
    },
)


def _logits(dist: dict[str, float]) -> torch.Tensor:
    """Log-probabilities over the vocabulary: ``dist`` plus the remaining mass spread evenly."""
    probs = torch.full((len(WORDS),), (1.0 - sum(dist.values())) / (len(WORDS) - len(dist)))
    for word, p in dist.items():
        probs[TOKEN[word]] = p
    return probs.log()


def words(ids) -> list[str]:
    return [WORDS[int(i)] for i in ids]


@lru_cache(maxsize=1)
def compute() -> dict:
    """Run the example through the backend ops; returns every intermediate, as tensors."""
    be, cfg = TorchBackend(), CONFIG
    S, K, N, P = cfg.num_steps, cfg.topk, cfg.num_draft_tokens, cfg.page_size
    bs = len(PROMPTS)
    width = max(len(p) for p in PAGE_TABLE)
    page_table = torch.tensor([list(p) + [-1] * (width - len(p)) for p in PAGE_TABLE])
    L = torch.tensor([len(p) for p in PROMPTS])  # after prefill: the prompt is committed
    roots = torch.tensor([TOKEN[w] for w in FIRST])

    # prefill: every prompt position at its slot; draft-extend rows shifted by one (EAGLE).
    prefill_slots = [
        be.slots_for_positions(page_table[b : b + 1], torch.arange(len(p))[None], P)[0] for b, p in enumerate(PROMPTS)
    ]
    extend_ids = [list(p[1:]) + [FIRST[b]] for b, p in enumerate(PROMPTS)]

    # draft extend: the last row per request gives depth 1.
    topk_p, topk_index = be.select_topk(torch.stack([_logits(d) for d in DEPTH1]), K)

    # draft: S - 1 forwards; forward j feeds depth j + 1 at L + j.
    scratch = draft_scratch_positions(L, S, K, offset=0)  # [bs, S-1, K]
    draft_slots = be.slots_for_positions(page_table, scratch, P)
    forward_positions = [draft_position(L, j + 1, offset=0) for j in range(S - 1)]
    child_logits = torch.stack(
        [torch.stack([_logits(DEPTH2[b][WORDS[int(t)]]) for t in topk_index[b]]) for b in range(bs)]
    )  # [bs, K, V]
    child_p, child_ids = be.select_topk(child_logits.reshape(bs * K, -1), K)
    child_p, child_ids = child_p.view(bs, K, K), child_ids.view(bs, K, K)
    cum, keep, _, _ = be.expand_frontier(topk_p, child_p, child_ids, K)
    cand_tokens = torch.cat([topk_index, child_ids.reshape(bs, K * K)], 1)
    cand_scores = torch.cat([topk_p, cum], 1)
    cand_parents = torch.cat([torch.full((bs, K), -1), torch.arange(K).repeat_interleave(K).expand(bs, -1)], 1)
    tokens, parents, scores = be.rerank_tree(roots, cand_tokens, cand_scores, cand_parents, N)
    from speccycle.core.tree import tree_depths

    depths = tree_depths(parents)
    verify_positions = L[:, None] + depths
    verify_slots = be.slots_for_positions(page_table, L[:, None] + torch.arange(N), P)

    # verify: one target forward with the tree mask; the greedy walk.
    mask = be.tree_mask(parents)  # [bs, N, N]
    paths = [[_path(tokens[b], parents[b], i) for i in range(N)] for b in range(bs)]
    predict_logits = torch.stack(
        [torch.stack([_logits({TARGET[b][tuple(paths[b][i])]: 0.9}) for i in range(N)]) for b in range(bs)]
    )
    predict = be.greedy_predict(predict_logits.reshape(bs * N, -1))  # [bs * N]
    accept_index, accept_len = be.verify_greedy(tokens, parents, predict.view(bs, N), cfg.accept_width)

    # accept: gather the path, cut at max_new_tokens, bonus at stride S + 1.
    accepted = be.gather_accepted(predict, accept_index)  # [bs, S + 1]
    cut = []
    for b in range(bs):
        room = MAX_NEW_TOKENS[b] - 1  # the root is already in the output
        cut.append(min(int(accept_len[b]), room))
    accept_len_cut = torch.tensor(cut)
    bonus = be.fill_bonus(accepted, accept_len_cut, cfg.accept_width)

    # compact: KV moves, recurrent-state index, the new L.
    src, dst = be.plan_kv_move(accept_index, accept_len_cut, verify_slots)
    last_correct = be.last_correct_step_indices(accept_index, accept_len_cut, N)
    return {
        "bs": bs,
        "page_table": page_table,
        "L": L,
        "roots": roots,
        "prefill_slots": prefill_slots,
        "extend_ids": extend_ids,
        "topk_p": topk_p,
        "topk_index": topk_index,
        "scratch": scratch,
        "draft_slots": draft_slots,
        "forward_positions": forward_positions,
        "cum": cum,
        "keep": keep,
        "cand_tokens": cand_tokens,
        "cand_scores": cand_scores,
        "cand_parents": cand_parents,
        "tokens": tokens,
        "parents": parents,
        "scores": scores,
        "depths": depths,
        "verify_positions": verify_positions,
        "verify_slots": verify_slots,
        "mask": mask,
        "predict": predict,
        "accept_index": accept_index,
        "accept_len": accept_len,
        "accept_len_cut": accept_len_cut,
        "accepted": accepted,
        "bonus": bonus,
        "src": src,
        "dst": dst,
        "last_correct": last_correct,
    }


def _path(tokens: torch.Tensor, parents: torch.Tensor, row: int) -> list[str]:
    """Tokens from the root to ``row``."""
    out = []
    while row >= 0:
        out.append(WORDS[int(tokens[row])])
        row = int(parents[row])
    return out[::-1]


# ---- rendering ----------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[object]], css: str = "speccycle-example") -> str:
    """A Markdown table inside a div that docs/stylesheets/extra.css makes compact."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return f'<div class="{css}" markdown>\n\n' + "\n".join(lines) + "\n\n</div>\n"


def _code(values) -> str:
    return f"`{values}`"


def _tokens(ids_or_words) -> str:
    """Tokens as a row of code spans: `and` `purred` `.`"""
    return " ".join(f"`{w if isinstance(w, str) else WORDS[int(w)]}`" for w in ids_or_words)


def setup() -> str:
    e, cfg = compute(), CONFIG
    rows = []
    for b, prompt in enumerate(PROMPTS):
        rows.append(
            [
                b,
                " ".join(prompt),
                len(prompt),
                MAX_NEW_TOKENS[b],
                _code(list(PAGE_TABLE[b])),
            ]
        )
    return (
        f"Config: `S = {cfg.num_steps}`, `K = {cfg.topk}`, `N = {cfg.num_draft_tokens}`, "
        f"`P = {cfg.page_size}` (accept width `S + 1 = {cfg.accept_width}`; a tree may hold at most "
        f"`1 + K + (S - 1) K^2 = {1 + cfg.topk + (cfg.num_steps - 1) * cfg.topk**2}` rows). "
        f"Two requests, `bs = {e['bs']}`; a request's position `p` lives at slot "
        "`page_table[p // P] * P + p % P`.\n\n"
        + _table(["request", "prompt", "prompt tokens", "max_new_tokens", "page table"], rows)
    )


def prefill() -> str:
    e = compute()
    rows = []
    for b, prompt in enumerate(PROMPTS):
        rows.append(
            [
                b,
                _code(list(range(len(prompt)))),
                _code(e["prefill_slots"][b].tolist()),
                _code(list(range(1, len(prompt) + 1))),
                f"`{FIRST[b]}`",
                _tokens(e["extend_ids"][b]),
                int(e["L"][b]),
            ]
        )
    return _table(
        ["request", "positions", "out_slots", "prefix_lens", "first token (root)", "extend rows: input_ids", "L"],
        rows,
    )


def extend() -> str:
    e = compute()
    rows = []
    for b in range(e["bs"]):
        rows.append(
            [
                b,
                len(PROMPTS[b]) - 1,
                ", ".join(f"`{w}` {p:.2f}" for w, p in zip(words(e["topk_index"][b]), e["topk_p"][b].tolist())),
            ]
        )
    return _table(["request", "position of its last extend row", "depth-1 candidates (topk_index, topk_p)"], rows)


def draft() -> str:
    e, cfg = compute(), CONFIG
    K = cfg.topk
    rows = []
    for b in range(e["bs"]):
        rows.append(
            [
                b,
                int(e["L"][b]),
                _code([int(p[b]) for p in e["forward_positions"]]),
                _tokens(e["topk_index"][b]),
                _code(e["scratch"][b].reshape(-1).tolist()),
                _code(e["draft_slots"][b].reshape(-1).tolist()),
            ]
        )
    fwd = _table(
        ["request", "L", "draft forward j = 0 runs at", "it feeds (depth 1)", "scratch positions", "draft_slots"], rows
    )
    cands = []
    for b in range(e["bs"]):
        for c in range(e["cand_tokens"].shape[1]):
            parent = int(e["cand_parents"][b, c])
            level = 1 if c < K else 2
            cands.append(
                [
                    b,
                    c,
                    level,
                    f"`{WORDS[int(e['cand_tokens'][b, c])]}`",
                    "root" if parent < 0 else f"candidate {parent}",
                    f"{float(e['cand_scores'][b, c]):.3f}",
                ]
            )
    rerank = _table(["request", "candidate", "depth", "token", "parent", "cumulative score"], cands)
    return fwd + "\n**Candidates** (`K + (S - 1) K^2` per request) and their cumulative scores:\n\n" + rerank


def tree_rows() -> str:
    e, cfg = compute(), CONFIG
    rows = []
    for b in range(e["bs"]):
        for i in range(cfg.num_draft_tokens):
            rows.append(
                [
                    b,
                    i,
                    f"`{WORDS[int(e['tokens'][b, i])]}`",
                    int(e["parents"][b, i]),
                    int(e["depths"][b, i]),
                    f"{float(e['scores'][b, i]):.3f}",
                    int(e["verify_positions"][b, i]),
                    int(e["verify_slots"][b, i]),
                    b * cfg.num_draft_tokens + i,
                ]
            )
    return _table(
        ["request", "row", "token", "parent", "depth", "score", "position L + depth", "slot (of L + row)", "flat row"],
        rows,
    )


def tree_diagram(request: int = 0, accepted: bool = False) -> str:
    """A Mermaid flowchart of one request's tree; ``accepted`` highlights the accepted path."""
    e, n = compute(), CONFIG.num_draft_tokens
    path = set()
    if accepted:
        m = int(e["accept_len_cut"][request])
        path = {int(v) - request * n for v in e["accept_index"][request, :m].tolist()}
    lines = ["graph LR"]
    for i in range(n):
        word = WORDS[int(e["tokens"][request, i])]
        pos = int(e["verify_positions"][request, i])
        label = f"row {i}: {word}<br/>position {pos}"
        lines.append(f'    r{i}["{label}"]')
    for i in range(1, n):
        lines.append(f"    r{int(e['parents'][request, i])} --> r{i}")
    if path:
        lines.append("    classDef accepted fill:#4caf50,fill-opacity:0.3,stroke:#2e7d32,stroke-width:3px")
        lines.append("    class " + ",".join(f"r{i}" for i in sorted(path)) + " accepted")
    return "```mermaid\n" + "\n".join(lines) + "\n```\n"


def mask() -> str:
    e, n = compute(), CONFIG.num_draft_tokens
    b = 0
    L = int(e["L"][b])
    header = ["row", "token", f"prefix `[0, {L})`"] + [str(j) for j in range(n)] + ["extra_slots"]
    rows = []
    for i in range(n):
        cells = ["■" if bool(e["mask"][b, i, j]) else "·" for j in range(n)]
        extra = [int(e["verify_slots"][b, j]) if bool(e["mask"][b, i, j]) else -1 for j in range(n)]
        rows.append([i, f"`{WORDS[int(e['tokens'][b, i])]}`", "■"] + cells + [_code(extra)])
    return _table(header, rows, css="speccycle-example speccycle-grid")  # the mask reads best as a grid


def verify() -> str:
    e, n = compute(), CONFIG.num_draft_tokens
    rows = []
    for b in range(e["bs"]):
        pred = words(e["predict"][b * n : (b + 1) * n])
        rows.append(
            [
                b,
                _tokens(pred),
                _code(e["accept_index"][b].tolist()),
                int(e["accept_len"][b]),
            ]
        )
    return _table(["request", "predict (per row)", "accept_index", "accept_len"], rows)


def accept() -> str:
    e, cfg = compute(), CONFIG
    width, n, bs = cfg.accept_width, cfg.num_draft_tokens, e["bs"]
    rows = []
    for b in range(bs):
        m = int(e["accept_len_cut"][b])
        rows.append(
            [
                b,
                int(e["accept_len"][b]),
                m,
                _tokens(e["accepted"][b]),
                f"{b} * {width} + {m} - 1 = {b * width + m - 1}",
                f"`{WORDS[int(e['bonus'][b])]}`",
                f"{b} * {n} + {m} - 1 = {b * n + m - 1}",
            ]
        )
    flat = words(e["accepted"].reshape(-1))
    return (
        _table(
            [
                "request",
                "accept_len (verify)",
                "accept_len (after the cut)",
                "accepted_rows.predict",
                "bonus index, stride S + 1",
                "bonus",
                "index at stride N (the bug)",
            ],
            rows,
        )
        + f"\nFlat, `accepted_rows.predict` holds `bs * (S + 1) = {bs * width}` entries: {_tokens(flat)}. "
        + _stride_bug(e, n, bs * width)
    )


def _stride_bug(e: dict, n: int, size: int) -> str:
    index = n + int(e["accept_len_cut"][1]) - 1
    what = (
        f"past the end of the `{size}` entries"
        if index >= size
        else f"entry `{WORDS[int(e['accepted'].reshape(-1)[index])]}`, padding, not request 1's token"
    )
    return f"Read at stride `N = {n}`, request 1's bonus index is `{index}`: {what}.\n"


def compact() -> str:
    e, cfg = compute(), CONFIG
    bs, width, n = e["bs"], cfg.accept_width, cfg.num_draft_tokens
    moves = {(int(s), int(d)) for s, d in zip(e["src"], e["dst"])}
    rows = []
    for b in range(bs):
        for d in range(int(e["accept_len_cut"][b])):
            row = int(e["accept_index"][b, d]) - b * n
            src, dst = int(e["verify_slots"][b, row]), int(e["verify_slots"][b, d])
            moved = "move" if (src, dst) in moves else "in place"
            rows.append([b, d, row, f"{src} (of `L + {row}`)", f"{dst} (of `L + {d}`)", moved])
    out = _table(["request", "depth d", "accepted row", "its KV was written at slot", "it belongs at slot", "so"], rows)
    src, dst = e["src"].tolist(), e["dst"].tolist()
    overlap = sorted(set(src) & set(dst))
    new_L = (e["L"] + e["accept_len_cut"]).tolist()
    out += (
        f"\n`plan_kv_move` returns `src = {src}`, `dst = {dst}`: {len(src)} moves, within the bound "
        f"`bs * (S + 1) = {bs * width}` (SGLang sized the move `bs * N = {bs * n}`)."
    )
    if overlap:
        out += (
            f" Slot{'s' if len(overlap) > 1 else ''} `{overlap}` {'are' if len(overlap) > 1 else 'is'} both read "
            "and written: `move_kv` gathers every source before it writes any destination; in the other "
            "order, or in parallel without that care, a move would read a slot another move had already overwritten."
        )
    out += (
        f" `last_correct_step_indices = {e['last_correct'].tolist()}`; `L` becomes `{new_L}`; the next roots "
        f"are the bonus tokens {_tokens(e['bonus'])}.\n"
    )
    return out


def render(name: str) -> str:
    """The Markdown for ``<!-- speccycle:example:NAME -->``."""
    renderers = {
        "setup": setup,
        "prefill": prefill,
        "extend": extend,
        "draft": draft,
        "tree": tree_rows,
        "tree-diagram": lambda: tree_diagram(0),
        "tree-accepted": lambda: tree_diagram(0, accepted=True),
        "mask": mask,
        "verify": verify,
        "accept": accept,
        "compact": compact,
    }
    if name not in renderers:
        raise KeyError(f"unknown worked-example section {name!r}; known: {sorted(renderers)}")
    return renderers[name]()
