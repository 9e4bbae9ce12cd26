"""Continuous batching over the speculative cycle: admit, run, retract and retire requests.

    scheduler = Scheduler.from_engine(engine, speculation="adaptive")
    rid = scheduler.submit(engine.chat_prompt("Hi"), SamplingParams(max_new_tokens=64, stop_strings=("\\n\\n",)))
    while not scheduler.idle:
        for request in scheduler.step():          # requests that finished during this step
            print(request.request_id, request.finish_reason, engine.tokenizer.decode(request.output))

Each `step` (1) admits waiting requests, oldest first, that the KV pool can hold through their next
cycle: one prefill over their prompts, merged into the running `Ready` batch; (2) makes room for the
running batch's next reservation, retracting the newest requests if the pool is short; (3) runs one
cycle through the transition table, in the draft shape the speculation mode gives (adaptive: the shape of
the highest measured throughput at the batch size, `engine/serving/adaptive.py`), as the graphed executor's
captured cycle where it covers the batch (`engine.fast.fused_cycle`), else eagerly; (4)
streams the newly committed tokens and retires finished requests. Requests of any prompt and output
length join and leave between cycles.

**KV pressure: the policy.** Admission is conservative: a request is admitted only if the free pages
cover its prompt plus one cycle's reservation after the running batch's own next reservation. When
the running batch later outgrows the pool, the requests that arrived last are *retracted*: every
page they hold is freed and they go back to the front of the queue with their committed output; on
readmission the prefill recomputes prompt + output and decoding goes on where it stopped (a greedy
request's output equals an uninterrupted run; a sampled one goes on with its seeded stream, another
draw from the same distribution). The oldest request always
keeps running, so every request finishes. A request that cannot fit even alone (its prompt, or later
its prompt and output, plus one cycle's reservation exceeds the whole pool) finishes with
``finish_reason="error"`` and a message; the rest go on.

**Cancellation.** `cancel(request_id)` gives a request up: a waiting one leaves the queue, a running one leaves
the batch between cycles through the table's Ready ``retire`` row (its pages freed); either finishes with
``finish_reason="cancelled"`` and keeps the output committed so far. Cancelling a finished request returns False;
an id this scheduler never issued raises `ValueError`.

Invalid requests never raise out of `step`: bad prompts (empty, ids outside the vocabulary), NaN
logits and refusals finish that request with ``"error"``. `submit` raises `ValueError` for input it
cannot even queue (a prompt that is not a sequence of ints, parameters of the wrong type).
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import attrs
import torch

from ...backends.registry import get_backend
from ...core import Admitted, Compacted, KVPoolExhausted, Ports, Ready, Request, SamplingParams, SpecConfig, Verified
from ...core.ports import (
    NoRecurrentState,
    draft_kind,
    draft_pairing,
    draft_vocab_size,
    kv_capacity,
    kv_knows,
    kv_prefix_caching,
    target_device,
    target_vocab_size,
)
from ...statemachine import step as run_step
from ...statemachine.batching import merge_ready, reshape, select_ready
from ...statemachine.transitions import first_level_due
from ..fast.graphs import BUCKETS, prefill_shapes
from ..fast.graphs import bucket as row_bucket
from .adaptive import AdaptiveSpeculation, ShapeController, ZeroDraft, batch_bucket, no_draft_shape

Speculation = Literal["on", "off", "adaptive"]


@attrs.define
class SchedulerStats:
    """Counts since the scheduler was built. ``tau``: mean ``accept_len`` of speculative verifies."""

    steps: int = 0
    spec_cycles: int = 0
    plain_cycles: int = 0  # cycles of shape S == 0 (no draft)
    first_levels: int = 0  # moves from S == 0 to a shape that drafts that computed a deferred top-K (first_level row)
    fused_cycles: int = 0  # cycles run as the graphed executor's captured cycle (the rest ran eagerly)
    pipelined_cycles: int = 0  # of those, launched from the device's state before the last one was collected
    captures: int = 0  # of those, cycles whose launch captured their graph (a bucket and shape's first, per parity)
    # graphs of forwards outside a cycle (a prefill's, a draft extend's, a first level's) captured in a step
    forward_captures: int = 0
    verifies: int = 0  # request-verifies in speculative cycles
    accepted: int = 0  # tokens those verifies accepted (bonus included)
    committed: int = 0  # output tokens committed, prefill included
    prefills: int = 0
    retractions: int = 0
    refused: int = 0  # requests that could never fit the pool
    errors: int = 0  # requests finished with "error" (refusals included)
    cancelled: int = 0  # requests finished with "cancelled"
    seconds: float = 0.0  # in steps, of which:
    prefill_seconds: float = 0.0  # admissions (the prefill and its draft extend, launched: the host's wall time)
    cycle_seconds: float = 0.0  # cycles (a fused one waits for its commits: the GPU's time with the host's)
    shapes: dict = attrs.field(factory=dict)  # SpecConfig -> cycles run in that shape
    prefill_tokens: int = 0  # tokens admitted requests needed KV for (prompt, and output when resumed)
    cached_tokens: int = 0  # of those, the tokens a prefix cache hit served (not computed)
    published_pages: int = 0  # pages requests put into the prefix cache
    held_admissions: int = 0  # steps admission batching left requests waiting (`Scheduler.admit_fraction`)

    @property
    def tau(self) -> float:
        return self.accepted / self.verifies if self.verifies else 0.0

    @property
    def computed_tokens(self) -> int:
        """Prefill tokens the target computed: those no prefix cache hit served."""
        return self.prefill_tokens - self.cached_tokens

    @property
    def prefix_hit_rate(self) -> float:
        """The share of prefill tokens served from the prefix cache (0 without one)."""
        return self.cached_tokens / self.prefill_tokens if self.prefill_tokens else 0.0


# The default ``admit_fraction`` of a speculating scheduler. Measured on an H200 (SmolLM2-135M bf16, EAGLE-3 chain S4,
# 13 prompts, 128 new tokens, closed loop, one run a setting at 3303272; bench/results/scheduler_throughput-H200-
# 20261127-3303272-admit-*.json): at 64 clients `spec` 24,963 -> 28,126 tokens/s and adaptive 25,975 -> 28,178 with
# 79 -> 29 admissions, at 256 clients 35,860 -> 41,782 and 40,106 -> 45,127 (107 -> 29); 0.25 was no better.
# Without speculation requests of one length finish together, so admissions come in waves already, and holding them
# only empties places: `ar` fell from 49,701 to 37,528 tokens/s at 256 clients.
SPECULATIVE_ADMIT_FRACTION = 0.125


class Scheduler:
    """Continuous batching of speculative decoding (greedy and sampled requests) over one set of ports.

    ``max_prefill_tokens`` caps the tokens one step prefills (whole requests; at least one).
    ``admit_fraction`` batches admissions: while requests run, the waiting ones are admitted once an admission would
    take at least that fraction of the running batch (as many wait, and as many places are free), or once they have
    waited ``admit_wait`` steps; 0 admits at every step; None (the default): `SPECULATIVE_ADMIT_FRACTION` when the
    scheduler speculates (``"on"`` or adaptive), 0 when it does not. An admission's step costs about the same
    whatever its size (the prefill's launches, the host's work around them, the cycle relaunched over the joined
    batch), and under speculation requests of one length stop finishing in the same step, so admitting each step's
    few finished places makes many small admissions (docs/serving.md, "Admission batching").
    ``speculation``: ``"on"`` (every cycle in ``config``'s shape), ``"off"`` (never draft: the drafter is not run
    at all, each cycle a plain decode step through the table, shape ``S == 0``), ``"adaptive"``, an
    `AdaptiveSpeculation` (each cycle the draft shape of the highest measured throughput at its batch size) or a
    running `ShapeController` (shared between schedulers: its measurements go on).
    ``pipeline``: a graphed cycle whose batch nothing joins stays on the GPU past its step, and the next step
    launches the batch's next cycle from the device's state before collecting it (docs/serving.md, "Overlap").
    ``eos_token_ids`` are added to every request's ``stop_token_ids``. ``on_tokens(request_id,
    tokens)`` streams committed tokens (final: never taken back); ``on_finish(request)`` sees each
    request once, when it finishes or errors.
    """

    def __init__(
        self,
        ports: Ports,
        config: SpecConfig,
        *,
        backend=None,
        max_batch_size: int = 64,
        max_prefill_tokens: int | None = None,
        admit_fraction: float | None = None,
        admit_wait: int = 4,
        speculation: Speculation | AdaptiveSpeculation = "on",
        eos_token_ids: Sequence[int] = (),
        checked: bool = False,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        request_ids: Iterator[int] | None = None,
        fused_cycles=None,
        prefix_cache: bool = False,
        pipeline: bool = True,
    ) -> None:
        if not isinstance(ports, Ports):
            raise ValueError(f"ports must be a speccycle.core.Ports, got {type(ports).__name__}")
        if not isinstance(config, SpecConfig):
            raise ValueError(f"config must be a SpecConfig, got {type(config).__name__}")
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be an int >= 1")
        if max_prefill_tokens is not None and (
            not isinstance(max_prefill_tokens, int) or isinstance(max_prefill_tokens, bool) or max_prefill_tokens < 1
        ):
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens!r} must be None or an int >= 1")
        if admit_fraction is not None and (
            isinstance(admit_fraction, bool)
            or not isinstance(admit_fraction, (int, float))
            or not 0 <= admit_fraction <= 1
        ):
            raise ValueError(
                f"admit_fraction={admit_fraction!r} must be None or a number in [0, 1] (0: admit at every step)"
            )
        if not isinstance(admit_wait, int) or isinstance(admit_wait, bool) or admit_wait < 0:
            raise ValueError(f"admit_wait={admit_wait!r} must be an int >= 0 (steps a waiting request may be held)")
        target_vocab, draft_vocab = target_vocab_size(ports), draft_vocab_size(ports)
        if not isinstance(target_vocab, int) or target_vocab < 1:
            raise ValueError(f"the target's vocab_size={target_vocab!r} must be an int >= 1")
        if draft_vocab != target_vocab:
            raise ValueError(
                f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}): "
                "a draft must propose target token ids (same tokenizer, or map its ids as EAGLE-3 heads do)"
            )
        controller = speculation if isinstance(speculation, ShapeController) else None
        if controller is not None:  # a running controller, shared with other schedulers (its measurements go on)
            policy = controller.policy
        elif isinstance(speculation, AdaptiveSpeculation):
            policy = speculation
        elif speculation == "adaptive":
            policy = AdaptiveSpeculation()
        elif speculation in ("on", "off"):
            policy = None
        else:
            raise ValueError(f"speculation={speculation!r}: choose 'on', 'off', 'adaptive' or an AdaptiveSpeculation")
        if not isinstance(pipeline, bool):
            raise ValueError(f"pipeline={pipeline!r} must be True or False")
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache={prefix_cache!r} must be True or False")
        if prefix_cache and not kv_prefix_caching(ports):
            raise ValueError(
                "prefix_cache=True needs a KV pool with a prefix cache: build PagedKVPool(..., prefix_cache=True)"
            )
        if prefix_cache and not isinstance(ports.recurrent, NoRecurrentState):
            raise ValueError(
                "prefix_cache=True caches paged attention KV only, and this model keeps recurrent state: "
                "pass prefix_cache=False"
            )
        self.prefix_cache = prefix_cache
        self.eos_token_ids = _token_ids(eos_token_ids, "eos_token_ids")
        self.checked, self.max_batch_size = checked, max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        if admit_fraction is None:  # batched admissions pay under speculation only (SPECULATIVE_ADMIT_FRACTION)
            admit_fraction = 0.0 if speculation == "off" else SPECULATIVE_ADMIT_FRACTION
        self.admit_fraction, self.admit_wait = float(admit_fraction), admit_wait
        self._held = 0  # steps in a row that admission batching held the queue (`_count_held`)
        self.backend = backend if backend is not None else get_backend(target_device(ports))
        off = speculation == "off"
        # with speculation off the draft is `ZeroDraft` (no draft forward at all) and every cycle has shape S == 0
        self.config = no_draft_shape(config) if off else config
        self.ports = attrs.evolve(ports, draft=ZeroDraft(target_vocab)) if off else ports
        if controller is None and policy is not None:
            controller = ShapeController(policy, config, draft_kind(ports))
        if controller is not None:
            _check_shapes(controller.shapes, config, draft_kind(ports))
        self.controller = controller
        self.on_tokens, self.on_finish = on_tokens, on_finish
        self._ids = request_ids if request_ids is not None else itertools.count()
        self.capacity = kv_capacity(ports)  # pages in the whole pool
        self.waiting: deque[Request] = deque()
        self.running: Ready | None = None
        self.finished: dict[int, Request] = {}
        self.stats = SchedulerStats()
        # this step's cycles (shape, batch size, counts, timed, the replay's `CycleTimer` or None), for the controller
        self._cycles: list[tuple] = []
        self._cycle_graphs = 0  # graphs this step's cycle launches captured (`step` counts the others apart)
        # per queued or running request: its arrival order (retraction takes the newest) and tokens streamed
        self._arrival: dict[int, int] = {}
        self._sent: dict[int, int] = {}
        self._order = itertools.count()
        self._admit_one = False
        self._admitted: Ready | None = None  # this step's admitted requests until they join the running batch
        # a graphed cycle left on the GPU by the last step (`_advance`): (Launched, shape, batch size, host seconds)
        self._inflight = None
        self._in_cycle = False  # admitting while the running batch's cycle is on the GPU
        self.pipeline = pipeline
        self._shape: SpecConfig | None = None  # this step's cycle's shape, once chosen
        self._prefilled = False  # this step prefilled (its cycles are not timed for the controller)
        self._holding = False  # this step's admission was held by `admit_fraction` (`_admission_due`)
        self._cut_short = False  # this step's admission stopped before the queue's end: the cap or shared pages
        self._stepping = False  # inside `step`: a `cancel` from a callback waits for the step's end
        self._cancels: dict[int, None] = {}  # ids cancelled during a step, in call order
        self._published: dict[int, int] = {}  # request id -> pages below its L when it last published
        # the graphed executor of the engine's fast EAGLE draft (`engine.fast.fused_cycle`): speculative cycles it
        # covers run as its captured cycle; None, or a batch it does not cover, runs the table eagerly
        self.fused_cycles = fused_cycles if fused_cycles is not None and fused_cycles.draft is ports.draft else None

    @classmethod
    def from_engine(cls, engine, **kwargs) -> Scheduler:
        """A scheduler over an `Engine`'s target, draft, pool, tokenizer and grammar engine (EOS from the model)."""
        draft = engine.draft if engine.draft is not None else ZeroDraft(engine.target.vocab_size)
        ports = Ports(
            target=engine.target, draft=draft, kv_pool=engine.pool, detokenizer=engine.tokenizer, grammar=engine.grammar
        )
        kwargs.setdefault("eos_token_ids", engine.stop_token_ids)
        kwargs.setdefault("backend", engine.backend)
        kwargs.setdefault("request_ids", engine._ids)  # ids stay unique beside Engine.generate
        kwargs.setdefault("fused_cycles", engine.fused_cycles)
        if engine.draft is None:
            kwargs["speculation"] = "off"
        return cls(ports, engine.spec, **kwargs)

    def warm_up(self, batch_sizes: Sequence[int] | None = None, prompt_len: int = 16, sampled: bool = True) -> int:
        """Capture, before serving, the CUDA graphs a run would otherwise capture inside its first steps (tens of
        milliseconds each, paid by the requests of that step; without graphs, the lazy initialization and kernel
        compilation): for every shape this scheduler may run (the adaptive controller's menu, or its config) and
        every batch bucket of ``batch_sizes`` (None: the powers of two up to ``max_batch_size``'s bucket), a batch
        of ``prompt_len``-token requests, admitted in one prefill, runs at least four cycles of the shape, so its
        graphs of both parities (a pipelined cycle reads the other set) exist; a pool too small for a bucket's
        batch warms what fits. With ``sampled`` (and the graphed executor), a batch of sampled requests follows each
        greedy one: a batch with a sampled request runs graphs of its own, and their sampling kernels compile in
        that capture (a lookup draft, n-gram, runs its drafting shapes' sampled batches eagerly: none there).
        On the graphed path a prefill of each row bucket and logits-rows bucket follows (`_warm_prefills`), so an
        admission captures no forward graph either. Returns the cycle graphs captured. Stats, callbacks, the
        controller's measurements and the prefix cache are left as they were, and if a step raises, no warm-up
        request stays behind. Raises `ValueError` on a scheduler with requests."""
        if not self.idle:
            raise ValueError("warm_up needs an idle scheduler: call it before submitting requests")
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len={prompt_len!r} must be an int >= 1")
        if not isinstance(sampled, bool):
            raise ValueError(f"sampled={sampled!r} must be True or False")
        if batch_sizes is None:
            top = batch_bucket(self.max_batch_size)
            batch_sizes = [1 << k for k in range(top.bit_length())]
        try:
            values = list(batch_sizes)
            sizes = [operator.index(b) for b in values if not isinstance(b, bool)]
        except TypeError:
            values, sizes = [None], []
        if not sizes or len(sizes) != len(values) or min(sizes) < 1:
            raise ValueError(f"batch_sizes={batch_sizes!r} must be a non-empty sequence of ints >= 1")
        buckets = sorted({batch_bucket(b) for b in sizes})
        shapes = self.controller.shapes if self.controller is not None else (self.config,)
        vocab = target_vocab_size(self.ports)
        prompt = tuple(1 + i % (vocab - 1) for i in range(prompt_len)) if vocab > 1 else (0,) * prompt_len
        saved = (self.controller, self.config, self.stats, self.prefix_cache, self.on_tokens, self.on_finish,
                 self.max_prefill_tokens, self.admit_fraction)  # fmt: skip
        captures, ids = 0, set()
        try:
            self.controller, self.prefix_cache, self.on_tokens, self.on_finish = None, False, None, None
            self.max_prefill_tokens = None  # each bucket's batch in one prefill, so it runs whole
            self.admit_fraction = 0.0
            for shape in shapes:
                self.config = shape  # every cycle and prefill in this shape
                # no stop ids: every request runs its whole budget, at least four cycles of up to S + 1 tokens
                greedy = SamplingParams(max_new_tokens=3 * shape.accept_width + 2)
                kinds = [greedy]
                # a lookup draft's drafting cycles run sampled batches eagerly (`static_rows.static_covers`): no graph
                forward = draft_kind(self.ports) == "forward" or not shape.drafts
                if sampled and forward and self.fused_cycles is not None:  # seeded: the same draws every time
                    kinds.append(attrs.evolve(greedy, temperature=1.0, top_k=20, top_p=0.95, seed=0))
                for bucket in buckets:
                    for sampling in kinds:
                        captures += self._warm_batch(ids, [prompt] * min(bucket, self.max_batch_size), sampling)
            self.config = saved[1]
            captures += self._warm_prefills(ids, min(self.max_batch_size, buckets[-1]))
        finally:
            if ids:  # a step raised: its requests errored (pages freed); the rest leave the queue too
                self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
                for request_id in ids:
                    self._free(request_id)
                self._forget(ids)
            (self.controller, self.config, self.stats, self.prefix_cache, self.on_tokens, self.on_finish,
             self.max_prefill_tokens, self.admit_fraction) = saved  # fmt: skip
        return captures

    def _warm_prefills(self, ids: set, max_requests: int) -> int:
        """On the graphed path, one prefill of each `graphs.prefill_shapes` ``(rows, requests)`` of up to
        ``max_requests`` requests (of one or a few tokens each, done one token after their prefill): every graph key
        the forwards of such an admission can take (row bucket, logits-rows bucket) is captured before serving, the
        target's and the draft extend's. ``ids`` collects the requests (`warm_up` cleans up after a raise). Returns
        the cycle graphs captured."""
        fused = self.fused_cycles
        if fused is None or not fused.use_graphs:
            return 0
        vocab = target_vocab_size(self.ports)
        once = SamplingParams(max_new_tokens=2)
        captures = 0
        max_rows = row_bucket(fused.options.max_rows) or BUCKETS[-1]  # what `ForwardGraphs` replays at most
        for rows, requests in prefill_shapes(max_rows, min(max_requests, fused.options.max_requests)):
            lengths = [rows // requests + (i < rows % requests) for i in range(requests)]  # ``rows`` tokens in all
            prompts = [
                tuple(1 + (i + j) % (vocab - 1) if vocab > 1 else 0 for j in range(n)) for i, n in enumerate(lengths)
            ]
            captures += self._warm_batch(ids, prompts, once)
        return captures

    def _warm_batch(self, ids: set, prompts, sampling: SamplingParams) -> int:
        """`warm_up`'s unit: ``prompts`` run to the end on fresh stats and leave no trace (``ids`` collects them
        while they run); returns the cycle graphs they captured."""
        self.stats = SchedulerStats()
        for prompt in prompts:
            ids.add(self._enqueue(prompt, sampling))
        self.run()
        self._forget(ids)
        ids.clear()
        return self.stats.captures

    def _forget(self, request_ids) -> None:
        """Drop every trace of requests the caller never saw (`warm_up`'s)."""
        for request_id in request_ids:
            self.finished.pop(request_id, None)
            self._arrival.pop(request_id, None)
            self._sent.pop(request_id, None)
            self._published.pop(request_id, None)

    # ---- queue -------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.waiting and self.num_running == 0

    @property
    def num_running(self) -> int:
        return 0 if self.running is None else len(self.running.requests)

    def submit(self, prompt: Sequence[int] | torch.Tensor, sampling: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises `ValueError` for a prompt that is not token ids."""
        tokens = _prompt_ids(prompt)
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        extra = tuple(t for t in self.eos_token_ids if t not in sampling.stop_token_ids)
        if extra:
            sampling = attrs.evolve(sampling, stop_token_ids=sampling.stop_token_ids + extra)
        return self._enqueue(tokens, sampling)

    def _enqueue(self, tokens: tuple[int, ...], sampling: SamplingParams) -> int:
        """Queue a request under the next id; returns the id."""
        request_id = next(self._ids)
        if request_id in self._arrival or request_id in self.finished:  # a caller's id iterator that repeats
            raise ValueError(f"request id {request_id} is already in use: request ids must be unique")
        self._arrival[request_id] = next(self._order)
        self._sent[request_id] = 0
        self.waiting.append(Request(request_id, tokens, sampling))
        return request_id

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Request]:
        """Submit every prompt, run until all are done, return them in prompt order."""
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.submit(p, s) for p, s in zip(prompts, params)]
        self.run()
        return [self.finished[rid] for rid in ids]

    def cancel(self, request_id: int) -> bool:
        """Give a request up; it finishes with ``finish_reason="cancelled"``, its output so far kept.

        A waiting request leaves the queue; a running one leaves the batch through the table's Ready ``retire``
        row, which frees its pages. Called between steps, or from ``on_finish``, it takes effect at once
        (``on_finish`` sees the request before `cancel` returns); called from ``on_tokens``, during a step, when
        that step ends (a request the step finishes anyway keeps its own finish reason). Returns True if the
        request was waiting or running, False if it had already finished. Raises `ValueError` for an id this
        scheduler never issued. Like `submit`, call it from the thread that steps the scheduler (or from its
        callbacks): the scheduler takes no lock."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise ValueError(f"request_id must be an int returned by submit, got {request_id!r}")
        if request_id in self.finished:
            return False
        if request_id not in self._arrival:
            raise ValueError(f"request {request_id} was never submitted to this scheduler: pass an id submit returned")
        if self._stepping:
            self._cancels[request_id] = None
            return True
        finished: list[Request] = []
        self._cancels[request_id] = None
        try:
            self._apply_cancels(finished)
        finally:
            for request in finished:
                self._finish(request)
        return True

    def run(self) -> list[Request]:
        """Step until no request is waiting or running; returns the requests finished meanwhile."""
        done = []
        while not self.idle:
            done += self.step()
        return done

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Make room, run one cycle, admit, retire. Returns the requests that finished in this step.

        Overlap: when the graphed executor covers the running batch, its cycle is launched first and the host
        admits the waiting requests (validation, records, the prefill's launches) while the GPU runs it; the
        cycle's commits are collected after, and the admitted requests join the batch for the next cycle. A cycle
        the table runs eagerly comes after the admission, over the joined batch. Checked mode collects (and checks)
        the cycle before it admits: the checks read the cycle's buffers, which the prefill's forwards reuse."""
        start = time.perf_counter()
        finished: list[Request] = []
        in_flight: list[Request] = []
        pool = self.fused_cycles.graph_pool if self.fused_cycles is not None else None
        graphs, self._cycle_graphs = (pool.num_graphs if pool is not None else 0), 0
        self._stepping = True
        try:
            self._shape = None
            self._prefilled = False
            self._holding = self._cut_short = False
            if self._inflight is not None:  # last step left its cycle on the GPU: go on from the device's state
                self._advance(finished)
            if self._inflight is None:
                self._apply_cancels(finished)
                launched = self._launch(finished)  # a captured cycle on the GPU while the host admits
                cycled = launched is not None  # () too: the pool refused its pages, no cycle this step
                if launched and self.checked:  # the checks read buffers an admission's forwards reuse: no overlap
                    self._collect(launched, finished)
                    launched = ()
                admitted = False
                self._in_cycle = bool(launched)
                try:
                    admitted = self._admit(finished, in_flight)
                finally:
                    self._in_cycle = False
                    if launched and not (self._pipelines(launched) and not admitted and not self._admission_due()):
                        self._collect(launched, finished)
                    elif launched:  # nothing to join: leave it running, the next step goes on from it
                        self._inflight = launched
                self._join()
                self._publish()
                if not cycled and self.num_running:
                    self._cycle(finished)
                    self._publish()
            if self._cancels and self._inflight is not None:  # cancelled from this step's callbacks: settle first
                self._drain(finished)
            self._apply_cancels(finished)  # those called from this step's callbacks
            self._count_held()
        except BaseException as error:
            self._abort(error, finished, in_flight)
            raise
        finally:
            self._stepping = False
            for request in finished:
                self._finish(request)
            self.stats.steps += 1
            graphs = pool.num_graphs - graphs if pool is not None else 0  # captured in this step
            self.stats.forward_captures += graphs - self._cycle_graphs  # all of them but its cycles'
            seconds = time.perf_counter() - start
            self.stats.seconds += seconds
            if self.controller is not None:
                # A cycle's cost is its step's: with the admission under the cycle and the cycles pipelined, the
                # host's and the GPU's work overlap. A captured replay tells the GPU's time apart (its events) and
                # the host's (the step less its waits for commits): the step takes the longer of the two
                # (`ShapeController.record`). A step that prefilled, or captured a graph, gives no host time: its
                # prefill costs the same whatever the shape, and at a high load it would be most of the time the
                # controller compares (its replays' device times still count). An eager cycle's cost is its
                # step's wall time, which a step that prefilled gives only to a shape not timed yet at its bucket
                # (a load where every step prefills still measures each shape once).
                waited = sum(timer.waited for *_, timer in self._cycles if timer is not None)
                share = seconds / max(len(self._cycles), 1)
                host = max(seconds - waited, 0.0) / max(len(self._cycles), 1)
                for shape, batch_size, counts, timed, timer in self._cycles:
                    gpu = timer.gpu_seconds if timer is not None else None
                    if gpu is None:
                        timed = timed and (not self._prefilled or not self.controller.timed(shape, batch_size))
                    else:
                        timed = timed and not self._prefilled and not graphs
                    cost = share if gpu is None else host
                    self.controller.record(shape, batch_size, cost, counts, timed, gpu_seconds=gpu)
            self._cycles.clear()
        return finished

    def _admit(self, finished: list[Request], in_flight: list[Request]) -> bool:
        """Prefill the waiting requests that fit (they join the batch at `_join`); whether any was prefilled."""
        if not self._admission_due():
            return False
        reserve = self._reserve_len()
        if self._in_cycle and self.running is not None:  # L is one cycle behind: that cycle commits up to its width
            reserve += self.running.config.accept_width
        budget = self.ports.kv_pool.num_free_pages - self._growth(self.running, reserve)
        batch: list[Request] = []
        prefill_tokens = 0
        while self.waiting and self.num_running + len(batch) < self.max_batch_size:
            if batch and self._admit_one:
                break
            request = self.waiting[0]
            if batch and self.max_prefill_tokens and prefill_tokens + len(request.tokens) > self.max_prefill_tokens:
                self._cut_short = True
                break  # the rest waits for the next step's prefill
            if batch and self.prefix_cache and self._shares_uncached_pages(request, batch):
                self._cut_short = True
                break  # next step it reads those pages from the cache instead of computing them again
            need = self._pages(len(request.tokens) + reserve)
            if need > self.capacity:
                self.waiting.popleft()
                what = "its prompt" if not request.output else "its prompt and output so far"
                finished.append(
                    self._error(
                        request,
                        f"{what} ({len(request.tokens)} tokens) and one cycle's reservation ({reserve}) need "
                        f"{need} KV pages and the pool has {self.capacity} in all: shorten the prompt, lower "
                        "max_new_tokens or build the pool with more pages",
                    )
                )
                self.stats.refused += 1
                continue
            if need > budget:
                if not batch and self.num_running == 0:  # nothing of ours will free pages: held elsewhere
                    self.waiting.popleft()
                    finished.append(
                        self._error(
                            request,
                            f"needs {need} free KV pages and the pool has {self.ports.kv_pool.num_free_pages} "
                            "free with no request of this scheduler running: pages are held outside it",
                        )
                    )
                    continue
                break
            budget -= need
            prefill_tokens += len(request.tokens)
            batch.append(self.waiting.popleft())
        if not batch:
            return False
        in_flight += batch
        self.stats.prefills += 1
        start = time.perf_counter()
        try:
            # a prefix cache hit: the pool lends each request the pages of its longest cached prefix first
            pool = self.ports.kv_pool
            cached = tuple(pool.attach_prefix(r.request_id, r.tokens) for r in batch) if self.prefix_cache else ()
            admitted = Admitted(config=self.config, requests=tuple(batch), cached=cached)
            record = run_step(admitted, self.ports, self.backend, checked=self.checked)
        except KVPoolExhausted:  # the pool counted otherwise (shared with another user?): defer the batch
            for request in batch:
                self._free(request.request_id)
            in_flight.clear()
            if self.num_running == 0 and len(batch) == 1:
                finished.append(self._error(batch[0], "the KV pool refused its prompt's pages with nothing running"))
            else:
                self.waiting.extendleft(reversed(batch))
                self._admit_one = True  # retry one request at a time until a prefill fits
            return False
        self._admit_one = False
        self._prefilled = True
        self.stats.prefill_tokens += sum(len(r.tokens) for r in batch)
        self.stats.cached_tokens += sum(cached)
        self._stream(record.requests)
        self._admitted = self._to_ready(record, finished)  # joins the running batch after its cycle (`_join`)
        in_flight.clear()
        self.stats.prefill_seconds += time.perf_counter() - start
        return True

    def _admission_due(self) -> bool:
        """Whether a waiting request would be admitted now: the batch has a free place and admission batching
        (``admit_fraction``) does not hold the queue. It holds it while requests run, an admission would take fewer
        than the fraction of the running batch (fewer wait, or fewer places are free), and the queue has not waited
        ``admit_wait`` steps."""
        running = self.num_running
        if not self.waiting or running >= self.max_batch_size:
            return False
        if not self.admit_fraction or running == 0 or self._held >= self.admit_wait:
            return True
        admissible = min(len(self.waiting), self.max_batch_size - running)  # what an admission would take now
        due = admissible >= math.ceil(self.admit_fraction * running)
        self._holding = self._holding or not due
        return due

    def _count_held(self) -> None:
        """After a step: the steps in a row that `admit_fraction` held the queue (`_held`). A full batch, or a pool
        short of pages, holds nothing here (the next free place or page starts a new count). An admission cut short
        (``max_prefill_tokens``, pages a request would share with the step's prefill) leaves the rest due: they
        are admitted at the next step, as without batching."""
        if self._holding and not self._prefilled:
            self._held += 1
            self.stats.held_admissions += 1
        elif self._prefilled and self._cut_short and self.waiting:
            self._held = self.admit_wait
        else:
            self._held = 0

    def _join(self) -> None:
        """The requests this step admitted join the running batch (in its shape: it may be another of the family)."""
        ready, self._admitted = self._admitted, None
        if ready is None:
            return
        if self.running is not None and self.running.requests:
            ready = reshape(ready, self.running.config)
            self.running = merge_ready(self.running, ready)
        else:
            self.running = ready

    def _shares_uncached_pages(self, request: Request, batch: Sequence[Request]) -> bool:
        """Whether ``request`` starts with full pages that a request of this step's prefill will compute and the
        prefix cache does not hold yet (page keys as the cache's: a page's tokens and the next one)."""
        pool = self.ports.kv_pool
        P, tokens = pool.page_size, request.tokens
        cached = pool.cached_pages(tokens)
        key = (cached + 1) * P + 1  # the tokens keying one page past the cached ones
        return len(tokens) >= key and any(other.tokens[:key] == tokens[:key] for other in batch)

    def _publish(self) -> None:
        """Put the running requests' new full pages of committed tokens into the prefix cache.

        At a `Ready` boundary every cache holds final KV for positions ``[0, L)`` (the target's committed
        tokens; the draft extend has run over them), and no later row of the request writes below ``L``: the
        pages wholly below ``L`` can be shared. Speculative slots (verify rows, draft scratch) lie at ``L`` and
        past, in pages the request keeps to itself.
        """
        if not self.prefix_cache or not self.num_running:
            return
        pool = self.ports.kv_pool
        for request in self.running.requests:
            L = len(request.tokens) - 1  # invariant 8, on the host: no wait for a cycle in flight
            if L // pool.page_size > self._published.get(request.request_id, 0):
                self.stats.published_pages += pool.publish(request.request_id, request.tokens, L)
                self._published[request.request_id] = L // pool.page_size

    def _prepare(self, finished: list[Request]) -> SpecConfig:
        """The running batch in the shape of its next cycle, with room for the cycle's reservation (retracting the
        newest requests if the pool is short)."""
        if self._shape is None:  # once a step: `_launch` may have chosen it before the admission
            self._shape = self.controller.choose(self.num_running) if self.controller else self.config
        shape = self._shape
        self._reshape(shape)
        self._make_room(self._reserve_len(), finished)
        return shape

    def _launch(self, finished: list[Request]):
        """Put the running batch's next cycle on the GPU when the graphed executor covers it (`FusedCycles.launch`),
        before this step's admission: the host prepares the next requests while the GPU runs the cycle, and they
        join the batch after it (`_join`). None: nothing runs, or the cycle runs after the admission (eagerly); an
        empty tuple: the pool refused the cycle's pages, the newest request was retracted and no cycle runs."""
        fused = self.fused_cycles
        if fused is None or not self.num_running:
            return None
        shape = self._prepare(finished)
        if not self.num_running or not fused.covers(self.running, self.ports):
            return None
        return self._launch_fused(shape, finished)

    def _launch_fused(self, shape: SpecConfig, finished: list[Request]):
        start = time.perf_counter()
        try:
            launched = self.fused_cycles.launch(self.running, ports=self.ports, timed=self.controller is not None)
        except KVPoolExhausted:  # the pool counted otherwise (shared with another user?): nothing was reserved
            self._retract_newest(self._reserve_len(), finished)
            return ()  # no cycle this step
        self._cycle_graphs += launched.captured
        return launched, shape, self.num_running, time.perf_counter() - start

    # ---- pipelined cycles -------------------------------------------------------------------------
    def _pipelines(self, launched) -> bool:
        """Whether a launched cycle may stay on the GPU past its step, the next step launching the batch's next
        cycle from the device's state before collecting it (`FusedCycles.launch_next`): not in checked mode (a
        check reads the records' tensors, which a later cycle overwrites) and while its log has room."""
        return self.pipeline and not self.checked and self.fused_cycles.can_continue(launched[0])

    def _advance(self, finished: list[Request]) -> None:
        """The step of a batch whose cycle ``n`` is in flight: when no admission is due (no request waits, the batch
        is full: a request that finishes in cycle ``n`` makes room at the next step, or admission batching holds the
        queue: `_admission_due`), no cancel is pending,
        the shape stays and the pool grants the pages, cycle ``n + 1`` is launched from the device's state first,
        then cycle ``n`` is collected while the GPU runs it (the host's records, streaming and retiring overlap the
        GPU). Otherwise cycle ``n`` is collected and the step goes on as an ordinary one (reload, admission)."""
        launched, shape, batch_size, _ = self._inflight
        nxt = None
        if not self._admission_due() and not self._cancels and self._pipelines(self._inflight):
            self._shape = self.controller.choose(self.num_running) if self.controller else self.config  # once a step
            if self._shape == shape:
                start = time.perf_counter()
                try:
                    nxt = self.fused_cycles.launch_next(launched, self.running.requests)
                except KVPoolExhausted:  # short of pages: collect, then the ordinary step makes room
                    nxt = None
                else:
                    self._cycle_graphs += nxt.captured
                    nxt = (nxt, shape, self.num_running, time.perf_counter() - start)
        self._drain(finished)
        if nxt is not None and self.num_running:
            self._inflight = nxt
            self.stats.pipelined_cycles += 1
        # else: every request finished in cycle n (the one launched behind it commits nothing), or it never ran

    def _drain(self, finished: list[Request]) -> None:
        """Collect the cycle in flight."""
        launched, self._inflight = self._inflight, None
        self._collect(launched, finished)
        self._publish()

    def _collect(self, launched, finished: list[Request]) -> None:
        """A launched cycle's commits: stream them; the requests that finished leave through the table's Ready
        ``retire`` row. The record the executor reads back holds every request loaded with the batch; those the
        host retired after an earlier cycle of it (pipelined) are left out."""
        launched, shape, batch_size, seconds = launched
        start = time.perf_counter()
        ready, _ = self.fused_cycles.collect(launched, checked=self.checked)
        had = {r.request_id: len(r.output) for r in self.running.requests}
        if len(had) < len(ready.requests):
            ready = select_ready(ready, [i for i, r in enumerate(ready.requests) if r.request_id in had])
        counts = [len(r.output) - had[r.request_id] for r in ready.requests]
        self._stream(ready.requests)
        if any(r.finish_reason is not None for r in ready.requests):
            ready = self._retire(ready, finished)
        self.running = ready
        self.stats.fused_cycles += 1
        self.stats.captures += launched.captured
        seconds += time.perf_counter() - start  # the cycle's own host time and wait, not the admission's between
        timer = None if launched.captured else launched.timer  # a capture's step is no cycle's cost
        self._record(shape, batch_size, seconds, counts, timed=not launched.captured, timer=timer)

    def _cycle(self, finished: list[Request]) -> None:
        """The running batch's cycle after the admission: launched and collected at once when the graphed executor
        covers it (the step's admission came first: the batch had nothing running), else the table eagerly."""
        shape = self._prepare(finished)
        if not self.num_running:
            return
        fused = self.fused_cycles
        if fused is not None and fused.covers(self.running, self.ports):
            launched = self._launch_fused(shape, finished)
            if launched:
                self._collect(launched, finished)
            return
        batch_size = self.num_running
        start = time.perf_counter()
        try:
            record = run_step(self.running, self.ports, self.backend, event="draft", checked=self.checked)
        except KVPoolExhausted:  # the pool counted otherwise (shared with another user?): nothing was reserved
            self._retract_newest(self._reserve_len(), finished)
            return
        verified = run_step(record, self.ports, self.backend, checked=self.checked)
        assert isinstance(verified, Verified)
        accepted = run_step(verified, self.ports, self.backend, checked=self.checked)
        compacted = run_step(accepted, self.ports, self.backend, checked=self.checked)
        self._stream(compacted.requests)
        had = {r.request_id: len(r.output) for r in self.running.requests}
        self.running = self._to_ready(compacted, finished)
        # what each request committed (the accepted run cut at its stops and budget), as the graphed executor counts
        counts = [len(r.output) - had[r.request_id] for r in compacted.requests if r.finish_reason != "error"]
        self._record(shape, batch_size, time.perf_counter() - start, counts)

    def _reshape(self, shape: SpecConfig) -> None:
        """The running batch in ``shape`` for its next cycle; the pages a deeper shape reserved past a shallower
        one's go back to the pool (`batching.reshape`). A batch whose top-K a cycle of ``S == 0`` deferred takes the
        table's ``first_level`` row when ``shape`` drafts."""
        self.running = reshape(self.running, shape, self.ports.kv_pool, draft_pairing(self.ports))
        if first_level_due(self.running, self.ports):
            self.running = run_step(self.running, self.ports, self.backend, event="first_level", checked=self.checked)
            self.stats.first_levels += 1

    def _record(
        self,
        shape: SpecConfig,
        batch_size: int,
        seconds: float,
        counts: Sequence[int],
        timed: bool = True,
        timer=None,
    ) -> None:
        """A cycle's statistics, and its cost and committed tokens to the adaptive controller."""
        if shape.drafts:
            self.stats.spec_cycles += 1
            self.stats.verifies += len(counts)
            self.stats.accepted += sum(counts)
        else:
            self.stats.plain_cycles += 1
        self.stats.shapes[shape] = self.stats.shapes.get(shape, 0) + 1
        self.stats.cycle_seconds += seconds
        self._cycles.append((shape, batch_size, counts, timed, timer))  # to the controller at the step's end

    def _to_ready(self, record, finished: list[Request]) -> Ready:
        """Step a `Compacted` record through retire and extend to `Ready`, collecting retired requests."""
        assert isinstance(record, Compacted)
        while not isinstance(record, Ready):  # retire (if any finished), then extend
            record = run_step(record, self.ports, self.backend, checked=self.checked)
        finished += record.retired  # extend carries the retire's requests over
        return attrs.evolve(record, retired=())

    def _retire(self, ready: Ready, finished: list[Request]) -> Ready:
        """``ready`` through the table's Ready ``retire`` row: its finished requests leave (their pages freed) into
        ``finished``; returns the batch of the others."""
        ready = run_step(ready, self.ports, self.backend, event="retire", checked=self.checked)
        finished += ready.retired
        return attrs.evolve(ready, retired=())

    def _apply_cancels(self, finished: list[Request]) -> None:
        """Finish the requests cancelled since the last boundary: waiting ones leave the queue, running ones leave
        the batch through the table's Ready ``retire`` row (it frees their pages)."""
        if not self._cancels:
            return
        ids, done = set(self._cancels), {r.request_id for r in finished}
        self._cancels.clear()
        ids -= done | set(self.finished)  # finished meanwhile: their own finish reason stands
        if not ids:
            return
        for request in [r for r in self.waiting if r.request_id in ids]:
            self.waiting.remove(request)
            self._free(request.request_id)  # a retracted request holds nothing; nothing else should either
            finished.append(attrs.evolve(request, finish_reason="cancelled"))
        ready = self.running
        if ready is None or not any(r.request_id in ids for r in ready.requests):
            return
        marked = tuple(
            attrs.evolve(r, finish_reason="cancelled") if r.request_id in ids and r.finish_reason is None else r
            for r in ready.requests
        )
        self.running = self._retire(attrs.evolve(ready, requests=marked), finished)

    # ---- KV pressure -------------------------------------------------------------------------
    def _make_room(self, reserve: int, finished: list[Request]) -> None:
        """Retract the newest running requests until the next cycle's reservation fits."""
        while self.num_running and self._growth(self.running, reserve) > self.ports.kv_pool.num_free_pages:
            self._retract_newest(reserve, finished)

    def _retract_newest(self, reserve: int, finished: list[Request]) -> None:
        """Retract the running request that arrived last; alone, it cannot run: it finishes with an error."""
        requests, pool = self.running.requests, self.ports.kv_pool
        if len(requests) == 1:
            request, L = requests[0], int(self.running.seq_lens[0])
            message = (
                f"its next cycle needs {self._pages(L + reserve)} KV pages ({L} tokens committed, {reserve} "
                f"reserved) and the pool has {self.capacity} in all, {pool.num_free_pages} of them free: lower "
                "max_new_tokens or build the pool with more pages"
            )
            self._published.pop(request.request_id, None)
            self.running = self._retire(attrs.evolve(self.running, requests=(self._error(request, message),)), finished)
            return
        victim = max(requests, key=lambda r: self._arrival[r.request_id])
        self._published.pop(victim.request_id, None)
        marked = attrs.evolve(self.running, retract=(victim.request_id,))
        ready = run_step(marked, self.ports, self.backend, event="retract", checked=self.checked)  # frees its pages
        self.running = attrs.evolve(ready, retired=())
        self.waiting.appendleft(victim)  # committed output kept: readmission recomputes its KV
        self.stats.retractions += 1

    def _growth(self, ready: Ready | None, reserve: int) -> int:
        """Pages the batch must add to reserve ``[0, L + reserve)`` for every request."""
        if ready is None or not ready.requests:
            return 0
        pool = self.ports.kv_pool
        return sum(  # L = len(tokens) - 1 (invariant 8), on the host: no wait for a cycle in flight
            max(0, self._pages(len(r.tokens) - 1 + reserve) - pool.pages_held(r.request_id)) for r in ready.requests
        )

    def _reserve_len(self) -> int:
        """Positions past ``L`` a request holds in a cycle: of the deepest shape the scheduler may run."""
        shape = self.controller.reserve_shape if self.controller else self.config
        return shape.reserve_len(draft_pairing(self.ports))

    def _pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.ports.kv_pool.page_size)

    def _free(self, request_id: int) -> None:
        self._published.pop(request_id, None)
        if self.ports.kv_pool.pages_held(request_id) or kv_knows(self.ports, request_id):
            self.ports.kv_pool.free(request_id)
        self.ports.recurrent.free(request_id=request_id)

    # ---- results -----------------------------------------------------------------------------
    def _stream(self, requests: Sequence[Request]) -> None:
        for request in requests:
            sent = self._sent.get(request.request_id, 0)
            if len(request.output) > sent:
                new = list(request.output[sent:])
                self._sent[request.request_id] = len(request.output)
                self.stats.committed += len(new)
                if self.on_tokens is not None:
                    self.on_tokens(request.request_id, new)

    def _finish(self, request: Request) -> None:
        if request.request_id in self.finished:
            raise AssertionError(f"request {request.request_id} finished twice")  # a scheduler bug
        self._stream([request])
        self._published.pop(request.request_id, None)
        self._arrival.pop(request.request_id, None)  # a long-running scheduler keeps nothing of it but the result
        self._sent.pop(request.request_id, None)
        self.finished[request.request_id] = request
        if request.finish_reason == "error":
            self.stats.errors += 1
        elif request.finish_reason == "cancelled":
            self.stats.cancelled += 1
        if self.on_finish is not None:
            self.on_finish(request)

    def _error(self, request: Request, message: str) -> Request:
        return attrs.evolve(request, finish_reason="error", error=f"request {request.request_id}: {message}")

    def _abort(self, error: BaseException, finished: list[Request], in_flight: list[Request]) -> None:
        """A cycle raised: every request in it finishes with the error and its pages are freed."""
        done = {r.request_id for r in finished}
        running = list(self.running.requests) if self.running is not None else []
        if self._admitted is not None:  # admitted this step, not joined yet
            running += list(self._admitted.requests)
            self._admitted = None
        self._inflight = None  # its requests are the running ones: they error below
        for request in running + in_flight:
            if request.request_id in done:
                continue
            try:
                self._free(request.request_id)
            except Exception:  # a row that raised after freeing it (a check that failed): the error that stands is
                pass  # the one being handled, and the other requests still finish with it
            finished.append(self._error(request, f"the cycle failed: {type(error).__name__}: {error}"))
            done.add(request.request_id)
        self.running = None


def _check_shapes(shapes, config: SpecConfig, kind: str) -> None:
    """Adaptive speculation's shapes must be of ``config``'s family: its ``K`` and page size (the draft state's
    width, the pool's pages); a block draft proposes its whole block, so its only shape is ``config``."""
    for shape in shapes:
        if shape.topk != config.topk or shape.page_size != config.page_size:
            raise ValueError(
                f"adaptive speculation's shape {shape} is not of the config's family: keep its topk (K)={config.topk} "
                f"and page_size (P)={config.page_size}"
            )
        if kind == "block" and shape != config:
            raise ValueError(f"a block draft proposes its whole block: its only shape is the config, got {shape}")


def _token_ids(values, what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of int token ids, got a string {values!r}")
    try:
        return tuple(_index(v, what) for v in values)
    except TypeError as error:
        raise ValueError(f"{what} must be a sequence of int token ids, got {type(values).__name__}") from error


def _index(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must hold int token ids, got {value!r}")
    try:
        return operator.index(value)
    except TypeError as error:
        raise ValueError(f"{what} must hold int token ids, got {value!r} ({type(value).__name__})") from error


def _prompt_ids(prompt) -> tuple[int, ...]:
    """A prompt as a tuple of ints: a sequence of ints or a 1-D integer tensor (range is checked at prefill)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(
                f"a prompt tensor must be 1-D of integer ids, got {prompt.dtype} of shape {tuple(prompt.shape)}"
            )
        return tuple(int(t) for t in prompt.tolist())
    return _token_ids(prompt, "the prompt")
