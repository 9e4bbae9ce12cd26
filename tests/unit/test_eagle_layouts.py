"""Published EAGLE-3 head layouts (`engine/drafters/eagle_layouts.py`, `speccycle convert-draft`).

Checked: the shipped SmolLM2 head written in each published layout (eagle3: EAGLE/SpecForge/SGLang;
speculators: vLLM) loads back to the same weights and drafts the same tokens with the same logits, chain and
tree, in float32; heads written here key by key from the published names (SpecForge/SGLang safetensors with
aux-layer ids, the EAGLE repository's torch file without them, speculators with ``norm_before_fc`` and a
second layer, EAGLE-3.1 with ``fc_norm`` and two ``midlayer.{i}``) load to the weights they were made from and
run lossless on SmolLM2; each layout's aux-layer ids map to the residual streams the library's feature layers
index, and that index is the stream entering a layer; the feature norms compute their formula (and the trainable
head runs them as the draft does); deeper heads with feature norms round-trip through both layouts; a missing key,
a wrong shape, a head for another target (hidden size, vocabulary), an EAGLE-1 file and a config without its
aux layers each give one line naming the key, from the library and from the command, as do bad convert-draft
arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import save_file
from speccycle.cli import main
from speccycle.core import Admitted, Ports, Request, SpecConfig
from speccycle.engine.drafters import eagle_heads
from speccycle.engine.drafters.eagle import EagleConfig, EagleDraft, EagleHead, check_target
from speccycle.engine.drafters.eagle_layouts import HeadPath, head_path_for, read_published, write_layout
from speccycle.engine.engine import Engine
from speccycle.engine.errors import ModelLoadError
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.statemachine import run_cycle

NEW_TOKENS = 12
CHAIN = SpecConfig(num_steps=3, topk=1, page_size=16)
TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=16)
TINY = LlamaConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=2048,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


# ---- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    path = eagle_heads.shipped_eagle_head("SmolLM2-135M-Instruct.Q4_1.gguf")
    if path is None:
        pytest.skip("no EAGLE head shipped for SmolLM2")
    return path, EagleHead.load(path)  # float32


@pytest.fixture(scope="module")
def smollm2(model_path, shipped):
    """SmolLM2 (float32) returning the shipped head's features, shared by the engines; one chat prompt."""
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import load_gguf

    config, weights = load_gguf(model_path, dtype=torch.float32)
    model = LlamaModel(config, weights, feature_layers=shipped[1].config.feature_layers)
    prompt = Tokenizer.from_gguf(model_path).apply_chat_template(
        [{"role": "user", "content": "Name the planets of the solar system in order."}]
    )
    return config, model, [prompt]


@pytest.fixture(scope="module")
def autoregressive(smollm2):
    _, model, prompts = smollm2
    engine = Engine(model, PagedKVPool(num_pages=256, page_size=16), None, CHAIN)
    return engine.generate_autoregressive(prompts, NEW_TOKENS)


class RecordingDraft(EagleDraft):
    """The EAGLE draft, keeping the logits of every forward it runs (extends and tree levels)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: list[torch.Tensor] = []

    def _run(self, batch, x):
        out = super()._run(batch, x)
        self.logits.append(out.logits.clone())
        return out


def run_head(smollm2, head: EagleHead, spec: SpecConfig) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy speculative output of the prompts with ``head``, and every draft forward's logits."""
    _, model, prompts = smollm2
    pool = PagedKVPool(num_pages=256, page_size=spec.page_size)
    engine = Engine(model, pool, lambda e: RecordingDraft(head, e.model, e.pool), spec)
    results, stats = engine.generate(prompts, NEW_TOKENS)
    assert stats.verifies > 0
    return [list(r.output) for r in results], engine.draft.logits


# ---- published files, key by key -------------------------------------------------------------------------
def llama_fields(c: EagleConfig, vocab: int, head_dim: bool = True) -> dict:
    """A draft layer's Llama config fields, as the published configs write them."""
    out = {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "num_hidden_layers": c.num_layers,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": float(c.rope_theta),
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    if head_dim:
        out["head_dim"] = c.head_dim
    return out


def first_layer(state: dict, prefix: str) -> dict:
    """EAGLE-3's first layer (over ``[embedding, features]``) under ``prefix``, from `EagleHead.state` tensors."""
    out = {f"{prefix}self_attn.{p}_proj.weight": state[f"layer.{p}_proj.weight"] for p in "qkvo"}
    out.update({f"{prefix}mlp.{p}_proj.weight": state[f"layer.{p}_proj.weight"] for p in ("gate", "up", "down")})
    out[f"{prefix}input_layernorm.weight"] = state["layer.embed_norm.weight"]  # the embedding's norm
    out[f"{prefix}hidden_norm.weight"] = state["layer.hidden_norm.weight"]
    out[f"{prefix}post_attention_layernorm.weight"] = state["layer.post_attention_layernorm.weight"]
    return out


def deeper_layer(prefix: str, c: EagleConfig, input_norm: str, seed: int) -> dict:
    """A random plain Llama layer of ``c``'s shapes under ``prefix`` (published names), small enough to keep
    the draft close to the one-layer head's."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv, i = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    shapes = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    out = {prefix + k: torch.randn(s, generator=gen) * 0.01 for k, s in shapes.items()}
    out[prefix + input_norm + ".weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    return out


def vocab_maps(state: dict, vocab: int) -> dict:
    """``d2t`` (int64 offsets: target id = draft id + d2t[draft id]) and ``t2d`` (bool over the target's ids)."""
    ids = state["draft_to_target"].long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def eagle3_by_hand(folder: Path, head: EagleHead, vocab: int, aux_ids: list[int] | None = None) -> dict:
    """SpecForge / SGLang: ``midlayer.*``, ``LlamaForCausalLMEagle3``, aux ids in ``eagle_config``; the tensors
    are returned (and written to ``folder/model.safetensors``)."""
    state, c = head.state(), head.config
    tensors = {"fc.weight": state["fc.weight"], **first_layer(state, "midlayer.")}
    tensors.update({"norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]})
    tensors.update(vocab_maps(state, vocab))
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(c, vocab)}
    config["draft_vocab_size"] = c.draft_vocab_size
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


# ---- round trips -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_the_shipped_head_exported_and_loaded_back_drafts_the_same(tmp_path, shipped, smollm2, layout):
    config, _, _ = smollm2
    _, head = shipped
    folder = write_layout(head, tmp_path / layout, layout, config, "SmolLM2-135M-Instruct")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    back = EagleHead.load(folder)
    assert back.config == attrs.evolve(head.config, target_vocab_size=config.vocab_size)
    state, back_state = head.state(), back.state()
    assert state.keys() == back_state.keys()
    for name, value in state.items():
        assert torch.equal(back_state[name], value), name
    for spec in (CHAIN, TREE):
        tokens, logits = run_head(smollm2, head, spec)
        back_tokens, back_logits = run_head(smollm2, back, spec)
        assert back_tokens == tokens
        assert len(back_logits) == len(logits)  # the same forwards: extends and tree levels
        for ours, theirs in zip(logits, back_logits):
            assert torch.equal(ours, theirs)  # the same logits, so the same draft tokens and probabilities


def test_convert_draft_round_trips_through_the_command(tmp_path, shipped, capsys):
    path, head = shipped
    out = tmp_path / "sglang"
    assert main(["convert-draft", str(path), str(out), "--export", "eagle3"]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # layer outputs: (2, 15, 27) - 1
    assert main(["convert-draft", str(out), str(tmp_path / "vllm"), "--export", "speculators"]) == 0
    raw = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert raw["norm_before_residual"] is False and raw["speculators_config"]["verifier"]["name_or_path"]
    assert main(["convert-draft", str(tmp_path / "vllm"), str(tmp_path / "back.safetensors")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(speccycle) -> " in lines[0] and "(eagle3) -> " in lines[1] and "(speculators) -> " in lines[2]
    back = EagleHead.load(tmp_path / "back.safetensors")
    assert back.config == attrs.evolve(head.config, target_vocab_size=49152)
    for name, value in head.state().items():
        assert torch.equal(back.state()[name], value), name


# ---- heads written key by key ---------------------------------------------------------------------------
def test_an_sglang_head_built_key_by_key_loads_as_the_weights_it_holds_and_runs_lossless(
    tmp_path, shipped, smollm2, autoregressive
):
    config, _, _ = smollm2
    _, head = shipped
    eagle3_by_hand(tmp_path / "sglang", head, config.vocab_size, aux_ids=[1, 14, 26])
    loaded = EagleHead.load(tmp_path / "sglang")
    assert loaded.config.feature_layers == (2, 15, 27)  # SpecForge's layer outputs [1, N/2-1, N-4], + 1
    for name, value in head.state().items():
        assert torch.equal(loaded.state()[name], value), name
    for spec in (CHAIN, TREE):
        assert run_head(smollm2, loaded, spec)[0] == autoregressive


def test_the_eagle_repositorys_torch_file_without_aux_ids_runs_lossless_for_the_target_it_is_loaded_for(
    tmp_path, shipped, smollm2, autoregressive
):
    """The EAGLE repository's layout: ``pytorch_model.bin``, ``LlamaForCausalLM`` with ``draft_vocab_size``, no
    ``head_dim`` and no aux ids: the head reads the reference's (2, N/2, N-3) of the target it is loaded for."""
    config, _, _ = smollm2
    _, head = shipped
    folder = tmp_path / "eagle"
    tensors = eagle3_by_hand(folder, head, config.vocab_size)
    (folder / "model.safetensors").unlink()
    torch.save({k: v.clone() for k, v in tensors.items()}, folder / "pytorch_model.bin")
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["LlamaForCausalLM"]
    del raw["head_dim"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="eagle_aux_hidden_state_layer_ids") as refused:
        EagleHead.load(folder)
    assert "\n" not in str(refused.value)
    assert EagleHead.load(folder, target_layers=30).config.feature_layers == (2, 15, 27)
    with_layers = head_path_for(folder, None)  # what --eagle-head passes: the embedded SmolLM2's 30 layers
    assert isinstance(with_layers, HeadPath) and with_layers.target_layers == config.num_layers
    assert head_path_for(tmp_path / "nothing-here", None) == tmp_path / "nothing-here"
    loaded = EagleHead.load(with_layers)  # as Engine.load loads the head it is given
    assert loaded.config.feature_layers == (2, 15, 27)
    for name, value in head.state().items():
        assert torch.equal(loaded.state()[name], value), name
    assert run_head(smollm2, loaded, TREE)[0] == autoregressive


def test_a_speculators_head_with_norm_before_fc_and_two_layers_runs_lossless(
    tmp_path, shipped, smollm2, autoregressive
):
    config, _, _ = smollm2
    _, head = shipped
    state, c = head.state(), attrs.evolve(head.config, num_layers=2)
    gen = torch.Generator().manual_seed(5)
    tensors = {"fc.weight": state["fc.weight"], **first_layer(state, "layers.0.")}
    tensors.update(deeper_layer("layers.1.", c, "input_layernorm", seed=6))
    tensors["input_norm.weight"] = 1 + 0.05 * torch.randn(3 * c.hidden_size, generator=gen)
    tensors.update({"norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]})
    tensors.update(vocab_maps(state, config.vocab_size))
    raw = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": 8192,
        "norm_before_residual": False,
        "norm_before_fc": True,
        "eagle_aux_hidden_state_layer_ids": [2, 15, 27],  # the streams vLLM captures: as they are
        "transformer_layer_config": llama_fields(c, config.vocab_size),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]},
        },
    }
    folder = tmp_path / "speculators"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    loaded = EagleHead.load(folder / "model.safetensors")  # the weights file beside its config.json
    assert loaded.config.feature_layers == (2, 15, 27) and loaded.config.num_layers == 2
    assert loaded.config.feature_norm == "concat"
    assert torch.equal(loaded.state()["feature_norm.weight"], tensors["input_norm.weight"])
    assert torch.equal(loaded.state()["layers.1.input_layernorm.weight"], tensors["layers.1.input_layernorm.weight"])
    assert run_head(smollm2, loaded, TREE)[0] == autoregressive


def test_an_eagle31_head_with_fc_norm_and_two_midlayers_runs_lossless(tmp_path, shipped, smollm2, autoregressive):
    config, _, _ = smollm2
    _, head = shipped
    state, c = head.state(), attrs.evolve(head.config, num_layers=2)
    gen = torch.Generator().manual_seed(7)
    tensors = {"fc.weight": state["fc.weight"], **first_layer(state, "midlayer.0.")}
    tensors.update(deeper_layer("midlayer.1.", c, "hidden_norm", seed=8))  # TensorRT-LLM: its input norm's name
    tensors.update({f"fc_norm.{i}.weight": 1 + 0.05 * torch.randn(c.hidden_size, generator=gen) for i in range(3)})
    tensors.update({"norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]})
    tensors.update(vocab_maps(state, config.vocab_size))
    folder = tmp_path / "eagle31"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    raw = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(c, config.vocab_size), "fc_norm": True}
    raw.update(draft_vocab_size=8192, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]})
    (folder / "config.json").write_text(json.dumps(raw))
    loaded = EagleHead.load(folder)
    assert loaded.config.feature_norm == "per_layer" and loaded.config.num_layers == 2
    assert torch.equal(loaded.state()["layers.1.input_layernorm.weight"], tensors["midlayer.1.hidden_norm.weight"])
    assert run_head(smollm2, loaded, CHAIN)[0] == autoregressive
    raw["norm_output"] = True  # EAGLE-3.1's normed next hidden state: not what EagleHead feeds the next step
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="norm_output"):
        EagleHead.load(folder)


# ---- conventions and formulas -------------------------------------------------------------------------------
def test_a_feature_layer_is_the_residual_stream_entering_that_target_layer():
    """The index the layouts' aux ids are mapped to: the engine's target returns, at feature index ``k``, the
    stream after ``k`` layers (what a model of the first ``k`` layers ends on; ``0`` the embedding), which is
    Hugging Face's ``hidden_states[k]`` (test_engine_model checks SmolLM2's (2, 15, 27) against transformers)."""
    from speccycle.engine.models.target import LlamaTarget

    weights = random_llama_weights(TINY, seed=2, scale=0.08)
    ids = [1, 17, 99, 250, 3, 8]

    def features(config, w, layers):
        pool = PagedKVPool(num_pages=16, page_size=4)
        target = LlamaTarget.from_weights(config, w, pool, feature_layers=layers)
        return target.forward(extend_batch(pool, [0], [ids], [0], last_logits_only=False)).hidden

    full, h = features(TINY, weights, (0, 2, 5)), TINY.hidden_size
    assert torch.equal(full[:, :h], weights["model.embed_tokens.weight"][ids])
    for part, k in ((1, 2), (2, 5)):
        kept = {n: w for n, w in weights.items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < k}
        ended = features(attrs.evolve(TINY, num_layers=k), kept, (k,))
        assert torch.equal(full[:, part * h : (part + 1) * h], ended)


@pytest.mark.parametrize("norm", ["per_layer", "concat"])
def test_the_feature_norms_compute_their_formula(norm):
    """``fc(concat(RMSNorm_i(f_i)))`` (EAGLE-3.1's fc_norm) and ``fc(RMSNorm(concat(f)))`` (norm_before_fc),
    written out here, against `EagleHead.project`."""
    config = attrs.evolve(EagleConfig.for_target(TINY, 3, 32), feature_norm=norm)
    head = EagleHead.random(config, seed=4, target_vocab=TINY.vocab_size)
    gen = torch.Generator().manual_seed(9)
    weights = {k: (1 + 0.2 * torch.randn(v.shape, generator=gen)) for k, v in head.state().items() if "feature" in k}
    state = {**head.state(), **weights}
    head = EagleHead(config, state)
    features = torch.randn(5, 3 * TINY.hidden_size, generator=gen) * 3

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + TINY.rms_norm_eps)

    if norm == "per_layer":
        parts = features.split(TINY.hidden_size, -1)
        normed = torch.cat([rms(p, state[f"feature_norm.{i}.weight"]) for i, p in enumerate(parts)], -1)
    else:
        normed = rms(features, state["feature_norm.weight"])
    torch.testing.assert_close(head.project(features), normed @ state["fc.weight"].T, rtol=1e-5, atol=1e-5)


def test_the_trainable_head_runs_the_feature_norm_as_the_draft_does():
    from speccycle.train.features import target_outputs
    from speccycle.train.head import TrainableEagleHead

    config = attrs.evolve(EagleConfig.for_target(TINY, 3, 32), feature_norm="per_layer")
    head = EagleHead.random(config, seed=1, target_vocab=TINY.vocab_size)
    gen = torch.Generator().manual_seed(3)
    state = {
        k: (1 + 0.2 * torch.randn(v.shape, generator=gen)) if "feature" in k else v for k, v in head.state().items()
    }
    head = EagleHead(config, state)
    weights = random_llama_weights(TINY, seed=3, scale=0.08)
    model = LlamaModel(TINY, weights, feature_layers=config.feature_layers)
    seq = [1, 40, 41, 300, 7, 9, 12]
    with torch.no_grad():
        features = target_outputs(model, torch.tensor([seq]), config.feature_layers).features
        unrolled = TrainableEagleHead.from_eagle_head(head).unroll(model, torch.tensor([seq]), features, 1)[0]
    pool = PagedKVPool(num_pages=32, page_size=4)
    draft = EagleDraft(head, model, pool)
    out = draft.extend(extend_batch(pool, [0], [seq[1:]], [0], last_logits_only=False), features[0, :-1])
    torch.testing.assert_close(out.hidden, unrolled[0, :-1], atol=1e-5, rtol=1e-5)


# ---- refusals ---------------------------------------------------------------------------------------------
def small_eagle3(folder: Path, hidden: int = 576, vocab: int = 49152, draft_vocab: int = 16, **config) -> dict:
    """A small random EAGLE-3 head in the eagle3 layout (SpecForge's keys, embed_tokens included)."""
    heads, head_dim, kv, inter = hidden // 64, 64, max(1, hidden // 192), 32
    c = EagleConfig(3, hidden, inter, heads, kv, head_dim, 10000.0, 1e-5, (2, 15, 27), draft_vocab)
    head = EagleHead.random(c, seed=0, target_vocab=vocab)
    state = head.state()
    tensors = {"fc.weight": state["fc.weight"], **first_layer(state, "midlayer.")}
    tensors.update({"norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"]})
    tensors.update(vocab_maps(state, vocab))
    tensors["embed_tokens.weight"] = torch.zeros(8, hidden)  # a copy of the target's embedding: not read
    raw = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(c, vocab), "draft_vocab_size": draft_vocab}
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}
    raw.update(config)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return tensors


def rewrite(folder: Path, tensors: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def refused(folder: Path, capsys, *needles: str) -> str:
    """`EagleHead.load` and ``convert-draft`` refuse ``folder`` with one line naming each needle."""
    with pytest.raises(ModelLoadError) as error:
        head = EagleHead.load(folder)
        check_target(head.config, _smollm2_config(), str(folder))
    message = str(error.value)
    assert "\n" not in message and all(n in message for n in needles), message
    code = main(["convert-draft", str(folder), str(folder.parent / "out.safetensors")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("speccycle: error: "), lines
    assert all(n in lines[0] for n in needles), lines[0]
    return message


def _smollm2_config():
    from speccycle.engine.models.catalog import model_config

    return model_config(None)


def test_a_missing_key_a_wrong_shape_and_an_unknown_tensor_are_refused_naming_the_key(tmp_path, capsys, model_path):
    folder = tmp_path / "head"
    tensors = small_eagle3(folder)
    assert EagleHead.load(folder).config.target_vocab_size == 49152  # the small head itself loads
    broken = {k: v for k, v in tensors.items() if k != "midlayer.mlp.down_proj.weight"}
    rewrite(folder, broken)
    refused(folder, capsys, "missing midlayer.mlp.down_proj.weight")
    rewrite(folder, {**tensors, "midlayer.self_attn.q_proj.weight": tensors["midlayer.self_attn.q_proj.weight"].T})
    refused(folder, capsys, "midlayer.self_attn.q_proj.weight", "[1152, 576]", "[576, 1152]")
    rewrite(folder, {**tensors, "midlayer.self_attn.q_proj.bias": torch.zeros(576)})
    refused(folder, capsys, "midlayer.self_attn.q_proj.bias")
    rewrite(folder, {**tensors, "d2t": tensors["d2t"].float()})
    refused(folder, capsys, "d2t")
    t2d = tensors["t2d"].clone()
    t2d[int(torch.nonzero(~t2d)[0])] = True
    rewrite(folder, {**tensors, "t2d": t2d})
    refused(folder, capsys, "t2d")
    rewrite(folder, {k: v for k, v in tensors.items() if k != "lm_head.weight"})
    refused(folder, capsys, "lm_head.weight")


def test_a_head_for_another_target_is_refused_naming_the_key(tmp_path, capsys, model_path):
    small_eagle3(tmp_path / "narrow", hidden=64)
    refused(tmp_path / "narrow", capsys, "fc.weight", "64", "576")
    small_eagle3(tmp_path / "wide-vocab", vocab=50000)
    refused(tmp_path / "wide-vocab", capsys, "t2d", "50000", "49152")
    small_eagle3(tmp_path / "deep", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 40]})
    refused(tmp_path / "deep", capsys, "eagle_aux_hidden_state_layer_ids", "30")
    # the draft refuses it too, where the engine builds it on a target
    head = EagleHead.load(tmp_path / "wide-vocab")  # hidden 576 over a 64-wide target
    model = LlamaModel(TINY, random_llama_weights(TINY, seed=1))
    with pytest.raises(ModelLoadError, match="fc.weight projects features of hidden size 576"):
        EagleDraft(head, model, PagedKVPool(num_pages=8, page_size=4))


def test_eagle1_files_variants_and_folders_without_a_config_are_refused(tmp_path, capsys, model_path):
    folder = tmp_path / "eagle1"
    tensors = small_eagle3(folder)
    rewrite(folder, {**tensors, "fc.weight": torch.zeros(576, 1152), "fc.bias": torch.zeros(576)})
    refused(folder, capsys, "fc.weight", "EAGLE-1")
    small_eagle3(tmp_path / "residual", norm_before_residual=True)
    refused(tmp_path / "residual", capsys, "norm_before_residual")
    small_eagle3(tmp_path / "scaled", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    refused(tmp_path / "scaled", capsys, "dynamic")
    bare = tmp_path / "bare"
    small_eagle3(bare)
    (bare / "config.json").unlink()
    refused(bare, capsys, "config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no head weights"):
        read_published(tmp_path / "empty")


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
@pytest.mark.parametrize("norm", [None, "per_layer", "concat"])
def test_deeper_heads_with_feature_norms_round_trip_through_each_layout(tmp_path, layout, norm):
    config = attrs.evolve(EagleConfig.for_target(TINY, 3, 32), num_layers=3, feature_norm=norm)
    head = EagleHead.random(config, seed=2, target_vocab=TINY.vocab_size)
    back = EagleHead.load(write_layout(head, tmp_path / layout, layout, TINY))
    assert back.config == attrs.evolve(config, target_vocab_size=TINY.vocab_size)
    for name, value in head.state().items():
        assert torch.equal(back.state()[name], value), name


def test_convert_draft_refuses_bad_arguments_in_one_line(tmp_path, shipped, capsys):
    path, _ = shipped

    def refused_line(argv, *needles):
        code = main(["convert-draft", *argv])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("speccycle: error: "), lines
        assert all(n in lines[0] for n in needles), lines[0]

    refused_line([str(tmp_path / "nothing"), str(tmp_path / "out.safetensors")], "no such file or folder")
    refused_line([str(path), str(tmp_path / "out.bin")], ".safetensors", "--export")
    refused_line([str(path), str(tmp_path / "out"), "--export", "eagle3", "--storage", "int8-rowwise"], "--storage")
    (tmp_path / "file").write_text("")
    refused_line([str(path), str(tmp_path / "file"), "--export", "speculators"], "writes a folder")
    refused_line([str(path), str(tmp_path / "out"), "--export", "sglang"], "invalid choice")
    eagle1 = EagleHead.random(EagleConfig.for_target(TINY, 1), seed=0)
    eagle1.save(tmp_path / "eagle1.safetensors")
    model = tmp_path / "tiny"
    from speccycle.engine.weights.weights_hf import save_hf

    save_hf(model, TINY, random_llama_weights(TINY, seed=0))
    argv = [str(tmp_path / "eagle1.safetensors"), str(tmp_path / "e1"), "--export", "eagle3", "--model", str(model)]
    refused_line(argv, "EAGLE-3 heads", "EAGLE-1")  # speccycle's own file holds it:
    assert main(["convert-draft", argv[0], str(tmp_path / "e1.safetensors"), "--model", str(model)]) == 0
    assert EagleHead.load(tmp_path / "e1.safetensors").config == eagle1.config


def test_aux_ids_listed_out_of_order_are_read_in_layer_order(tmp_path):
    """SGLang and vLLM capture the streams as their layer loop meets them, so fc reads them in layer order."""
    small_eagle3(tmp_path / "eagle3", eagle_config={"eagle_aux_hidden_state_layer_ids": [26, 1, 14]})
    assert EagleHead.load(tmp_path / "eagle3").config.feature_layers == (2, 15, 27)


@pytest.mark.parametrize("norm", ["per_layer", "concat"])
def test_the_fast_path_applies_a_published_heads_feature_norm(norm):
    """The fast path's EAGLE-3 layer (`fast.path._eagle_layer`, `_folded_eagle3_layer`) reads the features through the
    head's feature norm as the reference draft does: the draft extend's depth-1 top-K after a prefill agree
    (the norm's weights far from 1, so skipping it would move them)."""
    config = attrs.evolve(EagleConfig.for_target(TINY, 3, 32), feature_norm=norm)
    head = EagleHead.random(config, seed=4, target_vocab=TINY.vocab_size)
    gen = torch.Generator().manual_seed(11)
    state = {
        k: (0.2 + 3 * torch.rand(v.shape, generator=gen)) if "feature" in k else v for k, v in head.state().items()
    }
    head = EagleHead(config, state)
    weights = random_llama_weights(TINY, seed=3, scale=0.08)
    prompt = (1, 40, 41, 300, 7, 9, 12, 5, 77)
    tops = []
    for fast in (False, True):
        model = LlamaModel(TINY, weights, feature_layers=config.feature_layers)
        pool = PagedKVPool(num_pages=64, page_size=16)
        engine = Engine(
            model, pool, lambda e, m=model, p=pool: EagleDraft(head, m, p), SpecConfig(3, 4, 8, 16), fast=fast
        )

        ports = Ports(target=engine.target, draft=engine.draft, kv_pool=pool)
        ready = run_cycle(Admitted(config=engine.spec, requests=(Request(0, prompt),)), ports, engine.backend)
        tops.append((ready.topk_index.clone(), ready.topk_p.clone()))
    (ref_index, ref_p), (fast_index, fast_p) = tops
    assert torch.equal(fast_index, ref_index)
    torch.testing.assert_close(fast_p, ref_p, rtol=1e-4, atol=1e-5)
