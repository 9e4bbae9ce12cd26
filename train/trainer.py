"""Train an EAGLE head by self-distillation: frozen target forward per batch, the head unrolled over draft steps.

Per batch: the target runs once over the padded sequences (features, greedy labels); the head runs
``ttt_steps`` steps (`TrainableEagleHead.unroll`). Step ``s`` at anchor ``k`` is trained to predict the
target's greedy token at position ``k + s + 2`` where that token is a response token and the tokens
the step was fed (depths ``1..s``) are the target's greedy ones: a draft deeper than a wrong token is
never accepted, so it need not be trained there. Losses, step ``s`` weighted ``step_decay ** s``:

* EAGLE-1: ``reg_weight * smooth_l1(out / r, f_last[k + s + 1] / r) + ce_weight * CE(target head(out))``
  (feature regression, relative to the RMS ``r`` of the target feature's row, plus token
  cross-entropy through the target's frozen LM head);
* EAGLE-3: ``CE`` over the reduced draft vocabulary (targets outside it are masked: they count in
  the mean and the accuracy, untrained);
* EAGLE-3 over the target's LM head (``draft_vocab_size == 0``): ``CE`` over the target's full
  vocabulary, through its frozen final norm and LM head.

Cross-entropy runs over row chunks in `losses.linear_cross_entropy`, which computes its gradient in
the forward (the logits GEMM once, float32 softmax per chunk, nothing ``[rows, V]`` kept): EAGLE-1
logits are ``rows x 49152`` per step.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from ..engine.drafters.eagle import EagleConfig, _shapes, extra_layer_prefix, file_metadata
from ..engine.models.llama import LlamaModel
from .data import SelfDistilledData
from .features import target_outputs
from .head import TrainableEagleHead, shift_left
from .losses import chunked_cross_entropy_reference, linear_cross_entropy


@attrs.frozen
class TrainConfig:
    version: int = 1
    ttt_steps: int = 6  # draft steps unrolled per batch (6 covers chains up to S = 6)
    draft_vocab_size: int = 3072  # EAGLE-3 only
    intermediate_size: int | None = None  # None: the target's; EAGLE-3 defaults to 512 (see pipeline)
    num_layers: int = 1  # the head's decoder layers (`EagleConfig.num_layers`)
    batch_tokens: int = 32768  # padded tokens per batch (B x T)
    max_seqs: int = 128
    max_len: int = 640
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    steps: int = 2000  # upper bound; a time budget may lower it (decided once, at step `measure_at`)
    time_budget_s: float | None = None
    measure_at: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    reg_weight: float = 1.0
    ce_weight: float = 0.1
    step_decay: float = 0.8
    seed: int = 0
    save_every_s: float = 60.0
    log_every_s: float = 15.0
    val_sequences: int = 256  # held out from training; teacher-forced accuracy on them at every save
    ce_chunk_rows: int = 8192
    # "fused": `losses.linear_cross_entropy`; "reference": the former checkpointed path (to time beside it)
    ce: str = attrs.field(default="fused", validator=attrs.validators.in_(("fused", "reference")))


def draft_vocabulary(
    data: SelfDistilledData, size: int, vocab_size: int, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``size`` most frequent response tokens (EAGLE-3's reduced vocabulary), sorted ids ``[size]``;
    the ids in ``keep`` first, whatever their counts (``size >= len(keep)``)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(data)):
        np.add.at(counts, data.sequence(i)[int(data.prompt_lens[i]) :].astype(np.int64), 1)
    if keep is not None:
        counts[keep.numpy()] = np.iinfo(np.int64).max
    size = min(size, vocab_size)
    order = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(order)).long()


def vocabulary_coverage(data: SelfDistilledData, draft_to_target: torch.Tensor) -> float:
    """Fraction of response tokens inside the draft vocabulary."""
    keep = np.zeros(int(max(draft_to_target.max().item() + 1, data.tokens.max() + 1)), dtype=bool)
    keep[draft_to_target.numpy()] = True
    hits = total = 0
    for i in range(len(data)):
        response = data.sequence(i)[int(data.prompt_lens[i]) :].astype(np.int64)
        hits += int(keep[response].sum())
        total += len(response)
    return hits / max(total, 1)


def head_config(target_config, cfg: TrainConfig) -> EagleConfig:
    base = EagleConfig.for_target(target_config, cfg.version, cfg.draft_vocab_size if cfg.version == 3 else None)
    return attrs.evolve(
        base, intermediate_size=cfg.intermediate_size or base.intermediate_size, num_layers=cfg.num_layers
    )


def make_batches(data: SelfDistilledData, cfg: TrainConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch of batches (sequence indices): similar lengths together, ``B x T_max <= batch_tokens``."""
    lengths = np.minimum(data.lengths, cfg.max_len)
    order = rng.permutation(len(data))
    window = max(cfg.max_seqs, cfg.batch_tokens // max(int(lengths.mean()), 1)) * 32
    batches = []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        current: list[int] = []
        longest = 0
        for index in chunk:
            n = int(lengths[index])
            if current and (max(longest, n) * (len(current) + 1) > cfg.batch_tokens or len(current) >= cfg.max_seqs):
                batches.append(np.array(current))
                current, longest = [], 0
            current.append(int(index))
            longest = max(longest, n)
        if current:
            batches.append(np.array(current))
    rng.shuffle(batches)
    return batches


def collate(data: SelfDistilledData, indices: np.ndarray, max_len: int, device) -> tuple[torch.Tensor, ...]:
    """Right-padded ``ids [B, T]``, ``lengths [B]``, ``prompt_lens [B]`` on ``device``."""
    # a sequence longer than max_len keeps its last max_len tokens: the answer (what the head learns to draft)
    # stays, the prompt's beginning goes (positions restart at 0; the head's attention sees only relative ones)
    full = [data.sequence(int(i)).astype(np.int64) for i in indices]
    cut = np.array([max(0, len(s) - max_len) for s in full], dtype=np.int64)
    seqs = [s[c:] for s, c in zip(full, cut)]
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
    lengths = np.array([len(s) for s in seqs])
    prompt_lens = np.clip(data.prompt_lens[indices].astype(np.int64) - cut, 0, lengths)
    return tuple(torch.from_numpy(a).to(device) for a in (ids, lengths, prompt_lens))


def batch_loss(
    head: TrainableEagleHead,
    target: LlamaModel,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    prompt_lens: torch.Tensor,
    cfg: TrainConfig,
    target_to_draft: torch.Tensor | None = None,
    timer: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, dict]:
    """The loss of one batch and per-step accuracies (see the module docstring).

    Shapes: ``ids [B, T]``, ``lengths, prompt_lens [B]``; ``target_to_draft [V]`` (EAGLE-3 with its own
    LM head: the draft id of each target id, -1 outside the draft vocabulary). ``timer(name)`` marks
    the end of the phases ``target``, ``head`` and ``loss`` (`PhaseTimer`).
    """
    version, own_vocab = head.config.version, not head.config.target_lm_head
    mark = timer or (lambda _name: None)
    out = target_outputs(target, ids, head.config.feature_layers)
    mark("target")
    outs = head.unroll(target, ids, out.features, cfg.ttt_steps)
    mark("head")
    b, t = ids.shape
    anchor = torch.arange(t, device=ids.device)[None, :]  # [1, T]
    agrees = torch.zeros_like(ids, dtype=torch.bool)  # agrees[k]: t[k + 1] is the target's greedy token at k
    agrees[:, :-1] = ids[:, 1:] == out.greedy[:, :-1]
    on_path = torch.ones_like(agrees)
    total = ids.new_zeros((), dtype=torch.float32)
    zero = total.detach()
    rows_per_step, stats = [], []  # stats: per step (ce, reg, correct), read back with one sync at the end
    for step, hidden in enumerate(outs):
        if step:
            on_path = on_path & shift_left(agrees, step, False)  # the depth-`step` token fed is greedy
        label_pos = anchor + step + 2
        valid = (label_pos < lengths[:, None]) & (label_pos >= prompt_lens[:, None]) & on_path  # [B, T]
        labels = shift_left(out.greedy, step + 1)  # [B, T] target ids
        if own_vocab:  # draft ids; a row whose label lies outside the draft vocabulary counts, untrained
            n = int(valid.sum())
            labels = target_to_draft[labels]
            valid = valid & (labels >= 0)
        labels = labels[valid]  # [N']
        rows = hidden[valid]  # [N', H]
        if not own_vocab:
            n = rows.shape[0]
        rows_per_step.append(n)
        if n == 0:
            stats.append((zero, zero, zero))
            continue
        if cfg.ce == "fused":
            ce_sum, correct = linear_cross_entropy(*head.lm_input(target, rows), labels, cfg.ce_chunk_rows)
        else:
            logits = functools.partial(head.logits, target)
            ce_sum, correct = chunked_cross_entropy_reference(logits, rows, labels, cfg.ce_chunk_rows)
        ce = ce_sum / n
        weight = cfg.step_decay**step
        if version == 1:
            goal = shift_left(out.last, step + 1)[valid].float()  # [N, H]
            # Relative to each row's scale: a few positions carry activations ~100x the median and would
            # otherwise make the loss theirs.
            scale = goal.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
            reg = F.smooth_l1_loss(rows.float() / scale, goal / scale)
            total = total + weight * (cfg.reg_weight * reg + cfg.ce_weight * ce)
        else:
            reg = zero
            total = total + weight * ce
        stats.append((ce.detach(), reg.detach(), correct.float()))
    mark("loss")
    values = torch.stack([torch.stack(s) for s in stats]).tolist()  # [steps, 3]
    metrics = {
        "rows": rows_per_step,
        "ce": [v[0] for v in values],
        "reg": [v[1] for v in values],
        "acc": [v[2] / n if n else 0.0 for v, n in zip(values, rows_per_step)],
    }
    return total, metrics


def split_validation(data: SelfDistilledData, cfg: TrainConfig) -> tuple[SelfDistilledData, SelfDistilledData | None]:
    """Hold out ``min(val_sequences, 5%)`` sequences (seeded); none when the data is tiny."""
    count = min(cfg.val_sequences, len(data) // 20)
    if count == 0:
        return data, None
    order = np.random.default_rng(cfg.seed + 1).permutation(len(data))
    return data.subset(np.sort(order[count:])), data.subset(np.sort(order[:count]))


@torch.no_grad()
def validate(
    head: TrainableEagleHead,
    target: LlamaModel,
    data: SelfDistilledData,
    cfg: TrainConfig,
    target_to_draft: torch.Tensor | None,
) -> list[float]:
    """Teacher-forced accuracy per draft step on held-out sequences (rows weighted)."""
    correct = [0.0] * cfg.ttt_steps
    rows = [0] * cfg.ttt_steps
    for indices in make_batches(data, cfg, np.random.default_rng(0)):
        ids, lengths, prompt_lens = collate(data, indices, cfg.max_len, target.device)
        with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=target.device.type == "cuda"):
            _, metrics = batch_loss(head, target, ids, lengths, prompt_lens, cfg, target_to_draft)
        for s in range(cfg.ttt_steps):
            correct[s] += metrics["acc"][s] * metrics["rows"][s]
            rows[s] += metrics["rows"][s]
    return [c / r if r else 0.0 for c, r in zip(correct, rows)]


def lr_at(step: int, total: int, cfg: TrainConfig, begin: int = 0) -> float:
    """Linear warmup from ``begin``, then cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``total``.

    ``begin`` is where this schedule starts: 0, or the step a finished run was continued from (`train_head`).
    """
    if step - begin < cfg.warmup_steps:
        return cfg.lr * (step - begin + 1) / cfg.warmup_steps
    progress = min(1.0, (step - begin - cfg.warmup_steps) / max(1, total - begin - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def expected_accept_len(acc: list[float]) -> float:
    """``1 + sum_s prod_{j <= s} acc_j``: tau of a chain if step accuracies were acceptance rates."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


def save_head(head: TrainableEagleHead, path: Path, info: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The head in `EagleHead`'s file format (``dtype`` weights, config metadata) plus a training record."""
    from safetensors.torch import save_file

    state = {
        k: (v.to(dtype) if k != "draft_to_target" else v.long()).detach().cpu().contiguous()
        for k, v in head.state().items()
    }
    meta = {**file_metadata(head.config), "speccycle.train": json.dumps(info)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def draft_ids(head: TrainableEagleHead, vocab_size: int) -> torch.Tensor | None:
    """``[V]``: the draft id of each target id (-1 outside) for a head with its own LM head, else None."""
    if head.config.target_lm_head:
        return None
    d2t = head.draft_to_target
    target_to_draft = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    target_to_draft[d2t] = torch.arange(len(d2t), device=d2t.device)
    return target_to_draft


def make_optimizer(head: TrainableEagleHead, cfg: TrainConfig) -> torch.optim.Optimizer:
    fused = next(head.parameters()).device.type == "cuda"
    betas = (0.9, 0.95)
    return torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay, fused=fused)


def train_step(
    head: TrainableEagleHead,
    target: LlamaModel,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: TrainConfig,
    lr: float,
    target_to_draft: torch.Tensor | None = None,
    timer: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, dict]:
    """One optimizer step on ``batch = (ids, lengths, prompt_lens)`` (`collate`); bf16 autocast on a GPU.

    ``timer(name)`` marks the phases ``target``, ``head``, ``loss``, ``backward``, ``optimizer``.
    """
    device = target.device
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss, metrics = batch_loss(head, target, *batch, cfg, target_to_draft, timer)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if timer is not None:
        timer("backward")
    torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    optimizer.step()
    if timer is not None:
        timer("optimizer")
    return loss, metrics


def head_name(config: EagleConfig) -> str:
    """``eagle1``, ``eagle3`` (own reduced-vocabulary LM head) or ``eagle3full`` (the target's LM head)."""
    if config.version == 3 and config.target_lm_head:
        return "eagle3full"
    return f"eagle{config.version}"


def widen_draft_vocabulary(
    head: TrainableEagleHead, size: int, data: SelfDistilledData, target: LlamaModel, ridge: float = 1e-2
) -> TrainableEagleHead:
    """The same EAGLE-3 head over a draft vocabulary of ``size`` ids: its own ids plus the most frequent
    response tokens of ``data`` it lacks (sorted, as `draft_vocabulary` writes them).

    The layer, the norms and the LM-head rows of the ids it had are kept as they are, so the logits of
    those ids do not change. A new id's row starts as its row of the target's LM head mapped into the
    head's space by the linear map that best sends the target's rows of the old ids to their trained
    rows (ridge least squares, the penalty ``ridge`` times the Gram matrix's mean diagonal entry): on the
    3,072-id SmolLM2 head shipped until 8cba6c9, such a map fitted on two thirds of the rows predicts
    the other third at cosine 0.61, where the target's rows as they are score -0.01.
    """
    c = head.config
    if c.version != 3 or c.target_lm_head:
        raise ValueError(
            f"only an EAGLE-3 head with its own LM head has a draft vocabulary to widen, not {head_name(c)}"
        )
    old = head.draft_to_target.cpu()
    if size < len(old):
        raise ValueError(
            f"the head's draft vocabulary has {len(old)} ids; --draft-vocab {size} would drop trained rows: pass "
            f"--draft-vocab >= {len(old)} (or train a fresh head without --resume)"
        )
    vocab_size = target.config.vocab_size
    ids = draft_vocabulary(data, size, vocab_size, keep=old)  # sorted
    table = target.lm_head_weight.detach().float().cpu()  # [V, H]
    trained = head.w("lm_head.weight").detach().float().cpu()  # [Vd, H]
    x = table[old]
    gram = x.T @ x
    gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0])
    mapping = torch.linalg.solve(gram, x.T @ trained)  # [H, H]
    rows = table[ids] @ mapping
    row_of = torch.full((vocab_size,), -1, dtype=torch.long)
    row_of[old] = torch.arange(len(old))  # each old id's trained row
    kept = row_of[ids] >= 0
    rows[kept] = trained[row_of[ids[kept]]]
    weights = {name: value.cpu() for name, value in head.state().items()}
    weights.update({"lm_head.weight": rows, "draft_to_target": ids})
    return TrainableEagleHead(attrs.evolve(c, draft_vocab_size=len(ids)), weights)


def widen_mlp(head: TrainableEagleHead, size: int, seed: int = 0, std: float = 0.02) -> TrainableEagleHead:
    """The same head with ``size`` MLP units: the trained units as they are, each new unit's gate and up rows
    ``N(0, std)`` (as a fresh head's) and its down-projection column zero, so the head computes what it did
    (the new units add exact zeros) until training moves them. The down columns get gradients at once (the
    units' activations are not zero); the gate and up rows follow from the first step on.
    """
    c = head.config
    if size < c.intermediate_size:
        raise ValueError(
            f"the head's MLP has {c.intermediate_size} units; --v{c.version}-intermediate {size} would drop trained "
            f"units: pass >= {c.intermediate_size} (or train a fresh head without --resume)"
        )
    extra, h = size - c.intermediate_size, c.hidden_size
    gen = torch.Generator().manual_seed(seed)
    weights = {name: value.cpu() for name, value in head.state().items()}  # float32 parameters, detached
    mlps = [("layer.gate_proj.weight", "layer.up_proj.weight", "layer.down_proj.weight")]
    mlps += [tuple(f"{extra_layer_prefix(i)}mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
             for i in range(1, c.num_layers)]  # fmt: skip
    for gate, up, down in mlps:  # every layer's MLP
        for name in (gate, up):
            weights[name] = torch.cat([weights[name], torch.randn((extra, h), generator=gen) * std])
        weights[down] = torch.cat([weights[down], torch.zeros((h, extra))], 1)
    return TrainableEagleHead(attrs.evolve(c, intermediate_size=size), weights)


def deepen(head: TrainableEagleHead, num_layers: int, seed: int = 0, std: float = 0.02) -> TrainableEagleHead:
    """The same head with ``num_layers`` decoder layers: the trained layers as they are, each new one (after
    them) with fresh Q/K/V and gate/up rows ``N(0, std)``, norms 1, and its O and down projections zero, so it
    adds exact zeros to the residual stream and the head computes what it did until training moves it. The O
    and down projections get gradients at once; the rest follows from the first step on.
    """
    c = head.config
    if num_layers < c.num_layers:
        raise ValueError(
            f"the head has {c.num_layers} layers; --head-layers {num_layers} would drop trained layers: pass "
            f">= {c.num_layers} (or train a fresh head without --resume)"
        )
    deeper = attrs.evolve(c, num_layers=num_layers)
    gen = torch.Generator().manual_seed(seed)
    weights = {name: value.cpu() for name, value in head.state().items()}  # float32 parameters, detached
    for name, shape in _shapes(deeper).items():
        if name in weights:
            continue
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * std
    return TrainableEagleHead(deeper, weights)


def _resumed(
    head: TrainableEagleHead,
    wanted: EagleConfig,
    source: Path,
    widen: Callable[[TrainableEagleHead], TrainableEagleHead] | None = None,
    log: Callable[[str], None] = print,
    seed: int = 0,
) -> TrainableEagleHead:
    """``head`` if it is the head this run trains; a clear error where ``source`` holds another one.

    A head that differs only in a smaller draft vocabulary (``widen``, see `widen_draft_vocabulary`), a
    narrower MLP (`widen_mlp`), fewer layers (`deepen`), or any of them together, is grown to the one asked
    for (the MLP widened before layers are added, so the new layers take the wanted width).
    """
    c = head.config
    more_ids = (  # an own-vocabulary head (EAGLE-3, draft_vocab_size > 0) asked for a larger one
        widen is not None
        and not c.target_lm_head
        and not wanted.target_lm_head  # (EAGLE-1's draft_vocab_size is None)
        and wanted.draft_vocab_size > c.draft_vocab_size
    )
    more_units = wanted.intermediate_size > c.intermediate_size
    more_layers = wanted.num_layers > c.num_layers
    grown = attrs.evolve(
        c,
        draft_vocab_size=wanted.draft_vocab_size if more_ids else c.draft_vocab_size,
        intermediate_size=wanted.intermediate_size if more_units else c.intermediate_size,
        num_layers=wanted.num_layers if more_layers else c.num_layers,
    )
    if (more_ids or more_units or more_layers) and grown == wanted:
        if more_ids:
            head = widen(head)
            log(
                f"[train] widened {source}'s draft vocabulary from {c.draft_vocab_size} to "
                f"{head.config.draft_vocab_size} ids (trained rows kept, new rows mapped from the target's LM head)"
            )
        if more_units:
            head = widen_mlp(head, wanted.intermediate_size, seed=seed)
            log(
                f"[train] widened {source}'s MLP from {c.intermediate_size} to {wanted.intermediate_size} units "
                "(trained units kept, new ones with zero down-projection columns: the same function to start)"
            )
        if more_layers:
            head = deepen(head, wanted.num_layers, seed=seed)
            log(
                f"[train] deepened {source}'s head from {c.num_layers} to {wanted.num_layers} decoder layers "
                "(trained layers kept, new ones with zero O and down projections: the same function to start)"
            )
    if head.config != wanted:
        raise ValueError(
            f"--resume: {source} holds a {head_name(head.config)} head of config {attrs.asdict(head.config)}, not "
            f"the {head_name(wanted)} head asked for ({attrs.asdict(wanted)}): drop --resume or use another --out "
            "and --work-dir"
        )
    return head


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory(device: torch.device) -> str:
    """GPU memory: peak allocated, and the caching allocator's retries (each one frees its cache: slow)."""
    if device.type != "cuda":
        return ""
    stats = torch.cuda.memory_stats(device)
    return (
        f"; peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB, "
        f"allocator retries {stats.get('num_alloc_retries', 0)}"
    )


class PhaseTimer:
    """Where a training step's time goes: ``timer(name)`` marks the end of a phase; `summary` averages.

    On a GPU the marks are CUDA events (no sync until `summary`); on a CPU the wall clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.steps: list[list[tuple[str, object]]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.steps.append([("start", self._now())])

    def __call__(self, name: str) -> None:
        if self.steps:
            self.steps[-1].append((name, self._now()))

    def phases(self) -> dict[str, float]:
        """Mean milliseconds per phase over the timed steps."""
        if self.cuda:
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for marks in self.steps:
            for (_, a), (name, b) in zip(marks, marks[1:]):
                ms = a.elapsed_time(b) if self.cuda else (b - a) * 1000
                totals[name] = totals.get(name, 0.0) + ms
        return {name: ms / len(self.steps) for name, ms in totals.items()}

    def summary(self) -> str:
        phases = self.phases()
        if not phases:
            return "phases not timed"
        parts = ", ".join(f"{name} {ms:.0f}" for name, ms in phases.items())
        return f"phases (ms per step, mean of {len(self.steps)}): {parts}"


def train_head(
    cfg: TrainConfig,
    data: SelfDistilledData,
    target: LlamaModel,
    out_path: Path,
    checkpoint_path: Path | None = None,
    resume: bool = False,
    info: dict | None = None,
    log: Callable[[str], None] = print,
) -> tuple[TrainableEagleHead, dict]:
    """Train one head; write ``out_path`` (bf16 head, config metadata) every ``save_every_s`` and at the end.

    ``checkpoint_path``: the float32 weights, AdamW state and step (for ``resume`` on the same machine);
    without it, ``resume`` restarts from the head at ``out_path`` and its recorded step, with fresh
    AdamW moments.
    """
    device = target.device
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    data, val_data = split_validation(data, cfg)
    hcfg = head_config(target.config, cfg)
    start_step, total_steps = 0, cfg.steps
    own_vocab = cfg.version == 3 and cfg.draft_vocab_size > 0
    d2t = draft_vocabulary(data, cfg.draft_vocab_size, target.config.vocab_size) if own_vocab else None
    head = TrainableEagleHead.init(hcfg, d2t, seed=cfg.seed)
    optim_state = None

    def widen(narrow: TrainableEagleHead) -> TrainableEagleHead:
        return widen_draft_vocabulary(narrow, hcfg.draft_vocab_size, data, target)

    begin = 0  # where the learning-rate schedule starts (a continued run's first step)
    if resume and checkpoint_path is not None and checkpoint_path.is_file():
        saved = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
        loaded = TrainableEagleHead(EagleConfig(**saved["config"]), saved["weights"])
        head = _resumed(loaded, hcfg, checkpoint_path, widen, log, seed=cfg.seed)
        optim_state, start_step, total_steps = saved["optimizer"], saved["step"], saved["total_steps"]
        if head.config != loaded.config:  # widened: AdamW's moments were for the narrower head's tensors
            optim_state = None
        begin = int(saved.get("schedule_begin", 0))
        log(f"[train] resumed from {checkpoint_path} at step {start_step}/{total_steps}")
    elif resume and out_path.is_file():
        from safetensors import safe_open

        from ..engine.drafters.eagle import EagleHead

        with safe_open(str(out_path), framework="pt") as f:
            record = json.loads((f.metadata() or {}).get("speccycle.train", "{}"))
        head = _resumed(
            TrainableEagleHead.from_eagle_head(EagleHead.load(out_path)), hcfg, out_path, widen, log, seed=cfg.seed
        )
        start_step, total_steps = int(record.get("step", 0)), int(record.get("total_steps", cfg.steps))
        begin = int(record.get("schedule_begin", 0))
        log(f"[train] resumed weights from {out_path} at step {start_step}/{total_steps} (fresh AdamW moments)")
    elif resume:
        log("[train] --resume: no checkpoint found, starting fresh")
    if start_step >= total_steps:  # a finished schedule: continue with a new one (re-warmup, cosine) of cfg.steps
        begin, total_steps = start_step, start_step + cfg.steps
        log(f"[train] the resumed schedule had ended: continuing with a new one, steps {begin}..{total_steps}")
    step_cap = total_steps  # the budget re-fits below never go past this
    head.to(device)
    target_to_draft = draft_ids(head, target.config.vocab_size)
    if target_to_draft is not None:
        d2t = head.draft_to_target.cpu()
        log(f"[train] draft vocabulary {len(d2t)}: covers {vocabulary_coverage(data, d2t):.1%} of response tokens")
    optimizer = make_optimizer(head, cfg)
    if optim_state is not None:
        optimizer.load_state_dict(optim_state)
    info = dict(info or {})
    lm_head = "the target's LM head" if hcfg.target_lm_head else f"own LM head over {hcfg.draft_vocab_size} tokens"
    log(
        f"[train] {head_name(hcfg)}: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters, "
        f"{head.num_bytes() / 1e6:.2f} MB ({head.num_bytes() / 2**20:.2f} MiB) of tensors in bfloat16; intermediate "
        f"{hcfg.intermediate_size}, features {hcfg.feature_layers}, {lm_head}; {len(data)} sequences, "
        f"{int(data.lengths.sum())} tokens (+ {len(val_data) if val_data is not None else 0} held out)"
    )

    def record(step: int, history: dict) -> dict:
        return {
            **info,
            "step": step,
            "total_steps": total_steps,
            "schedule_begin": begin,
            "config": attrs.asdict(cfg),
            **history,
        }

    def save(step: int, history: dict) -> None:
        if val_data is not None:
            val_acc = validate(head, target, val_data, cfg, target_to_draft)
            history.update(val_acc=[round(a, 4) for a in val_acc], val_tau=round(expected_accept_len(val_acc), 3))
            log(
                f"[train] step {step} held-out acc/step {' '.join(f'{a:.3f}' for a in val_acc)} "
                f"(chain tau ~{history['val_tau']:.2f})"
            )
        save_head(head, out_path, record(step, history))
        if checkpoint_path is not None:
            weights = {k: v.detach().cpu() for k, v in head.state().items()}
            tmp = checkpoint_path.with_name(checkpoint_path.name + ".tmp")
            torch.save(
                {
                    "config": attrs.asdict(hcfg),
                    "weights": weights,
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "total_steps": total_steps,
                    "schedule_begin": begin,
                },
                tmp,
            )
            os.replace(tmp, checkpoint_path)

    try:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc=f"train {head_name(hcfg)}", mininterval=5.0)
    except ImportError:
        bar = None
    history: dict = {"loss": None, "acc": None}
    window: list[tuple[float, list[float]]] = []
    start = last_save = last_log = time.perf_counter()
    budget = cfg.time_budget_s
    save_s = min(10.0, 0.05 * (budget or 200))  # what the final held-out check and write take; measured at saves
    step_s = 0.0  # the last step's wall time
    timer = PhaseTimer(device)
    timed_from = None
    step = saved_at = logged_at = start_step
    epoch = 0
    tokens_seen = 0
    done = False
    while not done:
        for indices in make_batches(data, cfg, rng):
            if step >= total_steps:
                done = True
                break
            now = step_began = time.perf_counter()
            if budget is not None and step > start_step:
                if now - start + step_s + 1.5 * save_s > budget:  # a hard stop: the call must end in time
                    log(f"[train] time budget reached at step {step} of {total_steps}: stopping")
                    total_steps, done = step, True
                    break
            if step == start_step + 5:
                _sync(device)
                timed_from = time.perf_counter()
            if step == start_step + cfg.measure_at and timed_from is not None:
                _sync(device)
                per_step = (time.perf_counter() - timed_from) / (cfg.measure_at - 5)
                log(f"[train] {per_step * 1000:.0f} ms/step; {timer.summary()}{_memory(device)}")
                if budget is not None:
                    left = budget - (time.perf_counter() - start)
                    fits = step + int(0.93 * left / per_step)  # checkpoints and held-out checks take the rest
                    if fits < total_steps:
                        total_steps = max(step + 1, fits)
                        if bar is not None:
                            bar.total = total_steps
                    log(f"[train] {total_steps} steps fit the {budget:.0f}s budget")
            timing = timed_from is not None and step < start_step + cfg.measure_at
            if timing:
                timer.start()
            ids, lengths, prompt_lens = collate(data, indices, cfg.max_len, device)
            lr = lr_at(step, total_steps, cfg, begin)
            marks = timer if timing else None
            loss, metrics = train_step(
                head, target, optimizer, (ids, lengths, prompt_lens), cfg, lr, target_to_draft, marks
            )
            step += 1
            tokens_seen += int(lengths.sum())
            window.append((float(loss.detach()), metrics["acc"]))
            if bar is not None:
                bar.update(1)
            now = time.perf_counter()
            step_s = now - step_began
            if now - last_log > cfg.log_every_s or step == total_steps:
                mean_loss = sum(w[0] for w in window) / len(window)
                acc = [sum(w[1][s] for w in window) / len(window) for s in range(cfg.ttt_steps)]
                history = {"loss": round(mean_loss, 4), "acc": [round(a, 4) for a in acc], "epochs": epoch}
                log(
                    f"[train] step {step}/{total_steps} epoch {epoch} loss {mean_loss:.4f} "
                    f"lr {lr_at(step, total_steps, cfg, begin):.2e} "
                    f"acc/step {' '.join(f'{a:.3f}' for a in acc)} (chain tau ~{expected_accept_len(acc):.2f}) "
                    f"{tokens_seen / (now - start):.0f} tok/s {(now - last_log) / (step - logged_at) * 1000:.0f} "
                    f"ms/step {now - start:.0f}s{_memory(device)}"
                )
                if budget is not None and step > start_step + cfg.measure_at and step < total_steps:
                    # the pace changes (batch shapes, memory): end the schedule where the budget ends, at the
                    # mean pace since measuring began (one window's pace swings with its batches' lengths)
                    per_step = (now - timed_from) / max(1, step - start_step - 5)
                    fits = min(step_cap, step + max(1, int((budget - (now - start) - 1.5 * save_s) / per_step)))
                    if abs(fits - total_steps) > 0.02 * total_steps:
                        log(f"[train] at {per_step * 1000:.0f} ms/step {fits} steps fit the budget (was {total_steps})")
                        total_steps = fits
                        if bar is not None:
                            bar.total = total_steps
                window, last_log, logged_at = [], now, step
            if now - last_save > cfg.save_every_s:
                save(step, history)
                save_s = time.perf_counter() - now
                last_save, saved_at = time.perf_counter(), step
        epoch += 1
    if bar is not None:
        bar.close()
    if saved_at != step:
        save(step, history)
    log(
        f"[train] wrote {out_path} ({out_path.stat().st_size / 1e6:.2f} MB) after {step} steps, "
        f"{time.perf_counter() - start:.0f}s"
    )
    return head, record(step, history)
