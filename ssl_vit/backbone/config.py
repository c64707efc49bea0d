"""`ViTConfig`: every setting of a `VisionTransformer`, in one frozen dataclass.

The one description of the backbone: presets are partial dicts of it (ssl_vit.backbone.presets), the Hydra schema's
`model.*` overrides are made from its fields (ssl_vit.config.ModelConfig), interop reads and writes it, and a saved
encoder's metadata is its `to_dict()`. Frozen: a built model's config is never changed in place; a model changed
after building (`set_img_size`) gets a new config by `replace`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from ssl_vit.backbone.init import WEIGHT_INITS
from ssl_vit.backbone.rope import ROPE_KINDS, ROPE_NORMALIZATIONS
from ssl_vit.backbone.stem import STEMS
from ssl_vit.schema import ConfigError, check_fields, checked, closest_names

# token: the class token; avg: the mean of the patch tokens; map: attention pooling by a learned query
# (SigLIP's MAP head, Perception Encoder's attention pool; ssl_vit.backbone.pooling)
GLOBAL_POOLS = ("token", "avg", "map")
# Interpolation modes for resampling position embeddings to a new grid (the ones F.interpolate can antialias).
# Conventions differ: timm resamples bicubic with antialiasing (its `resample_abs_pos_embed` default); DINOv2 and HF
# transformers resample bicubic without it; FlexiViT / RADIO bilinear without it.
POS_EMBED_INTERP_MODES = ("bicubic", "bilinear")
# learned: added, trained (the paper); sincos: MAE's fixed 2-D sin-cos, added, not trained; rope: DINOv3's rotary
# embeddings inside attention (ssl_vit.backbone.rope), nothing added; learned_rope: both, a learned table added and
# rotary embeddings inside attention (Perception Encoder); none: no position information
POS_EMBEDS = ("learned", "sincos", "rope", "learned_rope", "none")
# MLP activations: exact GELU (the paper, timm, DINOv2, HF "gelu"), tanh-approximated GELU (SigLIP, HF
# "gelu_pytorch_tanh"), QuickGELU x * sigmoid(1.702 x) (OpenAI's CLIP weights, HF "quick_gelu"), SiLU (the gate of
# SwiGLU MLPs: DINOv2-g, DINOv3 H+ / 7B, AIMv2).
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "silu")
# The blocks' feed-forward network (ssl_vit.backbone.mlp): the paper's MLP, SwiGLU with separate gate and value
# projections (timm's SwiGLU), or packed in one (timm's SwiGLUPacked, DINOv2's SwiGLUFFNFused)
MLP_KINDS = ("mlp", "swiglu", "swiglu_packed")
NORM_LAYERS = ("layernorm", "rmsnorm")  # RMSNorm (AIMv2): x / rms(x) x weight, no bias, no mean


@dataclass(frozen=True)
class ViTConfig:
    """A ViT's architecture and regularisation; lists are held as tuples (`to_dict` gives lists)."""

    img_size: int | tuple[int, int] = 224
    patch_size: int | tuple[int, int] = 16
    in_chans: int = checked(3, ge=1)
    num_classes: int = checked(0, ge=0)  # 0: an encoder whose forward returns the pooled embedding
    embed_dim: int = checked(768, ge=1)
    depth: int = checked(12, ge=1)
    num_heads: int = checked(12, ge=1)
    mlp_ratio: float = checked(4.0, gt=0)
    mlp_dim: int | None = checked(None, ge=1)  # None: embed_dim x mlp_ratio; SwiGLU: the gated (fc2 input) width
    mlp_kind: str = checked("mlp", choices=MLP_KINDS)
    class_token: bool = True
    global_pool: str = checked("token", choices=GLOBAL_POOLS)
    # The final norm after pooling (timm's fc_norm; None: with avg pooling only, as timm). AIMv2: false (the
    # final norm on every token, then the average)
    fc_norm: bool | None = None
    pool_heads: int | None = checked(None, ge=1)  # global_pool=map: its attention heads (None: num_heads; PE: 8)
    pool_mlp_dim: int | None = checked(None, ge=1)  # global_pool=map: its MLP width (None: the blocks' MLP width)
    # global_pool=map: the pool attends over the prefix tokens too (timm's pool_include_prefix; Perception Encoder:
    # the class token and the patches), not the patches alone (SigLIP)
    pool_include_prefix: bool = False
    dist_token: bool = False  # DeiT's distillation token (objective=deit turns it on)
    num_registers: int = checked(0, ge=0)
    # learned | sincos | rope | none (POS_EMBEDS). rope: DINOv3's 2-D rotary embeddings (ssl_vit.backbone.rope):
    # periods rope_theta ** (2i / (D/2)) (DINOv3: 100) or log-spaced in [rope_min_period, rope_max_period],
    # coordinates over each side (rope_normalize separate | min | max) and moved while training by rope_shift,
    # rope_jitter, rope_rescale (DINOv3's shift / jitter / rescale; None: off). rope_kind: dinov3 (that) | axial |
    # mixed (RoPE-ViT's variants as timm has them: patch-index coordinates; mixed learns its frequencies).
    # axial only: rope_offset is added to every patch index and rope_ref_grid (rows, cols) rescales the indices of
    # any grid onto it, index x ref / size (EVA's and Perception Encoder's scheme: timm's grid_offset, ref_feat_shape)
    pos_embed: str = checked("learned", choices=POS_EMBEDS)
    rope_theta: float | None = checked(None, gt=0)
    rope_min_period: float | None = checked(None, gt=0)
    rope_max_period: float | None = checked(None, gt=0)
    rope_normalize: str = checked("separate", choices=ROPE_NORMALIZATIONS)
    rope_shift: float | None = checked(None, ge=0)
    rope_jitter: float | None = checked(None, ge=1)
    rope_rescale: float | None = checked(None, ge=1)
    rope_kind: str = checked("dinov3", choices=ROPE_KINDS)
    rope_offset: float = 0.0
    rope_ref_grid: tuple[int, int] | None = checked(None, ge=1)
    no_embed_class: bool = False  # the prefix tokens get no position embedding (timm's no_embed_class)
    pos_embed_interp: str = checked("bicubic", choices=POS_EMBED_INTERP_MODES)  # resampling to another grid
    pos_embed_antialias: bool = True  # timm antialiases (default); DINOv2 / HF transformers do not
    qkv_bias: bool = True
    proj_bias: bool = True  # biases of the attention output and the MLP projections (timm's proj_bias; AIMv2: none)
    qk_norm: bool = False
    norm_layer: str = checked("layernorm", choices=NORM_LAYERS)
    norm_bias: bool = True  # LayerNorm biases (RMSNorm has none)
    norm_eps: float = checked(1e-6, gt=0)
    pre_norm: bool = False  # CLIP's LayerNorm before the blocks
    patch_bias: bool | None = None  # the patch projection's bias (None: without pre_norm, as timm and CLIP)
    patch_norm: bool = False  # a norm after the patch projection (timm's embed_norm_layer: AIMv2)
    parallel_block: bool = False  # ViT-22B's parallel attention + MLP
    layer_scale: float | None = None  # the initial value of CaiT / DINOv2's per-channel residual scales
    drop_path: float = checked(0.0, ge=0, lt=1)
    attn_drop: float = checked(0.0, ge=0, lt=1)
    proj_drop: float = checked(0.0, ge=0, lt=1)
    weight_init: str = checked("timm", choices=WEIGHT_INITS)  # ssl_vit.backbone.init
    act_layer: str = checked("gelu", choices=ACTIVATIONS)
    # Hybrid (ssl_vit.backbone.stem): stem=resnet takes tokens from a ResNet-v2 feature map; stem_layers = blocks per
    # stage (R50 hybrid: [3, 4, 9], stride 16), stem_channels = stage widths (None: ResNet's 256, 512, ...),
    # stem_width = the 7x7 stem conv's width.
    stem: str = checked("patch", choices=STEMS)
    stem_layers: tuple[int, ...] = checked((3, 4, 9), ge=1)
    stem_channels: tuple[int, ...] | None = checked(None, ge=1)
    stem_width: int = checked(64, ge=1)
    # ViTDet / SAM (ssl_vit.backbone.windows): attention within window_size x window_size squares of the patch grid in
    # every block but those global_attn_indexes names (SAM ViT-B: 14, [2, 5, 8, 11]); rel_pos: decomposed
    # relative-position tables per block, zero at the start (a bias to SDPA). Pre-training needs none of it: windows
    # are for running a pre-trained encoder at high resolution.
    window_size: int = checked(0, ge=0)
    global_attn_indexes: tuple[int, ...] = checked((), ge=0)
    rel_pos: bool = False
    neck_channels: int = checked(0, ge=0)  # SAM's convolutional neck over the last patch map; 0: none

    def __post_init__(self):
        for name in ("img_size", "patch_size", "stem_layers", "stem_channels", "global_attn_indexes", "rope_ref_grid"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, int):  # a list, tuple or ListConfig
                object.__setattr__(self, name, tuple(int(v) for v in value))
        for spec in fields(self):
            choices, value = spec.metadata.get("choices"), getattr(self, spec.name)
            if choices is not None and value not in choices:
                raise ConfigError(f"{spec.name} {value!r} is not one of {list(choices)}")
        check_fields(self)  # the bounds
        if self.global_pool == "token" and not self.class_token:
            raise ConfigError("global_pool='token' needs class_token=True; use global_pool='avg' without one")
        if self.dist_token and not (self.class_token and self.global_pool == "token"):
            raise ConfigError("dist_token=True (DeiT) needs class_token=True and global_pool='token'")
        if self.parallel_block and self.mlp_kind != "mlp":
            raise ConfigError(f"mlp_kind={self.mlp_kind!r} with parallel_block=True: ViT-22B's parallel block fuses "
                              "the plain MLP's input projection with QKV; SwiGLU parallel blocks are not built")
        if self.global_pool != "map" and (self.pool_heads is not None or self.pool_mlp_dim is not None
                                          or self.pool_include_prefix):
            raise ConfigError(f"pool_heads / pool_mlp_dim / pool_include_prefix set the attention pool of "
                              f"global_pool='map', not global_pool={self.global_pool!r}")
        if (self.rope_offset or self.rope_ref_grid is not None) and not (self.has_rope and self.rope_kind == "axial"):
            raise ConfigError(f"rope_offset={self.rope_offset} / rope_ref_grid={self.rope_ref_grid} place the patch "
                              f"indices of rope_kind='axial' (with pos_embed rope or learned_rope), not pos_embed="
                              f"{self.pos_embed!r}, rope_kind={self.rope_kind!r}")
        if self.rope_ref_grid is not None and len(self.rope_ref_grid) != 2:
            raise ConfigError(f"rope_ref_grid is (rows, cols), got {list(self.rope_ref_grid)}")

    @classmethod
    def from_dict(cls, values: dict, where: str = "the model config") -> ViTConfig:
        """From plain values (a saved encoder's metadata, a preset with overrides); keys a backbone lacks are
        refused by name (a file from a newer ssl-vit), missing ones take their defaults (an older file)."""
        known = {f.name for f in fields(cls)}
        unknown = [key for key in values if key not in known]
        if unknown:
            raise ConfigError(f"{where} has {unknown[0]!r}, which this ssl-vit's backbone does not know"
                              + closest_names(unknown[0], sorted(known), ""))
        return cls(**values)

    def replace(self, **changes) -> ViTConfig:
        """A copy with `changes` (validated as a new config)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-ready values (tuples as lists)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: mlp_dim, else embed_dim x mlp_ratio."""
        return self.mlp_dim or int(self.embed_dim * self.mlp_ratio)

    def beyond_classic(self) -> list[str]:
        """The options of the 2024-26 families set here, as "key=value" (SwiGLU, RMSNorm, a MAP head, no output
        biases, a patch norm, the final norm moved): what a target that holds only the classic ViT block refuses."""
        return [f"{key}={getattr(self, key)!r}" for key, classic in (
            ("mlp_kind", "mlp"), ("norm_layer", "layernorm"), ("proj_bias", True), ("patch_norm", False),
            ("has_fc_norm", self.global_pool == "avg")) if getattr(self, key) != classic] + (
            ["global_pool='map'"] if self.global_pool == "map" else [])

    @property
    def has_rope(self) -> bool:
        """Rotary embeddings inside attention (pos_embed rope or learned_rope)."""
        return self.pos_embed in ("rope", "learned_rope")

    @property
    def has_pos_table(self) -> bool:
        """A position table added to the tokens (pos_embed learned, sincos or learned_rope)."""
        return self.pos_embed in ("learned", "sincos", "learned_rope")

    @property
    def has_patch_bias(self) -> bool:
        return (not self.pre_norm) if self.patch_bias is None else self.patch_bias

    @property
    def has_fc_norm(self) -> bool:
        """Whether the final norm comes after pooling (and not on the tokens before)."""
        return (self.global_pool == "avg") if self.fc_norm is None else self.fc_norm

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + int(self.dist_token) + self.num_registers
