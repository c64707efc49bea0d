"""`VisionEncoder`: a pre-trained ViT as the image side of a vision-language model (LLaVA-style) or any downstream
model: loaded from any source, carrying its preprocessing, returning patch tokens from a chosen layer.

Layers are numbered as transformers' `hidden_states`: index 0 is the token sequence entering the blocks (after the
pre-norm of CLIP-style models), index i the output of block i (1-based), so with L blocks `layer=-1` is the last
block's output and `layer=-2` the output of block L-1 (0-based block L-2), both BEFORE the final norm: LLaVA's default
`vision_feature_layer=-2` is `hidden_states[-2]`, which is timm's `forward_intermediates(indices=[L-2])` (norm=False).
`layer=None` returns the final, normalised tokens (transformers' ViT / DINOv2 `last_hidden_state`; CLIP's comes
before its `post_layernorm`; average-pooled models, whose norm comes after pooling, give the last block's
output). `drop_prefix=True` drops the class token and registers (LLaVA's `vision_feature_select_strategy="default"`
drops index 0, the same without registers; Prismatic drops all prefix tokens).

    encoder = VisionEncoder.from_pretrained("outputs/<run>", layer=-2)       # or "hf:<dir>", "timm:...", ...
    pixels = encoder.preprocess([Image.open("cat.jpg")])                    # (1, 3, S, S), the encoder's transform
    tokens = encoder(pixels)                                                # (1, patches, D)
    projector = mlp_projector(encoder.hidden_size, 4096)                    # LLaVA-1.5's 2-layer MLP

NaFlex (SigLIP 2-style VLMs): `preprocess_naflex` resizes each image at its own aspect ratio to fit a patch budget
and packs them (ssl_vit.naflex); `forward` takes that batch as it takes pixels (padded tokens), and `token_sets`
gives each image's tokens with their (row, column) coordinates and grid, what a projector that merges neighbouring
patches (LFM2-VL's pixel unshuffle) consumes.

    batch = encoder.preprocess_naflex([Image.open("chart.png"), Image.open("photo.jpg")], seq_len=256)
    for tokens, coords, grid in encoder.token_sets(batch): ...               # (n_i, D), (n_i, 2), (h_i, w_i)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from ssl_vit.backbone import VisionTransformer
from ssl_vit.data.naflex import NaFlexEvalViews
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.naflex import batch_grids, is_naflex
from ssl_vit.preprocess import Preprocess


class VisionEncoder(nn.Module):
    def __init__(self, vit: VisionTransformer, preprocessing: Preprocess | None = None, layer: int | None = -2,
                 drop_prefix: bool = True):
        super().__init__()
        depth = len(vit.blocks)
        if layer is not None and not -(depth + 1) <= layer <= depth:
            raise ValueError(f"layer={layer} is out of range for {depth} blocks: valid are {-(depth + 1)}..{depth} "
                             "(hidden_states indices) or None (the final normalised tokens)")
        self.vit = vit
        self.preprocessing = preprocessing or Preprocess(img_size=int(vit.patch_embed.img_size[0]))
        self.layer, self.drop_prefix = layer, drop_prefix

    @classmethod
    def from_pretrained(cls, spec: str, layer: int | None = -2, drop_prefix: bool = True,
                        img_size: int | None = None) -> VisionEncoder:
        """Any source `ssl_vit.interop.sources` reads (ours, timm:, hf:, open_clip:), in eval mode; `img_size`
        resamples the position embeddings as the source library does."""
        source = load_pretrained(spec)
        preprocessing = source.preprocess or Preprocess(img_size=int(source.encoder.patch_embed.img_size[0]))
        if img_size is not None:
            preprocessing = dataclasses.replace(preprocessing, img_size=img_size)
        if preprocessing.img_size != source.encoder.patch_embed.img_size[0]:  # e.g. DINOv2: 518 native, 224 used
            source.encoder.set_img_size(preprocessing.img_size)
        return cls(source.encoder, preprocessing, layer, drop_prefix).eval()

    @property
    def hidden_size(self) -> int:
        return self.vit.embed_dim

    @property
    def num_patches(self) -> int:
        return self.vit.patch_embed.num_patches

    def preprocess(self, images) -> torch.Tensor:
        """PIL images, HWC uint8 arrays or CHW uint8 tensors -> (B, C, S, S): resize the shorter side, centre-crop,
        scale to [0, 1], normalise (the encoder's recorded eval transform; transformers' CLIPImageProcessor from
        our HF export gives the same pixels)."""
        views = self.preprocessing.view_builder(("image",))
        return torch.stack([views({"image": image})["image"] for image in _uint8_images(images)])

    def preprocess_naflex(self, images, seq_len: int | None = None) -> dict:
        """Images (as `preprocess` takes them) -> one NaFlex batch: each whole image resized at its own aspect ratio
        to its largest grid within `seq_len` patches (default: the patches of the recorded image size), scaled and
        normalised as `preprocess`, padded to `seq_len`."""
        views = NaFlexEvalViews.for_encoder(self.preprocessing, self.vit.patch_embed.patch_size[0], seq_len, ("image",))
        return views.stack_images([views({"image": image})["image"] for image in _uint8_images(images)])

    def hidden_states(self, pixel_values: torch.Tensor | dict, stop: int | None = None) -> list[torch.Tensor]:
        """[tokens entering the blocks, output of block 1, ..., output of block L]: transformers' hidden_states
        (up to index `stop` only: later blocks are not run); pixels or a NaFlex batch (its padding masked)."""
        x, placement = self.vit.embed_input(pixel_values)
        inputs = self.vit.block_inputs(placement)
        x = self.vit.norm_pre(x)
        states = [x]
        for block, rope, spatial, mask in inputs[:stop]:
            x = block(x, rope, grid=spatial, attn_mask=mask)
            states.append(x)
        return states

    def token_sets(self, batch: dict) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]]:
        """A NaFlex batch -> per image (its patch tokens (n_i, D) from `layer`, their (row, column) coordinates
        (n_i, 2), its grid (h_i, w_i)): the padding and the prefix tokens left out."""
        if not is_naflex(batch):
            raise ValueError("token_sets takes a NaFlex batch (preprocess_naflex); for pixels call the encoder")
        tokens = VisionEncoder(self.vit, self.preprocessing, self.layer, drop_prefix=True)(batch)
        valid, coords = batch["patch_valid"], batch["patch_coord"]
        return [(row[mask], coord[mask], grid)
                for row, mask, coord, grid in zip(tokens, valid, coords, batch_grids(batch), strict=True)]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.layer is None:
            tokens = self.vit.forward_features(pixel_values)
        else:
            tokens = self.hidden_states(pixel_values, stop=self.layer % (len(self.vit.blocks) + 1))[-1]
        return tokens[:, self.vit.num_prefix_tokens:] if self.drop_prefix else tokens


def _uint8_images(images) -> list[torch.Tensor]:
    """PIL images, HWC uint8 arrays or CHW uint8 tensors (one or a list) -> CHW uint8 tensors."""
    out = []
    for image in images if isinstance(images, (list, tuple)) else [images]:
        if not isinstance(image, torch.Tensor):
            array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
            image = torch.from_numpy(np.array(array, dtype=np.uint8)).permute(2, 0, 1)
        out.append(image)
    return out


def mlp_projector(vision_width: int, llm_width: int) -> nn.Sequential:
    """LLaVA-1.5's projector (`mlp2x_gelu`): Linear(vision, llm) -> GELU -> Linear(llm, llm), applied per token."""
    return nn.Sequential(nn.Linear(vision_width, llm_width), nn.GELU(), nn.Linear(llm_width, llm_width))
