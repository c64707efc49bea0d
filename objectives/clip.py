"""Image-text contrastive pre-training: CLIP (softmax over the global batch), SigLIP (pairwise sigmoid) and LiT
(a frozen image tower, only the text side trains), on open_clip's losses, tokenizer and text towers.

Image tower: our ViT with CLIP's extra norm before the blocks (`model.pre_norm`, on unless the model config says
false), pooled
as the model says (class token or average), then a linear projection to `embed_dim`. Text tower: open_clip's
`TextTransformer` built from the config (causal, argmax-token pooling; its bundled BPE tokenizer, offline), or a
transformers model (`text_tower=hf`: a local directory with weights and tokenizer, or a config with open_clip's
tokenizer) pooled by open_clip's `HFTextEncoder` (mean or CLS) and projected.

The logit scale is a shape-[1] parameter (DeepSpeed cannot partition 0-dim ones) initialised to ln(1/0.07) and
clamped inside the forward, exp(min(s, ln 100)): open_clip clamps the parameter after the optimizer step, which
under ZeRO-3 would write to an empty placeholder. The loss is open_clip's `ClipLoss(local_loss=True,
gather_with_grad=True)`: each rank scores its own rows against every rank's features, gathered with their
gradients, so the gradients are those of the global-batch loss (without local_loss they are scaled by the number of
processes). SigLIP: open_clip's `SigLipLoss` with its bias (ln 10 and -10 at init) and its neighbour exchange.

Gradient accumulation (`trainer.grad_accum_steps=k`, `micro_steps`): every one of the k micro-batches is first
embedded without gradients, then each is recomputed with gradients against the cached features of the others, so
every micro-step sees all k x B negatives and the summed gradients equal one step at batch k x B (plain accumulation
silently shrinks the set of negatives). This is open_clip's `accum_freq`, except that the logit scale and bias
receive 1/k of their gradient per micro-step, so they too get the big batch's gradient (open_clip gives them k
times it). With dropout the recomputed features differ from the cached ones (as in open_clip).
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch import nn

from ssl_vit.artifacts import ENCODER_FILE, read_metadata, read_preprocess
from ssl_vit.backbone import Block, ParallelBlock, VisionTransformer, ViTConfig
from ssl_vit.backbone.init import rng_devices, writable
from ssl_vit.extras import require
from ssl_vit.naflex import patch_valid
from ssl_vit.objectives.base import DataInfo, FixedBackbone, Objective, ObjectiveConfig, Requirements
from ssl_vit.schema import checked

TEXT_TOWERS = ("open_clip", "hf")
HF_POOLERS = ("mean_pooler", "cls_pooler", "max_pooler")
HF_PROJECTIONS = ("linear", "mlp")
SIGLIP_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


@dataclass
class CLIPConfig(ObjectiveConfig):
    name: str = "clip"
    embed_dim: int = checked(512, ge=1)  # the joint image-text embedding
    text_tower: str = checked("open_clip", choices=TEXT_TOWERS)
    context_length: int = checked(77, ge=2)  # tokens per caption (open_clip's BPE: start + 75 + end)
    # open_clip's TextTransformer (text_tower=open_clip)
    text_width: int = checked(512, ge=1)
    text_layers: int = checked(12, ge=1)
    text_heads: int = checked(8, ge=1)
    text_mlp_ratio: float = checked(4.0, gt=0)
    # transformers (text_tower=hf): a local directory (config, weights, tokenizer), or a config built from scratch
    # ({model_type: bert, hidden_size: 64, ...}) that uses open_clip's tokenizer (vocabulary 49,408, pad id 0)
    hf_model: str | None = None
    hf_config: Any = None  # a mapping (Any: a command-line dict replaces the default as a whole)
    hf_pooler: str = checked("mean_pooler", choices=HF_POOLERS)
    hf_proj: str = checked("linear", choices=HF_PROJECTIONS)
    init_logit_scale: float = math.log(1 / 0.07)
    max_logit_scale: float = math.log(100)
    init_logit_bias: float | None = None  # SigLIP: -10
    # how SigLIP exchanges text features across ranks (open_clip's dist_impl)
    siglip_dist_impl: str = checked("bidir", choices=SIGLIP_DIST_IMPLS)
    # LiT: a frozen image tower from an encoder file or run directory; the projection and the text side train
    lock_image: bool = False
    image_encoder: str | None = None
    # zero-shot prompts used by eval=zeroshot and trainer.eval_every for this objective; empty: the dataset's own
    templates: list[str] = field(default_factory=list)


@dataclass
class SigLIPConfig(CLIPConfig):
    name: str = "siglip"
    init_logit_scale: float = math.log(10)
    init_logit_bias: float | None = -10.0


class TextTokenizer:
    """str -> (context_length,) int64 token ids; a list of str -> (N, context_length). Picklable, for data workers
    (open_clip's SimpleTokenizer, or its HFTokenizer for a transformers directory)."""

    def __init__(self, context_length: int, hf_dir: str | None = None):
        self.context_length, self.hf_dir = context_length, hf_dir
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from open_clip.tokenizer import HFTokenizer, SimpleTokenizer  # heavy: image-text models only

            self._tokenizer = (HFTokenizer(self.hf_dir, context_length=self.context_length) if self.hf_dir
                               else SimpleTokenizer(context_length=self.context_length))
        return self._tokenizer

    def __call__(self, text: str | list[str]) -> torch.Tensor:
        tokens = self.tokenizer(text if isinstance(text, list) else [text])
        return tokens if isinstance(text, list) else tokens[0]

    def __getstate__(self):
        return {"context_length": self.context_length, "hf_dir": self.hf_dir, "_tokenizer": None}


class Projection(nn.Linear):
    """A bias-free linear map into the joint space, initialised as CLIP's: normal(std = in_features^-0.5)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.in_features ** -0.5)


def build_text_tower(cfg) -> nn.Module:
    """open_clip's TextTransformer (attention from its own Linear-free `Attention`, which ZeRO-3 can partition:
    `block_type="custom"`) or open_clip's HFTextEncoder around a transformers model."""
    if cfg.text_tower == "open_clip":
        from open_clip.transformer import TextTransformer  # heavy: image-text models only

        if cfg.text_width % cfg.text_heads:
            raise ValueError(f"objective.text_width={cfg.text_width} is not divisible by text_heads={cfg.text_heads}")
        seed = int(torch.randint(2**62, ()))
        # Its init pass runs at the end of its constructor, where zero.Init has already partitioned the layers (it
        # would see empty shards and draw nothing): run it again on the gathered weights, under a seed drawn before
        # construction, all forked, so that every strategy starts from the same weights and random stream.
        with torch.random.fork_rng(devices=rng_devices()):
            text = TextTransformer(context_length=cfg.context_length, width=cfg.text_width, heads=cfg.text_heads,
                                   layers=cfg.text_layers, mlp_ratio=cfg.text_mlp_ratio, output_dim=cfg.embed_dim,
                                   block_type="custom")
            with writable(*text.parameters()):
                torch.manual_seed(seed)
                text.init_parameters()
        return text
    require("transformers", "objective.text_tower=hf")
    from open_clip.hf_model import HFTextEncoder  # heavy: image-text models only
    from transformers import AutoConfig  # (the same)

    if bool(cfg.hf_model) == bool(cfg.hf_config):
        raise ValueError("text_tower=hf needs exactly one of objective.hf_model (a local transformers directory) and "
                         "objective.hf_config (e.g. {model_type: bert, hidden_size: 64, num_hidden_layers: 2, "
                         "num_attention_heads: 2, intermediate_size: 256})")
    if cfg.hf_model:
        if not Path(cfg.hf_model).is_dir():
            raise ValueError(f"objective.hf_model={cfg.hf_model!r} is not a directory (no model hub here)")
        text = HFTextEncoder(cfg.hf_model, cfg.embed_dim, pooler_type=cfg.hf_pooler, proj_type=cfg.hf_proj,
                             pretrained=True)
    else:
        if not hasattr(cfg.hf_config, "keys"):
            raise ValueError(f"objective.hf_config must be a mapping like {{model_type: bert, hidden_size: 64}}, got "
                             f"{cfg.hf_config!r}")
        settings = dict(cfg.hf_config)
        model_type = settings.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"objective.hf_config needs a model_type (e.g. bert), got {dict(cfg.hf_config)}")
        settings = {"vocab_size": 49408, "pad_token_id": 0, "max_position_embeddings": cfg.context_length,
                    **settings}
        text = HFTextEncoder(None, cfg.embed_dim, config=AutoConfig.for_model(model_type, **settings),
                             pooler_type=cfg.hf_pooler, proj_type=cfg.hf_proj)
    if cfg.hf_pooler != "cls_pooler" and getattr(text.transformer, "pooler", None) is not None:
        text.transformer.pooler = None  # unused: its parameters would never get a gradient
    return text


def share_gradient(value: torch.Tensor | None, parts: int) -> torch.Tensor | None:
    """`value` unchanged, with 1/parts of its gradient (a parameter used in each of `parts` micro-steps whose
    gradients add up to one step's)."""
    if value is None or parts == 1:
        return value
    return value.detach() + (value - value.detach()) / parts


def encoder_file(spec: str) -> Path:
    """An encoder file, or a run directory's encoder.safetensors (objective.image_encoder)."""
    path = Path(spec).expanduser()
    path = path / ENCODER_FILE if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"objective.image_encoder={spec!r} is not an encoder file or a run directory with "
                         "encoder.safetensors")
    return path


class CLIP(Objective):
    config_class: ClassVar[type[ObjectiveConfig]] = CLIPConfig
    # CLIP's norm before the blocks (and no patch-embedding bias)
    needs = Requirements(views=("image", "text"), image_text=True, naflex=True, model_defaults={"pre_norm": True})
    saved_heads = ("image_proj.", "text.", "logit_scale", "logit_bias")
    loss_name = "clip"

    def __init__(self, backbone: VisionTransformer, cfg, data: DataInfo):
        super().__init__(backbone, cfg, data)
        self.image_proj = Projection(backbone.embed_dim, cfg.embed_dim)
        self.text = build_text_tower(cfg)
        self.logit_scale = nn.Parameter(torch.full([1], float(cfg.init_logit_scale)))
        self.logit_bias = (nn.Parameter(torch.full([1], float(cfg.init_logit_bias)))
                           if cfg.init_logit_bias is not None else None)
        if cfg.lock_image:
            self._lock_image(cfg)
        elif cfg.image_encoder:
            raise ValueError("objective.image_encoder is read only with objective.lock_image=true (LiT)")
        self._loss = None
        self._cache: tuple[list[dict], int] | None = None  # (every micro-batch's features, this one's index)
        self._embed_only = False

    def _lock_image(self, cfg) -> None:
        if not cfg.image_encoder:
            raise ValueError("objective.lock_image=true (LiT) needs objective.image_encoder=<encoder.safetensors or "
                             "a run directory>")
        path = encoder_file(cfg.image_encoder)
        state = load_file(str(path))
        theirs = ViTConfig.from_dict(json.loads(read_metadata(path)["model"]), where=str(path)).to_dict()
        ours = self.backbone.config.to_dict()
        differ = {k: (theirs[k], ours[k]) for k in theirs
                  if k not in ("drop_path", "attn_drop", "proj_drop") and theirs[k] != ours[k]}
        if differ:
            raise ValueError(f"objective.image_encoder={cfg.image_encoder!r} was built with other settings than "
                             f"model=... here (key: (encoder's, this run's)): {differ}; choose the model and "
                             "data.img_size it was trained with")
        with writable(*self.backbone.parameters()):
            self.backbone.load_state_dict(state)
        self.backbone.requires_grad_(False)

    @classmethod
    def requirements(cls, cfg) -> Requirements:
        """LiT (a locked image tower): the tower's own architecture and preprocessing, whatever `model=` says."""
        if not cfg.lock_image or not cfg.image_encoder:
            return cls.needs
        path = encoder_file(cfg.image_encoder)
        config = ViTConfig.from_dict(json.loads(read_metadata(path)["model"]), where=str(path))
        return replace(cls.needs, fixed_backbone=FixedBackbone(config, read_preprocess(path)),
                       init_from="the locked image tower (objective.image_encoder) is the encoder already; use one")

    @classmethod
    def rebuild_config(cls, cfg):
        """The locked tower's weights are in the artifacts: do not read objective.image_encoder again."""
        return OmegaConf.merge(OmegaConf.structured(cls.config_class), cfg, {"lock_image": False,
                                                                            "image_encoder": None})

    def train(self, mode: bool = True):
        super().train(mode)
        if self.cfg.lock_image:
            self.backbone.eval()  # a locked tower runs as at inference (no dropout / stochastic depth)
        return self

    def text_tokenizer(self) -> TextTokenizer:
        return TextTokenizer(self.cfg.context_length, self.cfg.hf_model if self.cfg.text_tower == "hf" else None)

    @property
    def zeroshot_templates(self) -> list[str]:
        """This model's zero-shot prompts (objective.templates); empty: the dataset's own."""
        return list(self.cfg.templates)

    @property
    def _no_split_modules(self) -> list[str]:
        """FSDP2 shards each transformer block of both towers as one unit."""
        from open_clip.transformer import CustomResidualAttentionBlock  # heavy: image-text models only

        names = {type(m).__name__ for m in self.modules() if isinstance(m, (Block, ParallelBlock,
                                                                            CustomResidualAttentionBlock))}
        hf = getattr(getattr(self.text, "transformer", None), "_no_split_modules", None) or []
        return sorted(names | set(hf))

    @property
    def loss_fn(self) -> nn.Module:
        """open_clip's loss, for this process's rank in the group (built at first use: the group exists then)."""
        if self._loss is None:
            from open_clip.loss import ClipLoss, SigLipLoss  # heavy: image-text models only

            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if distributed else 0
            world = torch.distributed.get_world_size() if distributed else 1
            self._loss = (SigLipLoss(rank=rank, world_size=world, dist_impl=self.cfg.siglip_dist_impl)
                          if self.loss_name == "siglip" else
                          ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world))
        return self._loss

    def encode_image(self, images: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """Image embeddings (of images or a NaFlex batch); normalised ones in fp32 (the logits and the loss are
        computed in fp32)."""
        features = self.image_proj(self.backbone.pool(self.backbone.forward_features(images), patch_valid(images)))
        return F.normalize(features.float(), dim=-1) if normalize else features

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = self.text(tokens)
        return F.normalize(features.float(), dim=-1) if normalize else features

    def scale_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """exp(clamp(s, max=max_logit_scale)) (clamped here, not in the parameter: see the module docstring) and the
        bias (SigLIP) or None, in fp32."""
        bias = self.logit_bias.float() if self.logit_bias is not None else None
        return self.logit_scale.float().clamp(max=self.cfg.max_logit_scale).exp(), bias

    def micro_steps(self, micro_batches: list[dict], engine) -> None:
        """Accumulation with the feature cache (see the module docstring): each micro-step's loss is the whole
        accumulated batch's, its backward only this micro-batch's share, so it is not averaged over the micro-steps
        (accelerate divides by their number: loss_scale restores it)."""
        if len(micro_batches) == 1:
            return super().micro_steps(micro_batches, engine)
        with torch.no_grad(), self._scored(embed_only=True):
            cached = [engine.forward(batch) for batch in micro_batches]
        for index, batch in enumerate(micro_batches):
            with self._scored(cache=(cached, index)):
                engine.step(batch, loss_scale=len(micro_batches))

    @contextmanager
    def _scored(self, cache: tuple[list[dict], int] | None = None, embed_only: bool = False):
        """Inside: `forward` returns the features only (embed_only), or scores against the cached features of every
        micro-batch with this one's (cache = (features, index)) recomputed with gradients."""
        self._cache, self._embed_only = cache, embed_only
        try:
            yield
        finally:
            self._cache, self._embed_only = None, False

    def forward(self, batch: dict) -> dict[str, torch.Tensor]:
        image = self.encode_image(batch["image"], normalize=True)
        text = self.encode_text(batch["text"], normalize=True)
        if self._embed_only:
            return {"image": image, "text": text}
        scale, bias = self.scale_and_bias()
        if self._cache is not None:
            cached, index = self._cache
            image = torch.cat([image if j == index else c["image"] for j, c in enumerate(cached)])
            text = torch.cat([text if j == index else c["text"] for j, c in enumerate(cached)])
            scale, bias = share_gradient(scale, len(cached)), share_gradient(bias, len(cached))
        with torch.autocast(image.device.type, enabled=False):  # fp32 logits and loss, also under bf16 autocast
            loss = self.loss_fn(image, text, scale, bias) if self.loss_name == "siglip" else \
                self.loss_fn(image, text, scale)
        with torch.no_grad():
            logits = image @ text.T
            targets = torch.arange(len(image), device=image.device)
            metrics = {"logit_scale": scale.detach().reshape(()),
                       "i2t_accuracy": (logits.argmax(dim=1) == targets).float().mean(),
                       "t2i_accuracy": (logits.argmax(dim=0) == targets).float().mean()}
            if bias is not None:  # copied here, inside the forward: fp32 `.float()` is the parameter itself, whose
                # unsharded storage FSDP2 frees when the forward returns (a later read: SIGSEGV); too late after it
                metrics["logit_bias"] = bias.detach().clone().reshape(())
        return {"loss": loss, **metrics}


class SigLIP(CLIP):
    config_class: ClassVar[type[ObjectiveConfig]] = SigLIPConfig
    loss_name = "siglip"
