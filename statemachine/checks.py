"""Checked mode: the invariants of docs/invariants.md, validated at every boundary.

Each check raises `InvariantViolation` naming the invariant (its number on docs/invariants.md and a
short name) and what was wrong. The property tests run the machine with ``checked=True``.
"""

from __future__ import annotations

import math

import attrs
import torch

from ..core.ports import (
    defers_first_level,
    draft_kind,
    kv_shared_pages,
    recurrent_pending_rows,
    recurrent_state_lens,
)
from ..core.records import Accepted, Admitted, Compacted, Drafted, Ready, RowOutputs, Verified
from ..core.tree import ancestor_mask, pack_mask, tree_depths, unpack_mask

INVARIANTS = {
    1: "config",
    2: "draft positions",
    3: "draft slots",
    4: "tree",
    5: "accept",
    6: "bonus stride",
    7: "KV moves",
    8: "KV conservation",
    9: "compaction covers every per-row field",
    10: "lossless, greedy",
    11: "lossless, sampling",
    12: "recurrent state",
    13: "block drafts",
    14: "fast kernel equals reference",
    15: "shared pages are read-only",
    16: "grammar",
    17: "deferred first level",
}


class InvariantViolation(AssertionError):
    def __init__(self, number: int, message: str):
        self.number = number
        super().__init__(f"invariant {number} ({INVARIANTS[number]}): {message}")


def require(ok: bool, number: int, message: str) -> None:
    if not ok:
        raise InvariantViolation(number, message)


def row_count(record) -> int:
    if isinstance(record, (Drafted, Verified, Accepted)):
        return int(record.tree.tokens.numel())
    if isinstance(record, Compacted):
        return int(record.extend.input_ids.shape[0])
    return 0


def _offset(record, ports) -> int:
    from .transitions import draft_offset

    return draft_offset(ports, record.config)


def check_transition(source, result, ports) -> None:
    """Validate ``result`` alone, then what it must keep of ``source``."""
    check_record(result, ports)
    if isinstance(result, Compacted) and isinstance(source, Accepted):
        _check_compaction(source, result)
    if isinstance(source, Admitted) and isinstance(result, Compacted):
        _check_prefill_writes(source, ports)
    if isinstance(source, Compacted) and isinstance(result, Ready) and source.extend.out_slots is None:
        _check_extend_writes(source, ports)
    if isinstance(source, Ready) and isinstance(result, Drafted) and result.log is not None:
        if draft_kind(ports) == "lookup" and result.config.drafts:
            _check_lookup_proposals(source, result, ports)
    if isinstance(source, (Compacted, Ready)) and isinstance(result, Ready):
        _check_first_level_step(source, result, ports)


def _check_lookup_proposals(source: Ready, result: Drafted, ports) -> None:
    """Invariant 4 for a static lookup draft row: its tree is the root, then what the draft proposes from the
    host's token histories (asked again here, as `transitions.lookup_tree` asks), then padding rows only (the
    host step `static_rows.lookup_proposals` wrote them before the cycle)."""
    cfg, tree, bs = result.config, result.tree, len(source.requests)
    N = cfg.num_draft_tokens
    require(tree.tokens.shape[1] == N and tree.padding is not None, 4, "a static lookup tree has N rows and padding")
    tokens, parents, padding = tree.tokens.cpu(), tree.parents.cpu(), tree.padding.cpu()
    require(torch.equal(tokens[:, 0], source.root_tokens.cpu()), 4, "row 0 of the lookup tree is not the root")
    require(not bool(padding[:, 0].any()), 4, "the root of a lookup tree is padding")
    require(bool(padding[bs:, 1:].all()), 4, "a padding request's rows past the root must be padding")
    if not bs:
        return
    want_tokens, want_parents = ports.draft.propose(
        tuple(r.request_id for r in source.requests), [r.tokens for r in source.requests], cfg.num_steps, N - 1,
        cfg.topk,
    )  # fmt: skip
    n = want_tokens.shape[1]
    for b, request in enumerate(source.requests):
        who = f"request {request.request_id}"
        got = (tokens[b, 1 : n + 1].tolist(), parents[b, 1 : n + 1].tolist())
        want = (want_tokens[b].tolist(), want_parents[b].tolist())
        require(got == want, 4, f"{who}: the tree's rows are {got}, the lookup draft proposes {want}")
        require(not bool(padding[b, : n + 1].any()), 4, f"{who}: a proposed row is flagged padding")
        require(bool(padding[b, n + 1 :].all()), 4, f"{who}: a row past the {n} proposals is not padding")


def check_record(record, ports) -> None:
    if isinstance(record, (Compacted, Ready)):
        _check_committed(record, ports)
        _check_grammar(record, ports)
    if isinstance(record, Ready):
        _check_first_level(record, ports)
    if isinstance(record, Drafted):
        _check_drafted(record, ports)
    if isinstance(record, Verified):
        _check_accept(record.config, record.tree, record.accept_index, record.accept_len)
        _check_greedy_path(record)
        if draft_kind(ports) == "block":
            _check_block(record, ports.draft.block_size)
    if isinstance(record, Accepted):
        _check_accepted(record)
    if isinstance(record, (Drafted, Verified, Accepted)):
        _check_reserved(record, ports)
    if isinstance(record, Drafted):
        bs = len(record.requests)
        _check_writes(ports, record, "verify", record.verify_slots[:bs].reshape(bs, -1))
        _check_writes(ports, record, "draft scratch", record.draft_slots[:bs].reshape(bs, -1))


def _check_first_level(record: Ready, ports) -> None:
    """Invariant 17: a forward draft's `Ready` record either holds its depth-1 top-K or declares it pending (a cycle
    of ``S == 0`` deferred it): then no top-K, ``q`` or candidates are held, the draft's hidden state is, and the
    draft can compute the top-K from it later."""
    if draft_kind(ports) != "forward" or not any(r.sampling.speculate for r in record.requests):
        return
    K = record.config.topk
    if record.topk_pending:
        require(
            defers_first_level(ports),
            17,
            "the top-K is pending but the draft declares no extend_hidden and logits_from_hidden to compute it later",
        )
        require(
            record.topk_p is None and record.topk_index is None and record.draft_probs is None,
            17,
            "a pending top-K holds no topk_p, topk_index or draft_probs: they would be stale",
        )
        require(record.draft_hidden is not None, 17, "a pending top-K needs the draft hidden state it is computed from")
        return
    if record.config.drafts:
        require(
            record.topk_p is not None and record.topk_index is not None,
            17,
            "a shape that drafts has no depth-1 top-K: a batch extended in a cycle of S == 0 takes the first_level "
            "row before it drafts",
        )
        require(
            record.topk_p.shape[-1] == K and record.topk_index.shape[-1] == K,
            17,
            f"the depth-1 top-K is {tuple(record.topk_index.shape)} wide, the shape's K is {K}",
        )


def _check_first_level_step(source, result: Ready, ports) -> None:
    """Invariant 17 across a row: a draft extend defers the top-K exactly in a cycle of ``S == 0`` over a draft that
    can (`core.ports.defers_first_level`); the ``first_level`` row computes it and changes nothing else."""
    if draft_kind(ports) != "forward" or not any(r.sampling.speculate for r in result.requests):
        return
    if isinstance(source, Compacted):
        deferring = not source.config.drafts and defers_first_level(ports)
        require(
            result.topk_pending == deferring,
            17,
            f"the draft extend of a cycle of S={source.config.num_steps} "
            + ("deferred its top-K" if result.topk_pending else "computed the top-K a cycle of S == 0 defers"),
        )
    elif source.topk_pending and not result.topk_pending:  # the first_level row
        require(
            result.draft_hidden is source.draft_hidden
            and result.seq_lens is source.seq_lens
            and result.root_tokens is source.root_tokens,
            17,
            "the first_level row changed the record beyond its top-K",
        )
        bs = len(result.requests)
        require(
            tuple(result.topk_index.shape) == (bs, result.config.topk),
            17,
            f"the first_level row's top-K is {tuple(result.topk_index.shape)}, expected {(bs, result.config.topk)}",
        )


def _check_writes(ports, record, what: str, slots: torch.Tensor) -> None:
    """Invariant 15: no slot a request writes (``slots [bs, X]``, -1 for none) lies in a shared, read-only page."""
    shared = kv_shared_pages(ports)
    if not shared or slots.numel() == 0:
        return
    pages = (slots // ports.kv_pool.page_size).tolist()
    for request, row, written in zip(record.requests, pages, slots.tolist()):
        hit = sorted({p for p, s in zip(row, written) if s >= 0 and p in shared})
        require(
            not hit,
            15,
            f"request {request.request_id}: its {what} rows write pages {hit}, which the prefix cache shares",
        )


def _position_slots(ports, requests, positions: list[list[int]]) -> torch.Tensor:
    """Slots of each request's ``positions`` through its page table, ``[bs, X]`` -1 padded."""
    pool, P = ports.kv_pool, ports.kv_pool.page_size
    table = pool.page_table(tuple(r.request_id for r in requests)).tolist()
    width = max([len(p) for p in positions] + [0])
    out = [[table[b][p // P] * P + p % P for p in ps] + [-1] * (width - len(ps)) for b, ps in enumerate(positions)]
    return torch.tensor(out, dtype=torch.long).reshape(len(requests), width)


def _check_prefill_writes(source: Admitted, ports) -> None:
    """Invariant 15 at prefill: the rows past each request's cached length write only pages it owns alone."""
    if not kv_shared_pages(ports):
        return
    cached = source.cached or (0,) * len(source.requests)
    P = ports.kv_pool.page_size  # a request refused at prefill reserved nothing past its cached pages
    live = [
        (r, c) for r, c in zip(source.requests, cached) if ports.kv_pool.pages_held(r.request_id) * P >= len(r.tokens)
    ]
    if not live:
        return
    requests = [r for r, _ in live]
    positions = [list(range(c, len(r.tokens))) for r, c in live]
    _check_writes(ports, attrs.evolve(source, requests=tuple(requests), cached=()), "prefill",
                  _position_slots(ports, requests, positions))  # fmt: skip


def _check_extend_writes(source: Compacted, ports) -> None:
    """Invariant 15 at the draft extend: its rows write only pages their request owns alone."""
    if not kv_shared_pages(ports) or not source.requests:
        return
    positions: list[list[int]] = [[] for _ in source.requests]
    for b, p in zip(source.extend.row_request.tolist(), source.extend.positions.tolist()):
        positions[b].append(p)
    _check_writes(ports, source, "draft extend", _position_slots(ports, source.requests, positions))


def _check_grammar(record, ports) -> None:
    """Invariant 16: every constrained request's matcher stands exactly after its committed tokens, all of which
    its grammar accepts (`statemachine.grammar.check_matchers`)."""
    from .grammar import check_matchers

    if any(r.grammar is not None for r in record.requests):
        problems = check_matchers(record.requests, ports)
        require(not problems, 16, "; ".join(problems))


def _committed(record) -> list[tuple[tuple[int, ...], bool]]:
    """Each request's output and whether it finished: from its `Request`, with the record's `OutputLog` appended."""
    if record.log is None:
        return [(r.output, r.finish_reason is not None) for r in record.requests]
    lengths, done = record.log.lengths.tolist(), record.log.done.tolist()
    rows = record.log.tokens.tolist()
    return [
        (r.output + tuple(rows[b][: lengths[b]]), done[b] or r.finish_reason is not None)
        for b, r in enumerate(record.requests)
    ]


def _most_pages(record, i: int, request, L: int, reserve: int, page_size: int) -> int:
    """Pages request ``i`` may hold at a boundary: a cycle's reservation past ``L``; with an `OutputLog` (a static
    run may reserve its pages at its start), up to the reservation of the log's whole run."""
    log = getattr(record, "log", None)
    if log is None or not log.reserved_for_run:
        return math.ceil((L + reserve) / page_size)
    start = len(request.prompt) + len(request.output) - 1
    return math.ceil((start + int(record.log.max_new[i]) + reserve + 1) / page_size)


def _check_committed(record, ports) -> None:
    pool, cfg = ports.kv_pool, record.config
    offset = _offset(record, ports)
    seq_lens, root_tokens = record.seq_lens.tolist(), record.root_tokens.tolist()
    reserve = cfg.reserve_len("aligned" if offset else "shifted")
    for i, (request, (output, finished)) in enumerate(zip(record.requests, _committed(record))):
        held = pool.pages_held(request.request_id)
        if finished:
            continue
        L = seq_lens[i]
        require(
            L == len(request.prompt) + len(output) - 1,
            8,
            f"request {request.request_id}: L={L} but prompt + output - root = {len(request.prompt) + len(output) - 1}",
        )
        require(
            root_tokens[i] == output[-1],
            10,
            f"request {request.request_id}: root token is not the last committed token",
        )
        least = math.ceil((L + offset) / pool.page_size)
        most = _most_pages(record, i, request, L, reserve, pool.page_size)
        require(
            least <= held <= max(least, most),
            8,
            f"request {request.request_id}: holds {held} pages, expected between {least} and {most}",
        )
    for request in getattr(record, "retired", ()):
        require(pool.pages_held(request.request_id) == 0, 8, f"retired request {request.request_id} still holds pages")
    if isinstance(record, Compacted):
        if record.extend.logits_rows is None:  # a fusion's static rows are checked against its source (check_fusion)
            _check_extend_rows(record, offset)
        if record.last_correct_step_indices is not None:
            lcsi, n = record.last_correct_step_indices, cfg.num_draft_tokens
            require(
                bool(((lcsi >= 0) & (lcsi < n)).all()), 12, f"last_correct_step_indices {lcsi.tolist()} not in [0, {n})"
            )
            if cfg.is_chain and record.accept_len is not None:
                require(
                    torch.equal(lcsi, record.accept_len - 1),
                    12,
                    "a chain's last_correct_step_indices must equal accept_len - 1",
                )
        _check_recurrent(record, ports)


def _check_recurrent(record: Compacted, ports) -> None:
    """A recurrent pool that reports its state lengths holds exactly the committed tokens, no verify rows."""
    live = [(i, r.request_id) for i, r in enumerate(record.requests) if r.finish_reason is None]
    lens = recurrent_state_lens(ports, [rid for _, rid in live])
    if lens is None:
        return
    for (i, rid), held in zip(live, lens):
        L = int(record.seq_lens[i])
        require(held == L, 12, f"request {rid}: the recurrent state holds {held} tokens, L={L}")
        pending = recurrent_pending_rows(ports, rid)
        require(pending == 0, 12, f"request {rid}: {pending} verify rows were left uncommitted")


def _check_extend_rows(record: Compacted, offset: int) -> None:
    ext = record.extend
    per_request: dict[int, list[int]] = {}
    for i, position in zip(ext.row_request.tolist(), ext.positions.tolist()):
        per_request.setdefault(i, []).append(position)
    seq_lens = record.seq_lens.tolist()
    for i, request in enumerate(record.requests):
        positions = per_request.get(i)
        if not positions:
            continue
        end = seq_lens[i] + offset
        require(
            positions == list(range(end - len(positions), end)),
            2,
            f"request {request.request_id}: draft extend positions {positions} should end at {end - 1}",
        )


def _check_drafted(record: Drafted, ports) -> None:
    cfg, tree = record.config, record.tree
    bs, n = tree.tokens.shape
    lookup = draft_kind(ports) == "lookup"
    require(
        n == cfg.num_draft_tokens or (lookup and 1 <= n <= cfg.num_draft_tokens),
        4,
        f"tree has {n} rows, config N={cfg.num_draft_tokens}",
    )
    idx = torch.arange(n, device=tree.parents.device)
    require(bool((tree.parents[:, 0] == -1).all()), 4, "row 0 must be the root (parent -1)")
    require(bool((tree.parents[:, 1:] >= 0).all()), 4, "only row 0 may lack a parent")
    require(bool((tree.parents[:, 1:] < idx[1:]).all()), 4, "a parent must precede its child")
    depths = tree_depths(tree.parents)
    require(tree.depths is None or torch.equal(tree.depths, depths), 4, "depths disagree with parents")
    require(int(depths.max()) <= cfg.num_steps, 4, f"a node deeper than S={cfg.num_steps}")
    if cfg.is_chain:
        require(torch.equal(tree.parents, (idx - 1).expand(bs, n)), 4, "K == 1 must draft a chain")
    mask = ancestor_mask(tree.parents)
    require(torch.equal(unpack_mask(pack_mask(mask), n), mask), 4, "the packed tree mask differs from the full mask")
    if tree.widths is not None:  # per-request draft width (speculate=False: the root alone)
        widths = tree.widths
        require(tuple(widths.shape) == (bs,), 4, f"widths shape {tuple(widths.shape)} != ({bs},)")
        require(bool(((widths >= 1) & (widths <= n)).all()), 4, f"widths {widths.tolist()} outside [1, {n}]")
        past = idx[None, :] >= widths[:, None]
        require(
            tree.padding is not None and bool((tree.padding | ~past).all()),
            4,
            "every row past a request's width must be padding",
        )
        resting = [b for b, r in enumerate(record.requests) if not r.sampling.speculate]
        require(all(int(widths[b]) == 1 for b in resting), 4, "a request with speculate=False must have width 1")
        if cfg.draft_floor and tree.scores is not None:  # a chain cut where its draft's confidence runs out
            require(tuple(tree.scores.shape) == (bs, n), 4, f"scores shape {tuple(tree.scores.shape)} != ({bs}, {n})")
            cut = 1 + (tree.scores[:, 1:] >= cfg.draft_floor).long().sum(1)
            greedy = [b for b, r in enumerate(record.requests) if r.sampling.speculate and r.sampling.greedy]
            require(
                all(int(widths[b]) == int(cut[b]) for b in greedy),
                4,
                f"widths {widths.tolist()} are not the rows whose cumulative draft probability reaches the floor "
                f"{cfg.draft_floor} (expected {cut.tolist()} for the greedy requests)",
            )
    offset = _offset(record, ports)
    steps = record.draft_positions.shape[1]
    if steps:
        expected = record.seq_lens[:, None] + offset + torch.arange(steps, device=record.seq_lens.device)
        require(
            torch.equal(record.draft_positions, expected),
            2,
            f"draft forward j must run at L + j + {offset}: got {record.draft_positions.tolist()}, "
            f"expected {expected.tolist()}",
        )


def _check_reserved(record, ports) -> None:
    """Invariants 3 and 8: every slot distinct and inside its request's pages; pages as reserved."""
    pool, cfg = ports.kv_pool, record.config
    page_size = pool.page_size
    page_table = pool.page_table(tuple(r.request_id for r in record.requests)).tolist()
    bs = len(record.requests)
    kinds = [record.verify_slots[:bs].reshape(bs, -1).tolist()]  # rows past bs: a padded batch's padding
    if isinstance(record, Drafted):
        kinds.append(record.draft_slots[:bs].reshape(bs, -1).tolist())
    seq_lens = record.seq_lens.tolist()
    reserve = cfg.reserve_len("aligned" if _offset(record, ports) else "shifted")
    finished = [done for _, done in _committed(record)] if getattr(record, "log", None) is not None else None
    for i, request in enumerate(record.requests):
        if finished is not None and finished[i]:
            continue  # a static cycle gives a finished request slot -1 everywhere: it writes and reads no KV
        pages = {p for p in page_table[i] if p >= 0}
        for kind, slots in zip(("verify", "draft"), kinds):
            values = slots[i]
            require(len(set(values)) == len(values), 3, f"request {request.request_id}: {kind} slots repeat: {values}")
            outside = [v for v in values if v // page_size not in pages]
            require(not outside, 3, f"request {request.request_id}: {kind} slots {outside} outside its pages")
        want = math.ceil((seq_lens[i] + reserve) / page_size)
        most = _most_pages(record, i, request, seq_lens[i], reserve, page_size)
        held = pool.pages_held(request.request_id)
        require(
            want <= held <= max(want, most),
            8,
            f"request {request.request_id}: holds {held} pages during the cycle, expected "
            + (f"{want}" if most <= want else f"between {want} and {most}"),
        )


def _check_accept(cfg, tree, accept_index: torch.Tensor, accept_len: torch.Tensor) -> None:
    bs, n = tree.tokens.shape
    width = cfg.accept_width
    require(
        tuple(accept_index.shape) == (bs, width),
        5,
        f"accept_index shape {tuple(accept_index.shape)} != ({bs}, {width})",
    )
    require(
        bool(((accept_len >= 1) & (accept_len <= min(width, n))).all()),
        5,
        f"accept_len {accept_len.tolist()} outside [1, {min(width, n)}]",
    )
    if tree.widths is not None:
        require(
            bool((accept_len <= tree.widths).all()),
            5,
            f"accept_len {accept_len.tolist()} exceeds the draft widths {tree.widths.tolist()}",
        )
    lens, rows, all_parents = accept_len.tolist(), accept_index.tolist(), tree.parents.tolist()
    for b in range(bs):
        m = lens[b]
        row = rows[b]
        require(row[0] == b * n, 5, f"request {b}: accept_index[0]={row[0]} is not its root {b * n}")
        require(all(v == -1 for v in row[m:]), 5, f"request {b}: entries after accept_len must be -1: {row}")
        path = [v - b * n for v in row[:m]]
        require(all(0 <= v < n for v in path), 5, f"request {b}: accept_index leaves its block: {row}")
        require(all(x < y for x, y in zip(path, path[1:])), 5, f"request {b}: accept_index not increasing: {row}")
        parents = all_parents[b]
        require(
            all(parents[y] == x for x, y in zip(path, path[1:])),
            5,
            f"request {b}: accepted rows {path} are not a parent-to-child chain",
        )


def _check_block(record: Verified, block_size: int) -> None:
    """Invariant 13: a block's accepted run is its agreeing prefix, ``cumprod(cand[1:] == target[:-1]).sum()``."""
    bs, n = record.tree.tokens.shape
    require(n == block_size, 13, f"a block draft of B={block_size} verified {n} rows")
    target = record.rows.predict.view(bs, n)
    candidates = record.tree.tokens
    correct_len = torch.cumprod((candidates[:, 1:] == target[:, :-1]).long(), dim=1).sum(dim=1)
    require(
        bool(((correct_len >= 0) & (correct_len <= block_size - 1)).all()),
        13,
        f"correct_len {correct_len.tolist()} outside [0, B - 1 = {block_size - 1}]",
    )
    require(
        torch.equal(record.accept_len, correct_len + 1),
        13,
        f"accept_len {record.accept_len.tolist()} != correct_len + 1 = {(correct_len + 1).tolist()}",
    )
    depth = torch.arange(record.accept_index.shape[1], device=correct_len.device)[None, :]
    flat = torch.arange(bs, device=depth.device)[:, None] * n + depth
    expected = torch.where(depth <= correct_len[:, None], flat, -1)
    require(torch.equal(record.accept_index, expected), 13, "a block's accepted rows must be rows 0..correct_len")


def _check_greedy_path(record: Verified) -> None:
    bs, n = record.tree.tokens.shape
    predict = record.rows.predict.view(bs, n).tolist()
    tokens, rows, lens = record.tree.tokens.tolist(), record.accept_index.tolist(), record.accept_len.tolist()
    for b in range(bs):
        path = [v - b * n for v in rows[b][: lens[b]]]
        for parent, child in zip(path, path[1:]):
            require(
                tokens[b][child] == predict[b][parent],
                10,
                f"request {b}: accepted row {child} does not match the target's prediction at row {parent}",
            )


def _check_accepted(record: Accepted) -> None:
    cfg, bs = record.config, len(record.requests)
    width = cfg.accept_width
    require(record.accept_index.shape[1] == width, 6, f"accept width {record.accept_index.shape[1]} != S + 1 = {width}")
    predict = record.accepted_rows.predict
    require(tuple(predict.shape) == (bs, width), 6, f"accepted predict shape {tuple(predict.shape)} != ({bs}, {width})")
    expected = predict.reshape(-1)[torch.arange(bs, device=predict.device) * width + record.accept_len - 1]
    require(torch.equal(record.bonus, expected), 6, "the bonus is not accepted_rows.predict read at stride S + 1")
    for field in attrs.fields(RowOutputs):
        value = getattr(record.accepted_rows, field.name)
        if value is not None:
            require(tuple(value.shape[:2]) == (bs, width), 9, f"per-row field {field.name} was not compacted")


def _check_compaction(source: Accepted, result: Compacted) -> None:
    cfg, bs = source.config, len(source.requests)
    require(torch.equal(result.seq_lens, source.seq_lens + source.accept_len), 7, "L must grow by accept_len")
    if result.kv_moves is not None:
        src, dst = result.kv_moves
        require(
            src.numel() == dst.numel() <= bs * cfg.accept_width,
            7,
            f"{src.numel()} KV moves exceed bs * (S + 1) = {bs * cfg.accept_width}",
        )
        owner = {int(slot): b for b in range(bs) for slot in source.verify_slots[b]}
        for s, t in zip(src.tolist(), dst.tolist()):
            require(
                s in owner and owner[s] == owner.get(t),
                7,
                f"the move {s} -> {t} leaves one request's verify slots",
            )
        for b in range(bs):
            m = int(source.accept_len[b])
            path = [v - b * source.tree.tokens.shape[1] for v in source.accept_index[b].tolist()[:m]]
            for d, row in enumerate(path):
                if row != d:
                    s, t = int(source.verify_slots[b, row]), int(source.verify_slots[b, d])
                    hit = ((src == s) & (dst == t)).any()
                    require(bool(hit), 7, f"request {b}: accepted row {row} was not moved to L + {d}")
    for field in attrs.fields(RowOutputs):
        before = getattr(source.accepted_rows, field.name)
        require(before is None or before.shape[:2] == (bs, cfg.accept_width), 9, f"{field.name} not compacted")


def _check_sampled_walk(b: int, source: Drafted, walk: torch.Tensor, predict: torch.Tensor, path: list[int]) -> None:
    """A sampled request's walk in a fused verify (`static_rows._sampled_walk`): its predictions along the sampled
    verify's path are its committed tokens (the accepted children, then the final sample at the path's last row),
    its walk those with -2 (no token) at the last row and off the path; each accepted child is a real row its
    parent's ``q`` could have drawn (``q > 0``, invariant 11)."""
    tree = source.tree
    N = tree.tokens.shape[1]
    rows = [f - b * N for f in path]
    last = rows[-1]
    want = torch.full((N,), -2, dtype=torch.long)
    for d, row in enumerate(rows[:-1]):
        want[row] = int(tree.tokens[b, rows[d + 1]])
    who = f"request {b} (sampled)"
    require(int(predict[last]) >= 0, 11, f"{who}: no final token at its path's last row {last}")
    require(torch.equal(walk, want), 11, f"{who}: the walk {walk.tolist()} does not follow its path {rows}")
    on_path = torch.tensor(rows[:-1], dtype=torch.long)
    require(torch.equal(predict[on_path], want[on_path]), 11, f"{who}: predictions {predict.tolist()} do not commit "
            f"the accepted children of its path {rows}")  # fmt: skip
    padding = None if tree.padding is None else tree.padding[b].cpu()
    probs = source.draft_probs
    for d in range(1, len(rows)):
        row, parent = rows[d], rows[d - 1]
        require(padding is None or not bool(padding[row]), 11, f"{who}: accepted padding row {row}")
        if probs is not None:
            q = float(probs[b, parent, int(tree.tokens[b, row])])
            require(q > 0, 11, f"{who}: accepted row {row}, a token its parent's q gives probability {q}")


def check_fusion(
    source: Drafted, result: Compacted, rows: RowOutputs, walk: torch.Tensor, ports, forced: bool = False
) -> None:
    """A fusion of the verify, accept and compact rows (`table.FUSIONS`), on records with an `OutputLog`: the rows'
    work recomputed on the host from ``source`` (the walk of the reference backend, the cut at stops and the
    limit, the bonus, the KV moves, the extend rows) and ``result`` held equal to it, invariant by invariant.

    ``rows``: the verify's row outputs (``predict [B * N]``, ``hidden``); ``walk [B, N]``: the predictions the
    walk followed, the target's unless ``forced`` (a benchmark forcing acceptance). The log's budgets and stops
    are held to the requests'. Then ``result`` alone (`check_record`).
    """
    from ..backends.torch.ops import TorchBackend

    cfg, tree = source.config, source.tree
    B, N = tree.tokens.shape
    W = cfg.accept_width
    tokens, parents = tree.tokens.cpu(), tree.parents.cpu()
    if tree.padding is not None:  # placeholder rows (a lookup draft's): no prediction equals their token
        tokens = torch.where(tree.padding.cpu(), -1, tokens)
    predict, walk = rows.predict.cpu().view(B, N), walk.cpu().view(B, N)
    vslots, L = source.verify_slots.cpu(), source.seq_lens.tolist()
    before, after = source.log, result.log
    lengths, done = before.lengths.tolist(), before.done.tolist()
    max_new, stops = before.max_new.tolist(), {s for s in before.stops.tolist() if s >= 0}
    n = len(source.requests)  # rows past n: a padded batch's padding, finished from the start
    sampled = [not r.sampling.greedy for r in source.requests] + [False] * (B - n)
    greedy = torch.tensor([not s for s in sampled])
    require(forced or torch.equal(walk[greedy], predict[greedy]), 10, "an unforced walk must follow the target's "
            "predictions")  # fmt: skip
    for b, r in enumerate(source.requests):
        want = r.sampling.max_new_tokens - len(r.output)
        require(max_new[b] == want, 5, f"request {b}: the log's budget is {max_new[b]}, its requests' {want}")
        require(set(r.sampling.stop_token_ids) == stops, 5, f"request {b}: the log stops at {sorted(stops)}")
    for b in range(n, B):
        require(done[b] and max_new[b] == 0, 5, f"padding row {b} must be finished with no budget")
    # the reference walk (the verify row's op, on the host), then the fused op's results held equal to it
    accept_index, run = TorchBackend().verify_greedy(tokens, parents, walk, W)
    committed = predict.reshape(-1)[accept_index.clamp(min=0)].tolist()  # [B, W]
    flat = accept_index.tolist()
    for b in (b for b in range(B) if sampled[b] and not done[b]):
        _check_sampled_walk(b, source, walk[b], predict[b], flat[b][: int(run[b])])
    new_L, new_root = result.seq_lens.tolist(), result.root_tokens.tolist()
    new_lengths, new_done = after.lengths.tolist(), after.done.tolist()
    out = after.tokens.tolist()
    cycle = int(before.cycle)
    require(int(after.cycle) == cycle + 1, 5, f"the cycle counter went from {cycle} to {int(after.cycle)}")
    hist = after.accepted[cycle].tolist()
    ext = result.extend
    ext_ids, ext_pos, ext_slots = ext.input_ids.tolist(), ext.positions.tolist(), ext.out_slots.tolist()
    ext_prefix, last = ext.prefix_lens.tolist(), ext.logits_rows.tolist()
    moves = set()
    if result.kv_moves is not None:
        src, dst = (t.tolist() for t in result.kv_moves)
        moves = {(s, d) for s, d in zip(src, dst) if s >= 0 and d >= 0}
    want_moves = set()
    hidden_rows = []
    for b in range(B):
        for d in range(W):  # every extend row writes draft KV: its own verify slot, or none past the tree's rows
            want_slot = int(vslots[b, d]) if d < N else -1
            require(ext_slots[b * W + d] == want_slot, 3, f"request {b}: extend row {d} writes slot "
                    f"{ext_slots[b * W + d]}, expected {want_slot}")  # fmt: skip
        keep = 0
        if not done[b]:
            run_b = committed[b][: int(run[b])]
            hit = next((i + 1 for i, t in enumerate(run_b) if t in stops), len(run_b))
            keep = max(0, min(hit, max_new[b] - lengths[b]))
        kept = committed[b][:keep]
        finished = done[b] or any(t in stops for t in kept) or lengths[b] + keep >= max_new[b]
        who = f"request {b}"
        require(hist[b] == keep, 5, f"{who}: the log says the cycle committed {hist[b]} tokens, the rows {keep}")
        require(new_done[b] == finished, 5, f"{who}: done is {new_done[b]}, the rows say {finished}")
        if done[b]:
            continue
        require(new_L[b] == L[b] + keep, 7, f"{who}: L went from {L[b]} to {new_L[b]}, accept_len is {keep}")
        require(new_lengths[b] == lengths[b] + keep, 10, f"{who}: the output grew by {new_lengths[b] - lengths[b]}")
        got = out[b][lengths[b] : lengths[b] + keep]
        require(got == kept, 10, f"{who}: committed {got}, the accepted path's predictions are {kept}")
        require(new_root[b] == kept[-1], 6, f"{who}: the root is {new_root[b]}, the bonus (row {keep - 1}) {kept[-1]}")
        for d in range(keep):
            row = flat[b][d] - b * N
            if row != d:
                want_moves.add((int(vslots[b, row]), int(vslots[b, d])))
            i = b * W + d
            require(
                (ext_ids[i], ext_pos[i], ext_prefix[i]) == (kept[d], L[b] + d, L[b] + d + 1)
                and ext_slots[i] == vslots[b, d],
                2,
                f"{who}: extend row {d} is (token {ext_ids[i]}, position {ext_pos[i]}, slot {ext_slots[i]}), expected "
                f"(token {kept[d]}, position {L[b] + d}, slot {int(vslots[b, d])})",
            )
            hidden_rows.append((i, flat[b][d]))
        require(
            last[b] == b * W + keep - 1, 6, f"{who}: the extend's last row is {last[b]}, expected {b * W + keep - 1}"
        )
    if parents is not None and not cfg.is_chain:
        require(moves == want_moves, 7, f"KV moves {sorted(moves)}, the accepted paths need {sorted(want_moves)}")
    else:
        require(result.kv_moves is None, 7, "a chain's accepted rows sit at L + d already: it moves no KV")
    if rows.hidden is not None and hidden_rows:
        at, of = torch.tensor(hidden_rows).T
        require(
            torch.equal(ext.hidden[at].cpu(), rows.hidden[of].cpu()),
            9,
            "the extend's features are not the accepted rows' verify features",
        )
    check_record(result, ports)
