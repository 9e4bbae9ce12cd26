"""Train an EAGLE head by self-distillation: frozen target forward per batch, the head unrolled over draft steps.

Per batch: the target runs once over the padded sequences (features, greedy labels); the head runs
``ttt_steps`` steps (`TrainableEagleHead.unroll`). Step ``s`` at anchor ``k`` is trained to predict the
target's greedy token at position ``k + s + 2`` where that token is a response token and the tokens
the step was fed (depths ``1..s``) are the target's greedy ones: a draft deeper than a wrong token is
never accepted, so it need not be trained there. Losses, step ``s`` weighted ``step_decay ** s``:

* EAGLE-1: ``reg_weight * smooth_l1(out / r, f_last[k + s + 1] / r) + ce_weight * CE(target head(out))``
  (feature regression, relative to the RMS ``r`` of the target feature's row, plus token
  cross-entropy through the target's frozen LM head);
* EAGLE-3: ``CE`` over the reduced draft vocabulary (targets outside it are masked).

Cross-entropy runs in checkpointed row chunks: EAGLE-1 logits are ``rows x 49152`` per step.
"""

from __future__ import annotations

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
from torch.utils.checkpoint import checkpoint

from ..engine.drafters.eagle import METADATA_KEY, EagleConfig
from ..engine.llama import LlamaModel
from .data import SelfDistilledData
from .features import target_outputs
from .head import TrainableEagleHead, shift_left


@attrs.frozen
class TrainConfig:
    version: int = 1
    ttt_steps: int = 6  # draft steps unrolled per batch (6 covers chains up to S = 6)
    draft_vocab_size: int = 3072  # EAGLE-3 only
    intermediate_size: int | None = None  # None: the target's; EAGLE-3 defaults to 512 (see pipeline)
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
    ce_chunk_rows: int = 4096


def draft_vocabulary(data: SelfDistilledData, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent response tokens (EAGLE-3's reduced vocabulary), sorted ids ``[size]``."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(data)):
        np.add.at(counts, data.sequence(i)[int(data.prompt_lens[i]) :].astype(np.int64), 1)
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
    return attrs.evolve(base, intermediate_size=cfg.intermediate_size or base.intermediate_size)


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
    seqs = [data.sequence(int(i))[:max_len].astype(np.int64) for i in indices]
    width = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
    lengths = np.array([len(s) for s in seqs])
    prompt_lens = np.minimum(data.prompt_lens[indices].astype(np.int64), lengths)
    return tuple(torch.from_numpy(a).to(device) for a in (ids, lengths, prompt_lens))


def _ce_chunk(head: TrainableEagleHead, target: LlamaModel, hidden: torch.Tensor, labels: torch.Tensor):
    logits = head.logits(target, hidden).float()
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return loss, (logits.argmax(-1) == labels).sum()


def batch_loss(
    head: TrainableEagleHead,
    target: LlamaModel,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    prompt_lens: torch.Tensor,
    cfg: TrainConfig,
    target_to_draft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The loss of one batch and per-step accuracies (see the module docstring).

    Shapes: ``ids [B, T]``, ``lengths, prompt_lens [B]``; ``target_to_draft [V]`` (EAGLE-3: the
    draft id of each target id, -1 outside the draft vocabulary).
    """
    version = head.config.version
    out = target_outputs(target, ids, head.config.feature_layers)
    outs = head.unroll(target, ids, out.features, cfg.ttt_steps)
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
        labels = shift_left(out.greedy, step + 1)[valid]  # [N]
        rows = hidden[valid]  # [N, H]
        n = rows.shape[0]
        rows_per_step.append(n)
        if n == 0:
            stats.append((zero, zero, zero))
            continue
        if version == 3:
            labels = target_to_draft[labels]
            labels = torch.where(labels >= 0, labels, torch.full_like(labels, -100))
        ce_sum, correct = zero, zero
        for chunk, chunk_labels in zip(rows.split(cfg.ce_chunk_rows), labels.split(cfg.ce_chunk_rows)):
            if torch.is_grad_enabled():
                loss, hits = checkpoint(_ce_chunk, head, target, chunk, chunk_labels, use_reentrant=False)
            else:
                loss, hits = _ce_chunk(head, target, chunk, chunk_labels)
            ce_sum, correct = ce_sum + loss, correct + hits
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


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine from ``lr`` down to ``min_lr_ratio * lr`` at ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
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
    meta = {METADATA_KEY: json.dumps(attrs.asdict(head.config)), "speccycle.train": json.dumps(info)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


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
    d2t = draft_vocabulary(data, cfg.draft_vocab_size, target.config.vocab_size) if cfg.version == 3 else None
    head = TrainableEagleHead.init(hcfg, d2t, seed=cfg.seed)
    optim_state = None
    if resume and checkpoint_path is not None and checkpoint_path.is_file():
        saved = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
        head = TrainableEagleHead(EagleConfig(**saved["config"]), saved["weights"])
        optim_state, start_step, total_steps = saved["optimizer"], saved["step"], saved["total_steps"]
        log(f"[train] resumed from {checkpoint_path} at step {start_step}/{total_steps}")
    elif resume and out_path.is_file():
        from safetensors import safe_open

        from ..engine.drafters.eagle import EagleHead

        with safe_open(str(out_path), framework="pt") as f:
            record = json.loads((f.metadata() or {}).get("speccycle.train", "{}"))
        head = TrainableEagleHead.from_eagle_head(EagleHead.load(out_path))
        start_step, total_steps = int(record.get("step", 0)), int(record.get("total_steps", cfg.steps))
        log(f"[train] resumed weights from {out_path} at step {start_step}/{total_steps} (fresh AdamW moments)")
    elif resume:
        log("[train] --resume: no checkpoint found, starting fresh")
    head.to(device)
    if head.config.version == 3:
        d2t = head.draft_to_target
        target_to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=device)
        target_to_draft[d2t] = torch.arange(len(d2t), device=device)
        log(
            f"[train] draft vocabulary {len(d2t)}: covers {vocabulary_coverage(data, d2t.cpu()):.1%} of response tokens"
        )
    else:
        target_to_draft = None
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=device.type == "cuda"
    )
    if optim_state is not None:
        optimizer.load_state_dict(optim_state)
    amp = device.type == "cuda"
    info = dict(info or {})
    log(
        f"[train] EAGLE-{hcfg.version}: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters, "
        f"{head.num_bytes() / 2**20:.1f} MiB in bfloat16; intermediate {hcfg.intermediate_size}, features "
        f"{hcfg.feature_layers}; {len(data)} sequences, {int(data.lengths.sum())} tokens "
        f"(+ {len(val_data) if val_data is not None else 0} held out)"
    )

    def record(step: int, history: dict) -> dict:
        return {**info, "step": step, "total_steps": total_steps, "config": attrs.asdict(cfg), **history}

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
                },
                tmp,
            )
            os.replace(tmp, checkpoint_path)

    try:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc=f"train eagle{hcfg.version}", mininterval=5.0)
    except ImportError:
        bar = None
    history: dict = {"loss": None, "acc": None}
    window: list[tuple[float, list[float]]] = []
    start = last_save = last_log = time.perf_counter()
    timed_from = None
    step = saved_at = start_step
    epoch = 0
    tokens_seen = 0
    done = False
    while not done:
        for indices in make_batches(data, cfg, rng):
            if step >= total_steps:
                done = True
                break
            if step == start_step + 5:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                timed_from = time.perf_counter()
            if step == start_step + cfg.measure_at and cfg.time_budget_s is not None and timed_from is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                per_step = (time.perf_counter() - timed_from) / (cfg.measure_at - 5)
                left = cfg.time_budget_s - (time.perf_counter() - start)
                fits = step + int(0.93 * left / per_step)  # checkpoints and held-out checks take the rest
                if fits < total_steps:
                    total_steps = max(step + 1, fits)
                    if bar is not None:
                        bar.total = total_steps
                log(
                    f"[train] {per_step * 1000:.0f} ms/step: {total_steps} steps fit the "
                    f"{cfg.time_budget_s:.0f}s budget"
                )
            ids, lengths, prompt_lens = collate(data, indices, cfg.max_len, device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, cfg)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss, metrics = batch_loss(head, target, ids, lengths, prompt_lens, cfg, target_to_draft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
            optimizer.step()
            step += 1
            tokens_seen += int(lengths.sum())
            window.append((float(loss.detach()), metrics["acc"]))
            if bar is not None:
                bar.update(1)
            now = time.perf_counter()
            if now - last_log > cfg.log_every_s or step == total_steps:
                mean_loss = sum(w[0] for w in window) / len(window)
                acc = [sum(w[1][s] for w in window) / len(window) for s in range(cfg.ttt_steps)]
                history = {"loss": round(mean_loss, 4), "acc": [round(a, 4) for a in acc], "epochs": epoch}
                log(
                    f"[train] step {step}/{total_steps} epoch {epoch} loss {mean_loss:.4f} "
                    f"lr {lr_at(step, total_steps, cfg):.2e} "
                    f"acc/step {' '.join(f'{a:.3f}' for a in acc)} (chain tau ~{expected_accept_len(acc):.2f}) "
                    f"{tokens_seen / (now - start):.0f} tok/s {now - start:.0f}s"
                )
                window, last_log = [], now
            if now - last_save > cfg.save_every_s:
                save(step, history)
                last_save, saved_at = now, step
        epoch += 1
    if bar is not None:
        bar.close()
    if saved_at != step:
        save(step, history)
    log(f"[train] wrote {out_path} after {step} steps, {time.perf_counter() - start:.0f}s")
    return head, record(step, history)
