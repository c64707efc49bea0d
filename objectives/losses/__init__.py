"""The losses of self-distillation, one file per family (as dinov3's `loss/` and lightly's `loss/`): `dino` (the
image-level cross-entropy, centring, Sinkhorn-Knopp, the teacher temperature), `ibot` (masked patches), `koleo`,
`gram` (DINOv3's Gram anchoring)."""
