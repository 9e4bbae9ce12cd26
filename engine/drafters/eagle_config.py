"""An EAGLE head's configuration and the names and shapes of its weights (`eagle.EagleHead` runs them).

Kept apart from the head's module so the readers and writers of other layouts (`eagle_layouts`), which
`EagleHead.load` calls, need not import the head itself. `eagle` re-exports every name.
"""

from __future__ import annotations

import json

import attrs
import torch

from ..errors import ModelLoadError
from ..models.rope import rope_base_from_hf, rope_scaling
from ..weights.weights_gguf import decoder_layer_shapes

METADATA_KEY = "speccycle.eagle"
LM_HEAD_KEY = "speccycle.eagle.lm_head"  # "own" (EAGLE-3's reduced vocabulary) or "target" (the target's norm and head)
FEATURE_NORMS = ("concat", "per_layer")  # `EagleConfig.feature_norm`: one RMSNorm over [3H], or one per [H] part


@attrs.frozen
class EagleConfig:
    version: int  # 1 or 3
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    feature_layers: tuple[int, ...] = attrs.field(converter=tuple)  # target residual streams fed to the head
    # EAGLE-3 only: the size of the head's own LM head, or 0: logits from the target's final norm and LM head
    draft_vocab_size: int | None = None
    # decoder layers: the first reads the features (and, EAGLE-3, the embedding); the others are plain Llama layers
    num_layers: int = 1
    # EAGLE-3 only: None, or the RMSNorm of the features before fc (`FEATURE_NORMS`; `eagle`'s docstring)
    feature_norm: str | None = None
    # the vocabulary of the target the head was made for, where its file says (a published head's t2d); None: unknown
    target_vocab_size: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version {self.version} is not supported: choose 1 or 3")
        if self.version == 1 and len(self.feature_layers) != 1:
            raise ValueError("EAGLE-1 reads one feature layer (the target's final-norm input)")
        if self.version == 3 and len(self.feature_layers) != 3:
            raise ValueError("EAGLE-3 reads three feature layers")
        if self.version == 3 and (self.draft_vocab_size is None or self.draft_vocab_size < 0):
            raise ValueError(
                "EAGLE-3 needs draft_vocab_size: the size of its own LM head, or 0 for the target's LM head"
            )
        if self.num_layers < 1:
            raise ValueError(f"an EAGLE head has at least one decoder layer, not num_layers={self.num_layers}")
        if self.feature_norm is not None and (self.version != 3 or self.feature_norm not in FEATURE_NORMS):
            raise ValueError(
                f"feature_norm={self.feature_norm!r}: an EAGLE-3 head's features take None or one of {FEATURE_NORMS}"
            )

    @property
    def target_lm_head(self) -> bool:
        """Logits from the target's final norm and LM head (EAGLE-1; EAGLE-3 with ``draft_vocab_size == 0``)."""
        return self.version == 1 or self.draft_vocab_size == 0

    @classmethod
    def for_target(cls, target_config, version: int = 1, draft_vocab_size: int | None = None) -> EagleConfig:
        architecture = getattr(target_config, "architecture", "llama")
        if architecture != "llama":
            raise ValueError(f"EAGLE heads are built for Llama-architecture targets, not {architecture!r}")
        n = target_config.num_layers
        layers = (n,) if version == 1 else (2, n // 2, n - 3)  # low, middle, high, as EAGLE-3 picks them
        return cls(
            version=version,
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_heads=target_config.num_heads,
            num_kv_heads=target_config.num_kv_heads,
            head_dim=target_config.head_dim,
            rope_theta=target_config.rope_theta,
            rms_norm_eps=target_config.rms_norm_eps,
            feature_layers=layers,
            draft_vocab_size=draft_vocab_size if version == 3 else None,
        )


def file_metadata(config: EagleConfig) -> dict[str, str]:
    """The safetensors metadata of a head file: its config, and which LM head its logits come from."""
    fields = attrs.asdict(config)
    if config.num_layers == 1:  # one-layer files keep the metadata they had before the field existed
        del fields["num_layers"]
    for name in ("feature_norm", "target_vocab_size"):  # likewise files without them
        if fields[name] is None:
            del fields[name]
    fields["rope_theta"] = float(config.rope_theta)
    scaling = rope_scaling(config.rope_theta)
    if scaling is not None:
        fields["rope_scaling"] = scaling.to_hf()
    return {METADATA_KEY: json.dumps(fields), LM_HEAD_KEY: "target" if config.target_lm_head else "own"}


def config_from_metadata(text: str, source: str = "the head file") -> EagleConfig:
    """The `EagleConfig` of a file's ``speccycle.eagle`` metadata (`file_metadata`'s inverse)."""
    fields = json.loads(text)
    scaling = fields.pop("rope_scaling", None)
    if scaling is not None:
        fields["rope_theta"] = rope_base_from_hf({"rope_theta": fields["rope_theta"], "rope_scaling": scaling}, source)
    return EagleConfig(**fields)


def feature_norm_shapes(c: EagleConfig) -> dict[str, tuple[int, ...]]:
    """The weights of `EagleConfig.feature_norm` (none without one)."""
    if c.feature_norm == "concat":
        return {"feature_norm.weight": (len(c.feature_layers) * c.hidden_size,)}
    if c.feature_norm == "per_layer":
        return {f"feature_norm.{i}.weight": (c.hidden_size,) for i in range(len(c.feature_layers))}
    return {}


def normalize_features(features: torch.Tensor, c: EagleConfig, weight) -> torch.Tensor:
    """The features as ``fc`` reads them: ``features [..., 3H]`` through `EagleConfig.feature_norm` (unchanged
    without one). ``weight(name)``: the tensor of a `feature_norm_shapes` name."""
    if c.feature_norm is None:
        return features
    if c.feature_norm == "concat":
        return _rms_norm(features, weight("feature_norm.weight"), c.rms_norm_eps)
    parts = features.chunk(len(c.feature_layers), dim=-1)
    return torch.cat(
        [_rms_norm(part, weight(f"feature_norm.{i}.weight"), c.rms_norm_eps) for i, part in enumerate(parts)], -1
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`llama.RMSNorm`'s arithmetic (float32 inside, the input's dtype out) with a weight given per call."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def extra_layer_prefix(index: int) -> str:
    """Name prefix of decoder layer ``index >= 1`` (Hugging Face's layer names, as `llama.DecoderLayer` reads)."""
    return f"layers.{index}."


def _shapes(c: EagleConfig) -> dict[str, tuple[int, ...]]:
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    attn_in = 2 * h if c.version == 3 else h
    shapes = {
        "fc.weight": (h, 3 * h) if c.version == 3 else (h, 2 * h),
        "layer.q_proj.weight": (c.num_heads * d, attn_in),
        "layer.k_proj.weight": (c.num_kv_heads * d, attn_in),
        "layer.v_proj.weight": (c.num_kv_heads * d, attn_in),
        "layer.o_proj.weight": (h, c.num_heads * d),
        "layer.post_attention_layernorm.weight": (h,),
        "layer.gate_proj.weight": (i, h),
        "layer.up_proj.weight": (i, h),
        "layer.down_proj.weight": (h, i),
    }
    if c.version == 1:
        shapes["layer.input_layernorm.weight"] = (h,)
    else:
        shapes.update({"layer.embed_norm.weight": (h,), "layer.hidden_norm.weight": (h,)})
    for index in range(1, c.num_layers):
        shapes.update(decoder_layer_shapes(c, extra_layer_prefix(index)))
    shapes.update(feature_norm_shapes(c))
    if not c.target_lm_head:
        shapes.update(
            {"norm.weight": (h,), "lm_head.weight": (c.draft_vocab_size, h), "draft_to_target": (c.draft_vocab_size,)}
        )
    return shapes


def check_target(config: EagleConfig, target_config, source: str = "the EAGLE head") -> None:
    """Refuses, naming the key, a head made for another target: another hidden size (``fc.weight``), another
    vocabulary (`EagleConfig.target_vocab_size`, a published head's ``t2d``), features past its layers."""
    h, th = config.hidden_size, target_config.hidden_size
    if h != th:
        raise ModelLoadError(
            f"{source}: fc.weight projects features of hidden size {h}, the target's is {th}: not this target's head"
        )
    if config.target_vocab_size is not None and config.target_vocab_size != target_config.vocab_size:
        raise ModelLoadError(
            f"{source}: t2d covers a vocabulary of {config.target_vocab_size} tokens, the target's has "
            f"{target_config.vocab_size}: not this target's head"
        )
    if config.version == 3 and max(config.feature_layers) > target_config.num_layers:
        raise ModelLoadError(
            f"{source}: feature_layers {config.feature_layers} reach past the target's {target_config.num_layers} "
            "layers (eagle_aux_hidden_state_layer_ids in a published config): not this target's head"
        )
