"""EAGLE-3 heads in the layouts other projects publish: read as an `EagleHead`, and written from one.

A published head is a safetensors file or a torch state dict (``.bin``, ``.pt``, ``.pth``), alone with its
``config.json`` beside it or in a folder (shards listed by a ``*.index.json``, or every weight file of one
kind). `EagleHead.load` reads it wherever it reads a head file (``--eagle-head``, ``Engine.load``, the
tensor-parallel engine); the layout is recognized by the file's keys and config:

``eagle3``: the EAGLE repository's EAGLE-3, SpecForge and SGLang (``LlamaForCausalLMEagle3``, or the EAGLE
repository's ``LlamaForCausalLM`` with ``draft_vocab_size``)::

    fc.weight                                   [H, 3H]   the three target features -> H, no bias
    midlayer.input_layernorm.weight             [H]       the embedding's norm (EagleHead: layer.embed_norm)
    midlayer.hidden_norm.weight                 [H]       the projected features' norm
    midlayer.self_attn.{q,k,v}_proj.weight      [*, 2H]   over [norm(embedding), norm(features)]
    midlayer.self_attn.o_proj.weight            [H, *]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight [H], lm_head.weight [Vd, H]   the head's own final norm and LM head over its draft vocabulary
    d2t [Vd]   int64 offsets: target id = draft id + d2t[draft id]
    t2d [V]    bool: the target ids the draft vocabulary holds
    fc_norm.{0,1,2}.weight [H]   EAGLE-3.1: one RMSNorm per feature before fc (when present)
    input_norm.weight [3H]       one RMSNorm over the concatenated features before fc (when present)

  A head of ``n > 1`` layers names them ``midlayer.{i}.*``: layer 0 as above, layers ``i >= 1`` plain Llama
  layers whose input norm is ``midlayer.{i}.hidden_norm`` (TensorRT-LLM's reading of the name;
  ``midlayer.{i}.input_layernorm`` is read as well). The config holds the draft layer's Llama fields,
  ``vocab_size`` (the target's), ``draft_vocab_size`` and, when present,
  ``eagle_config.eagle_aux_hidden_state_layer_ids``.

``speculators``: vLLM's speculators (``speculators_model_type: "eagle3"``): the same tensors with the
layers named ``layers.{i}.*`` (layer 0 as ``midlayer`` above; layers ``i >= 1`` Llama layers with
``input_layernorm``); the Llama fields under ``transformer_layer_config``; ``draft_vocab_size``,
``norm_before_fc`` (with ``input_norm.weight``), ``fc_norm``, ``norm_before_residual`` and
``eagle_aux_hidden_state_layer_ids`` at the top; ``speculators_config`` (proposal method, verifier).

``embed_tokens.weight``, which SpecForge and speculators files carry (the target's, copied), is not read:
the head runs on the target's embedding, as `EagleDraft` always does. A leading ``model.`` on a key is dropped.

Feature layers. `EagleConfig.feature_layers` index the residual stream *entering* a target layer (``0`` the
embeddings: the index of Hugging Face's ``hidden_states`` and of `llama.LlamaModel`'s ``feature_layers``);
the EAGLE reference captures the streams entering layers ``(2, N/2, N-3)`` of an ``N``-layer target. The
layouts number the ids of their config differently, and each is read as the engine that serves it reads it:

* ``eagle3``: ``eagle_aux_hidden_state_layer_ids`` number layer *outputs* (SpecForge writes ``[1, N/2-1, N-4]``
  for the reference's layers; SGLang captures the stream entering layer ``id + 1``): feature layer = id + 1.
* ``speculators``: the ids are the stream indices vLLM captures (its default ``[2, N/2, N-3]``): feature
  layer = id.

Either way ``fc`` reads the three in layer order (SGLang and vLLM append them as their layer loop meets them),
whatever order the config lists them in. A config without ids reads the reference's ``(2, N/2, N-3)``, which
needs the target's layer count ``N`` (`EagleHead.load`'s ``target_layers``, or a `HeadPath` carrying it). The
writers always write the ids.

Refused, each in one line that names the key: a missing or wrongly shaped tensor, a tensor no layout has
(biases), a ``t2d`` that disagrees with ``d2t``; EAGLE-1 files (``fc [H, 2H]`` with a bias, a first layer
without an input norm, features after the target's final norm: `EagleHead`'s EAGLE-1 reads the stream before
the final norm and norms ``fc``'s output, another function), ``norm_output`` (EAGLE-3.1's normalized next
hidden state), ``norm_before_residual``, a draft width other than the target's (``target_hidden_size``).
A head for another target (hidden size, vocabulary) is refused when it meets it (`eagle.check_target`).

    config, weights = read_published(Path("sglang-eagle3-head/"), target_layers=30)
    write_layout(head, Path("out/"), "speculators", target_config)   # config.json + model.safetensors
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ..models.rope import rope_base_from_hf, rope_scaling
from .eagle_config import METADATA_KEY, EagleConfig, _shapes, check_target, extra_layer_prefix, feature_norm_shapes

LAYOUTS = ("eagle3", "speculators")
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
IGNORED = ("embed_tokens.weight",)  # the target's embedding, copied into some files: the target's own is used


class HeadPath(os.PathLike):
    """A head's path with the layer count of the target it drafts for: resolves the default feature layers
    of a published head whose config names none, where the head is loaded by path (``Engine.load``)."""

    def __init__(self, path: str | os.PathLike, target_layers: int) -> None:
        self.path, self.target_layers = Path(path), int(target_layers)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"HeadPath({str(self.path)!r}, target_layers={self.target_layers})"


def target_layers_of(path: str | os.PathLike, target_layers: int | None) -> int | None:
    """``target_layers``, else the count a `HeadPath` carries (None: unknown)."""
    return target_layers if target_layers is not None else getattr(path, "target_layers", None)


# ---- reading ---------------------------------------------------------------------------------------
def published_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The config.json of the published head at ``path``, or None where ``path`` is a head file `EagleHead.save`
    wrote (or nothing this reads: `EagleHead.load` says what)."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                if METADATA_KEY in (f.metadata() or {}):
                    return None
        except Exception:  # not readable: EagleHead.load reports it
            return None
    if not path.exists():
        return None
    config_path = (path if path.is_dir() else path.parent) / CONFIG
    return _read_config(config_path, path) if config_path.is_file() else None


def needs_target_layers(path: str | os.PathLike) -> bool:
    """Whether the head at ``path`` is a published one whose config names no feature layers (loading it needs
    the target's layer count)."""
    raw = published_config(path)
    return raw is not None and _aux_ids(raw) is None


def read_published(
    path: str | os.PathLike, target_layers: int | None = None, tensors: dict[str, torch.Tensor] | None = None
) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """The `EagleConfig` and `EagleHead` weights (its names) of the published head at ``path`` (module docstring).

    ``tensors``: the file's tensors, already read. Raises `ModelLoadError`, naming the key, where it cannot."""
    path = Path(path)
    source = str(path)
    files, config_path = _locate(path)
    if tensors is None:
        tensors = _read_tensors(files)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    if not config_path.is_file():
        raise ModelLoadError(
            f"{source}: no {CONFIG} beside the weights; a published EAGLE head needs its config (the draft "
            "layer's heads, RoPE base and norm eps), and a head saved by EagleHead.save carries its own"
        )
    raw = _read_config(config_path, path)
    layout = detect_layout(tensors, raw, source)
    return _read(layout, tensors, raw, source, target_layers)


def detect_layout(tensors: dict[str, torch.Tensor], raw: dict[str, Any], source: str) -> str:
    """``eagle3`` or ``speculators`` (`LAYOUTS`) from the keys and config; refuses EAGLE-1 and anything else."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ModelLoadError(
                f"{source}: speculators_model_type {kind!r} is not read; speculators heads of type 'eagle3' are"
                + (" (EAGLE-1 heads are not: " + _EAGLE1_WHY + ")" if kind == "eagle" else "")
            )
        return "speculators"
    fc = tensors.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] == 2 * fc.shape[0]:
        bias = " with fc.bias" if "fc.bias" in tensors else ""
        raise ModelLoadError(f"{source}: fc.weight {_shape(fc)}{bias} is an EAGLE-1 head: {_EAGLE1_WHY}")
    if any(k.startswith("midlayer.") for k in tensors):
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise ModelLoadError(f"{source}: model_type {model_type!r}: the EAGLE-3 draft layers read are Llama's")
        return "eagle3"
    if "layer.q_proj.weight" in tensors:
        raise ModelLoadError(
            f"{source}: keys layer.* are EagleHead.save's, but the file has no 'speccycle.eagle' metadata: save it "
            "again with EagleHead.save"
        )
    raise ModelLoadError(
        f"{source}: not an EAGLE-3 head this reads (keys {', '.join(sorted(tensors)[:4])}, ...): the eagle3 layout "
        "has midlayer.* keys, a speculators config speculators_model_type 'eagle3'"
    )


_EAGLE1_WHY = (
    "EagleHead's EAGLE-1 reads the target's stream before its final norm and norms fc's output, while published "
    "EAGLE-1 heads read the normed stream through fc with a bias and no input norm, another function"
)


def _read(
    layout: str, tensors: dict[str, torch.Tensor], raw: dict[str, Any], source: str, target_layers: int | None
) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    llama = raw.get("transformer_layer_config") if layout == "speculators" else raw
    if not isinstance(llama, dict):
        raise ModelLoadError(f"{source}: {CONFIG} has no transformer_layer_config (a speculators config holds one)")
    _refuse_variants(layout, raw, llama, source)
    try:
        hidden, heads = int(llama["hidden_size"]), int(llama["num_attention_heads"])
        intermediate = int(llama["intermediate_size"])
    except KeyError as error:
        raise ModelLoadError(f"{source}: {CONFIG} has no {error.args[0]!r}, which the head needs") from error
    num_layers = _layer_count(layout, tensors, llama, source)
    vocab = llama.get("vocab_size", raw.get("vocab_size"))
    t2d = tensors.get("t2d")
    if vocab is None and t2d is not None:
        vocab = t2d.numel()
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None:
        raise ModelLoadError(
            f"{source}: missing lm_head.weight: the head needs its own LM head (one loaded from the target at "
            "serve time is not read)"
        )
    draft_vocab = int(lm_head.shape[0])
    stated = raw.get("draft_vocab_size", llama.get("draft_vocab_size"))
    if stated is not None and int(stated) != draft_vocab:
        raise ModelLoadError(
            f"{source}: lm_head.weight {_shape(lm_head)} has {draft_vocab} rows, the config's draft_vocab_size "
            f"is {stated}"
        )
    feature_norm = _feature_norm(tensors, raw, llama, source)
    config = EagleConfig(
        version=3,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=heads,
        num_kv_heads=int(llama.get("num_key_value_heads") or heads),
        head_dim=int(llama.get("head_dim") or hidden // heads),
        rope_theta=rope_base_from_hf(llama, source),
        rms_norm_eps=float(llama.get("rms_norm_eps", 1e-6)),
        feature_layers=_feature_layers(layout, raw, source, target_layers),
        draft_vocab_size=draft_vocab,
        num_layers=num_layers,
        feature_norm=feature_norm,
        target_vocab_size=None if vocab is None else int(vocab),
    )
    names = _names(layout, config, tensors)  # EagleHead name -> published name
    _check(config, names, tensors, source)
    weights = {ours: tensors[theirs] for ours, theirs in names.items() if theirs is not None}
    weights["draft_to_target"] = _draft_to_target(tensors, config, source)
    return config, weights


def _refuse_variants(layout: str, raw: dict[str, Any], llama: dict[str, Any], source: str) -> None:
    """Refuses the published options `EagleHead` does not run, naming the key."""
    flags = {**llama, **raw}
    if flags.get("norm_output"):
        raise ModelLoadError(
            f"{source}: norm_output=true (EAGLE-3.1's normalized next hidden state) is not run by EagleHead, which "
            "feeds the layer output before the norm to the next step"
        )
    residual = raw.get("norm_before_residual", True if layout == "speculators" else False)
    if residual:
        said = "" if "norm_before_residual" in raw else " (absent, which vLLM reads as true)"
        raise ModelLoadError(
            f"{source}: norm_before_residual=true{said} is not run by EagleHead, whose first layer adds the "
            "un-normed features to its attention output; write norm_before_residual: false if the head was "
            "trained that way"
        )
    target_hidden = raw.get("target_hidden_size", llama.get("target_hidden_size"))
    if target_hidden is not None and int(target_hidden) != int(llama.get("hidden_size", -1)):
        raise ModelLoadError(
            f"{source}: target_hidden_size {target_hidden} differs from the draft's hidden_size "
            f"{llama.get('hidden_size')}: EagleHead runs at the target's width"
        )
    for flag in ("attention_bias", "mlp_bias", "bias"):
        if flags.get(flag):
            raise ModelLoadError(f"{source}: {flag}=true: EagleHead's layers have no biases")
    if flags.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {flags['hidden_act']!r}: EagleHead's MLP is SiLU-gated")
    eagle_config = raw.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ModelLoadError(f"{source}: eagle_config.use_aux_hidden_state=false: EagleHead reads three features")


def _layer_count(layout: str, tensors: dict[str, torch.Tensor], llama: dict[str, Any], source: str) -> int:
    pattern = re.compile(r"^midlayer\.(\d+)\." if layout == "eagle3" else r"^layers\.(\d+)\.")
    indices = {int(m.group(1)) for k in tensors if (m := pattern.match(k))}
    found = max(indices) + 1 if indices else 1
    stated = int(llama.get("num_hidden_layers", found))
    if stated != found:
        prefix = "midlayer.{i}" if layout == "eagle3" else "layers.{i}"
        raise ModelLoadError(
            f"{source}: num_hidden_layers is {stated} but the keys hold {found} layers ({prefix}.*): the config "
            "and weights disagree"
        )
    return found


def _feature_norm(
    tensors: dict[str, torch.Tensor], raw: dict[str, Any], llama: dict[str, Any], source: str
) -> str | None:
    per_layer = "fc_norm.0.weight" in tensors or bool(raw.get("fc_norm", llama.get("fc_norm")))
    concat = "input_norm.weight" in tensors or bool(raw.get("norm_before_fc", llama.get("norm_before_fc")))
    if per_layer and concat:
        raise ModelLoadError(
            f"{source}: fc_norm and input_norm (norm_before_fc) both normalize the features before fc; a head has "
            "one of them"
        )
    return "per_layer" if per_layer else "concat" if concat else None


def _aux_ids(raw: dict[str, Any]) -> list | None:
    eagle_config = raw.get("eagle_config") or {}
    return raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")


def _feature_layers(layout: str, raw: dict[str, Any], source: str, target_layers: int | None) -> tuple[int, ...]:
    ids = _aux_ids(raw)
    if ids is None:
        if target_layers is None:
            raise ModelLoadError(
                f"{source}: {CONFIG} names no eagle_aux_hidden_state_layer_ids, so the head reads the EAGLE "
                "reference's layers (2, N/2, N-3) of an N-layer target: load it with the target's layer count "
                "(target_layers=N), as --eagle-head and convert-draft --model do"
            )
        n = int(target_layers)
        return (2, n // 2, n - 3)
    if len(ids) != 3:
        raise ModelLoadError(
            f"{source}: eagle_aux_hidden_state_layer_ids {list(ids)} name {len(ids)} layers; EagleHead reads three"
        )
    offset = 1 if layout == "eagle3" else 0  # module docstring: layer outputs vs. the streams entering a layer
    # SGLang and vLLM append the captured streams as their layer loop meets them: fc reads them in layer order
    return tuple(sorted(int(i) + offset for i in ids))


def _layer_prefix(layout: str, index: int, indexed: bool) -> str:
    """Layer ``index``'s key prefix; ``indexed``: the eagle3 layout numbers its layers (``midlayer.{i}.``)."""
    if layout == "speculators":
        return f"layers.{index}."
    return f"midlayer.{index}." if indexed else "midlayer."


def _names(layout: str, c: EagleConfig, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, str | None]:
    """`EagleHead` weight name -> its name in ``layout`` (``draft_to_target`` maps to ``d2t``). ``tensors``: the
    file's, where a name has two readings (a one-layer eagle3 head's ``midlayer.`` or ``midlayer.0.``, a deeper
    layer's input norm); without them, the names the writers write."""
    indexed = c.num_layers > 1 or (tensors is not None and any(k.startswith("midlayer.0.") for k in tensors))
    first = _layer_prefix(layout, 0, indexed)
    names: dict[str, str | None] = {"fc.weight": "fc.weight"}
    for proj in ("q", "k", "v", "o"):
        names[f"layer.{proj}_proj.weight"] = f"{first}self_attn.{proj}_proj.weight"
    for proj in ("gate", "up", "down"):
        names[f"layer.{proj}_proj.weight"] = f"{first}mlp.{proj}_proj.weight"
    names["layer.embed_norm.weight"] = f"{first}input_layernorm.weight"
    names["layer.hidden_norm.weight"] = f"{first}hidden_norm.weight"
    names["layer.post_attention_layernorm.weight"] = f"{first}post_attention_layernorm.weight"
    for index in range(1, c.num_layers):
        ours, theirs = extra_layer_prefix(index), _layer_prefix(layout, index, indexed)
        for name in (
            "post_attention_layernorm.weight",
            *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
            *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        ):
            names[ours + name] = theirs + name
        norm = "input_layernorm.weight"
        if layout == "eagle3" and not (tensors is not None and theirs + norm in tensors):
            norm = "hidden_norm.weight"  # TensorRT-LLM's name of a deeper midlayer's input norm
        names[ours + "input_layernorm.weight"] = theirs + norm
    for name in feature_norm_shapes(c):
        names[name] = "input_norm.weight" if c.feature_norm == "concat" else name.replace("feature_norm", "fc_norm")
    names["norm.weight"] = "norm.weight"
    names["lm_head.weight"] = "lm_head.weight"
    names["draft_to_target"] = None  # from d2t (and t2d)
    return names


def _check(c: EagleConfig, names: dict[str, str | None], tensors: dict[str, torch.Tensor], source: str) -> None:
    """Every tensor present with its shape, and no tensor the layout lacks; one line naming the first key."""
    shapes = _shapes(c)
    for ours, theirs in names.items():
        if theirs is None:
            continue
        if theirs not in tensors:
            raise ModelLoadError(f"{source}: missing {theirs} (an EAGLE-3 head of this config has it)")
        got, want = tuple(tensors[theirs].shape), shapes[ours]
        if got != want:
            raise ModelLoadError(
                f"{source}: {theirs} has shape {list(got)}, this config needs {list(want)} (hidden_size "
                f"{c.hidden_size}, {c.num_heads} heads of {c.head_dim}, {c.num_kv_heads} KV heads, intermediate "
                f"{c.intermediate_size})"
            )
    known = {v for v in names.values() if v is not None} | {"d2t", "t2d", *IGNORED}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ModelLoadError(
            f"{source}: tensor {unknown[0]} is no part of an EAGLE-3 head EagleHead runs"
            + (f" ({len(unknown) - 1} more)" if len(unknown) > 1 else "")
        )
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and (embed.dim() != 2 or embed.shape[1] != c.hidden_size):
        raise ModelLoadError(f"{source}: embed_tokens.weight {_shape(embed)} is not [vocab, {c.hidden_size}]")


def _draft_to_target(tensors: dict[str, torch.Tensor], c: EagleConfig, source: str) -> torch.Tensor:
    """The target id of each draft id: ``arange(Vd) + d2t``, checked against ``t2d`` and the vocabulary."""
    vd, vocab = c.draft_vocab_size, c.target_vocab_size
    d2t = tensors.get("d2t")
    if d2t is None:
        if vocab is None or vd != vocab:
            raise ModelLoadError(
                f"{source}: missing d2t: a draft vocabulary of {vd} tokens needs its map to the target's ids"
            )
        ids = torch.arange(vd)
    else:
        if tuple(d2t.shape) != (vd,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise ModelLoadError(f"{source}: d2t is {d2t.dtype} {_shape(d2t)}; it must be integer offsets [{vd}]")
        ids = torch.arange(vd) + d2t.long()
    if int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab):
        raise ModelLoadError(f"{source}: d2t maps a draft id to {int(ids.max())}, outside a vocabulary of {vocab}")
    if int(ids.unique().numel()) != vd:
        raise ModelLoadError(f"{source}: d2t maps two draft ids to one target id")
    t2d = tensors.get("t2d")
    if t2d is not None:
        if vocab is not None and tuple(t2d.shape) != (vocab,):
            raise ModelLoadError(f"{source}: t2d has shape {_shape(t2d)}, the config's vocab_size is {vocab}")
        mask = t2d.bool()
        if int(mask.sum()) != vd or not bool(mask[ids].all()):
            raise ModelLoadError(f"{source}: t2d does not mark exactly the {vd} target ids d2t maps to")
    return ids


def _locate(path: Path) -> tuple[list[Path], Path]:
    """The weight files of ``path`` (a file, or a folder's) and where its config.json is."""
    if path.is_file():
        return [path], path.parent / CONFIG
    if not path.is_dir():
        raise ModelLoadError(f"no EAGLE head at {path}")
    for index in sorted(path.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelLoadError(f"{index} is not a shard index (a weight_map of tensor -> file): {error}") from error
        return [path / name for name in sorted(set(weight_map.values()))], path / CONFIG
    for pattern in ("*.safetensors", *(f"*{suffix}" for suffix in TORCH_SUFFIXES)):
        files = sorted(p for p in path.glob(pattern) if p.is_file())
        if files:
            return files, path / CONFIG
    raise ModelLoadError(f"{path}: no head weights (*.safetensors, *.bin, *.pt, *.pth) in the folder")


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), framework="pt") as f:
                    part = {k: f.get_tensor(k) for k in f.keys()}
            except Exception as err:  # safetensors raises its own error types for corrupt headers
                raise ModelLoadError(f"{file} is not a readable safetensors file: {err}") from err
        else:
            try:
                part = torch.load(str(file), map_location="cpu", weights_only=True)
            except Exception as err:  # pickle and zip errors of every kind
                raise ModelLoadError(f"{file} is not a readable torch state dict: {err}") from err
            if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
                raise ModelLoadError(f"{file} holds no state dict of tensors (a dict of name -> tensor)")
        twice = sorted(set(part) & set(out))
        if twice:
            raise ModelLoadError(f"{file}: {twice[0]} is also in another weight file of the head")
        out.update(part)
    return out


def _read_config(config_path: Path, head: Path) -> dict[str, Any]:
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{config_path} (the config of {head}) is not readable JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path} is not a JSON object")
    return raw


def _shape(t: torch.Tensor | None) -> str:
    return "[]" if t is None else str(list(t.shape))


# ---- writing ---------------------------------------------------------------------------------------
def published_tensors(head, layout: str, target_vocab_size: int) -> dict[str, torch.Tensor]:
    """The head's tensors under ``layout``'s names (``d2t`` int64 offsets, ``t2d`` a bool mask over the target's
    ``target_vocab_size`` ids)."""
    _check_writable(head, layout)
    c, state = head.config, head.state()
    out = {theirs: state[ours] for ours, theirs in _names(layout, c).items() if theirs is not None}
    ids = state["draft_to_target"].long().cpu()
    out["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def published_config_dict(
    head, layout: str, target_config, target_name: str = "", speculative_tokens: int = 4
) -> dict[str, Any]:
    """The ``config.json`` of the head in ``layout`` for a target of ``target_config`` (`weights_gguf.LlamaConfig`).

    ``target_name``: the verifier a speculators config names; ``speculative_tokens``: its proposal length."""
    _check_writable(head, layout)
    c = head.config
    llama: dict[str, Any] = {
        "architectures": [EAGLE3_ARCHITECTURE] if layout == "eagle3" else ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": float(c.rope_theta),
        "max_position_embeddings": target_config.max_position,
        "vocab_size": target_config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(head.dtype).removeprefix("torch."),
    }
    scaling = rope_scaling(c.rope_theta)
    if scaling is not None:
        llama["rope_scaling"] = scaling.to_hf()
    norms = {"fc_norm": c.feature_norm == "per_layer", "norm_before_fc": c.feature_norm == "concat"}
    if layout == "eagle3":
        ids = [layer - 1 for layer in c.feature_layers]  # layer outputs (module docstring)
        return {
            **llama,
            "draft_vocab_size": c.draft_vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            **{k: v for k, v in norms.items() if v},
        }
    del llama["architectures"]
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": False,
        **norms,
        "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),  # the streams vLLM captures (module docstring)
        "transformer_layer_config": llama,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": ["LlamaForCausalLM"]},
        },
    }


def write_layout(head, out: str | os.PathLike, layout: str, target_config, target_name: str = "") -> Path:
    """Write the head into the folder ``out`` in ``layout`` (`LAYOUTS`): ``config.json`` and ``model.safetensors``,
    for a target of ``target_config``. Returns the folder."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    check_target(head.config, target_config)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: a published head is a folder (config.json and {WEIGHTS})")
    tensors = published_tensors(head, layout, target_config.vocab_size)
    config = published_config_dict(head, layout, target_config, target_name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _check_writable(head, layout: str) -> None:
    c = head.config
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if c.version != 3:
        raise ValueError(f"the {layout} layout holds EAGLE-3 heads; this head is EAGLE-{c.version}")
    if c.target_lm_head:
        raise ValueError(
            f"the {layout} layout holds a head with its own norm and LM head; this one draws its logits from the "
            "target's (draft_vocab_size 0)"
        )


def head_path_for(path: str | os.PathLike, model: str | os.PathLike | None) -> str | os.PathLike:
    """``path``, as a `HeadPath` with the layer count of the target ``model`` (`models.catalog.model_config`: its config
    alone is read) where the head is a published one whose config names no feature layers."""
    if not needs_target_layers(path):
        return path
    from ..models.catalog import model_config

    return HeadPath(path, model_config(model).num_layers)
