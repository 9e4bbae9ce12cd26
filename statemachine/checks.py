"""Checked mode: the invariants of docs/invariants.md, validated at every boundary.

Each check raises `InvariantViolation` naming the invariant (its number on docs/invariants.md and a
short name) and what was wrong. The property tests run the machine with ``checked=True``.
"""

from __future__ import annotations

import math

import attrs
import torch

from ..core.ports import draft_kind, recurrent_pending_rows, recurrent_state_lens
from ..core.records import Accepted, Compacted, Drafted, Ready, RowOutputs, Verified
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


def check_record(record, ports) -> None:
    if isinstance(record, (Compacted, Ready)):
        _check_committed(record, ports)
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


def _check_committed(record, ports) -> None:
    pool, cfg = ports.kv_pool, record.config
    offset = _offset(record, ports)
    seq_lens, root_tokens = record.seq_lens.tolist(), record.root_tokens.tolist()
    reserve = cfg.reserve_len("aligned" if offset else "shifted")
    for i, request in enumerate(record.requests):
        held = pool.pages_held(request.request_id)
        if request.finish_reason is not None:
            continue
        L = seq_lens[i]
        require(
            L == len(request.prompt) + len(request.output) - 1,
            8,
            f"request {request.request_id}: L={L} but prompt + output - root = "
            f"{len(request.prompt) + len(request.output) - 1}",
        )
        require(
            root_tokens[i] == request.output[-1],
            10,
            f"request {request.request_id}: root token is not the last committed token",
        )
        least = math.ceil((L + offset) / pool.page_size)
        most = math.ceil((L + reserve) / pool.page_size)
        require(
            least <= held <= max(least, most),
            8,
            f"request {request.request_id}: holds {held} pages, expected between {least} and {most}",
        )
    for request in getattr(record, "retired", ()):
        require(pool.pages_held(request.request_id) == 0, 8, f"retired request {request.request_id} still holds pages")
    if isinstance(record, Compacted):
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
    require(torch.equal(tree.depths, tree_depths(tree.parents)), 4, "depths disagree with parents")
    require(int(tree.depths.max()) <= cfg.num_steps, 4, f"a node deeper than S={cfg.num_steps}")
    if cfg.is_chain:
        require(torch.equal(tree.parents, (idx - 1).expand(bs, n)), 4, "K == 1 must draft a chain")
    mask = ancestor_mask(tree.parents)
    require(torch.equal(unpack_mask(pack_mask(mask), n), mask), 4, "the packed tree mask differs from the full mask")
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
    kinds = [record.verify_slots.reshape(bs, -1).tolist()]
    if isinstance(record, Drafted):
        kinds.append(record.draft_slots.reshape(bs, -1).tolist())
    seq_lens = record.seq_lens.tolist()
    reserve = cfg.reserve_len("aligned" if _offset(record, ports) else "shifted")
    for i, request in enumerate(record.requests):
        pages = {p for p in page_table[i] if p >= 0}
        for kind, slots in zip(("verify", "draft"), kinds):
            values = slots[i]
            require(len(set(values)) == len(values), 3, f"request {request.request_id}: {kind} slots repeat: {values}")
            outside = [v for v in values if v // page_size not in pages]
            require(not outside, 3, f"request {request.request_id}: {kind} slots {outside} outside its pages")
        want = math.ceil((seq_lens[i] + reserve) / page_size)
        held = pool.pages_held(request.request_id)
        require(held == want, 8, f"request {request.request_id}: holds {held} pages during the cycle, expected {want}")


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
