"""The session's pool of 2-process runs: every objective x strategy that several tests compare (test_strategies,
test_compile, test_checkpoint's sharded resumes, test_preemption's signalled runs) is launched once, when a test
first asks for it, and shared. Keys are (objective, accelerate config); `pool[key]` is the run directory, with the
run's output in `<run>.log`.

Most runs are forked ranks (helpers.ranks: accelerate's launch environment without the launcher's start-up); CLIP's
under FSDP2 goes through the real `accelerate launch` (REAL_LAUNCHES), and test_strategies compares it with the
forked runs."""

from __future__ import annotations

from pathlib import Path

from helpers.processes import check_ok, launch
from helpers.ranks import pretrain_ranks

STRATEGIES = ["ddp_cpu2", "zero1_cpu2", "zero2_cpu2", "zero3_cpu2", "fsdp2_cpu2"]
SHARDED = {"zero3_cpu2", "fsdp2_cpu2"}  # parameters split across ranks
STEPS = ["data.batch_size=8", "data.num_samples=64", "trainer.max_steps=5", "trainer.log_every=1", "optim.lr=1e-3",
         "optim.lr_scaling=none",
         "optim.warmup_steps=2"]
EVAL = ["trainer.eval_every=5", "trainer.eval_evaluators=[knn]", "trainer.eval_max_samples=64",
        "trainer.checkpoint_every=3"]  # checkpoints at steps 3 and 5: the resume tests start from step 3
OBJECTIVES = {
    "masked_patch": ["objective=masked_patch"],
    "mae": ["objective=mae", "objective.decoder_dim=32", "objective.decoder_depth=1", "objective.decoder_heads=2"],
    # DINOv3: every DINOv2 part on (Sinkhorn-Knopp, KoLeo, iBOT), the heads' last layers held for 3 steps (their
    # gradients dropped, Adam started at step 4: the checkpoint at step 3 is of a held optimizer state), RoPE and
    # registers, and Gram anchoring from step 1 (a third sharded backbone, refreshed from the EMA teacher before
    # step 3: the resumed step), on 32 px Gram crops resized to the student's grid; the backbone with DINOv3 H+ /
    # 7B's SwiGLU MLP (the Gram teacher too)
    "dinov3": ["objective=dinov3_tiny", "objective.out_dim=64", "objective.ibot_out_dim=64",
               "objective.hidden_dim=32", "objective.bottleneck_dim=16", "objective.local_crops=2",
               "objective.freeze_last_layer_steps=3", "objective.gram_start=1", "objective.gram_warmup_steps=2",
               "objective.gram_update_every=2", "model.mlp_kind=swiglu", "model.act_layer=silu"],
    # the hybrid stem (its ResNet initialised on gathered weights under zero.Init) with DeiT's frozen timm teacher,
    # built whole outside the sharded model ({teacher}: a weights file the pool writes), with the recipe's data side
    # (RandAugment, Mixup / CutMix, repeated augmentation dealt across the ranks)
    "deit": ["objective=deit", "model=vit_tiny_r", "objective.teacher=timm:resnet10t:{teacher}",
             "data.augment=augreg"],
    # open_clip's text tower and ClipLoss across ranks, accumulation by cached features, zero-shot evaluation
    "clip": ["objective=clip_tiny", "objective.embed_dim=16", "objective.text_width=16", "objective.text_heads=2",
             "objective.text_layers=1", "objective.context_length=16", "data.batch_size=4",
             "trainer.grad_accum_steps=2", "trainer.eval_evaluators=[knn,zeroshot]"],
    # MoCo v3: an EMA momentum encoder, BatchNorm over the global batch (differentiable all-reduces in the forward),
    # keys gathered across ranks, a frozen patch projection inside the sharded model, and RoPE-ViT's mixed RoPE:
    # learned per-block frequencies (rope.freqs), sharded and averaged like every other weight.
    "mocov3": ["objective=mocov3_tiny", "objective.dim=16", "objective.mlp_dim=32", "model.pos_embed=rope",
               "model.rope_kind=mixed", "model.rope_theta=10"],
    # I-JEPA: an EMA target encoder that is the run's encoder, kept subsets of varying length drawn in the forward,
    # a predictor ViT with its own blocks (FSDP2 units), no class token (periodic evaluation on the patch average);
    # the encoder with Perception Encoder's position scheme: a learned table and axial RoPE together (indices offset
    # by 1 and rescaled from the 8 x 8 grid onto a 4 x 4 reference), a norm before the blocks.
    "ijepa": ["objective=ijepa_tiny", "data.img_size=32", "objective.predictor_dim=32", "objective.predictor_depth=1",
              "model.pos_embed=learned_rope", "model.rope_kind=axial", "model.rope_theta=10000",
              "model.rope_offset=1", "model.rope_ref_grid=[4,4]", "model.pre_norm=true"],
    # Multi-teacher distillation: two frozen teachers built whole outside the sharded model ({distill_teacher}: our
    # encoder file at another patch grid, 7 x 7 against the student's 8 x 8, of AIMv2's family (SwiGLU, RMSNorm, a
    # patch norm, no class token: DISTILL_TEACHER); {vit_teacher}: timm's ViT-Ti/16 at
    # 32 px, a 2 x 2 grid), their running feature statistics all-reduced over the ranks; under ZeRO-3 the first
    # teacher is itself sharded across the ranks for inference (FSDP2 inside a DeepSpeed run). A second student
    # (8 px patches, one block, twice the lr) learns from the same teacher forwards (DINOv3's multi-distillation),
    # sharded with the first, saved as students/small/.
    "distill": ["objective=distill_tiny", "objective.adaptor_hidden_dim=32",
                "objective.teachers=[{source: '{distill_teacher}', name: ours, img_size: 21}, "
                "{source: 'timm:vit_tiny_patch16_224:{vit_teacher}', name: vit, img_size: 32}]",
                "objective.students=[{name: small, model: vit_test, options: {patch_size: 8, depth: 1}, "
                "lr_scale: 2}]"],
    "supervised": ["objective=supervised"],
    # ViTDet's fine-tuning: a globally pre-trained 16 px encoder ({windowed_source}) continued at 48 px (a 12 x 12
    # grid) with windows of 5 (padded to 15), block 1 global and zero-initialised relative positions
    "windowed": ["objective=supervised", "model.init_from={windowed_source}", "data.img_size=48",
                 "model.window_size=5", "model.global_attn_indexes=[1]", "model.rel_pos=true"],
    # NaFlex batches (images at 3 aspect ratios, 4 sequence-length buckets, a batch size per bucket the same on
    # both ranks) with RoPE and a register (per-image tables, the key mask over the prefix); SigLIP's loss then
    # exchanges the ranks' text features (equal batch sizes on every rank at every step); SigLIP's image tower
    # with its MAP head, attending to each image's own patches
    "naflex_supervised": ["objective=supervised", "data.resolution=naflex", "data.aspect_ratios=[0.5,1,2]",
                          "model.pos_embed=rope", "model.num_registers=1"],
    "naflex_siglip": ["objective=siglip_tiny", "model=vit_test_siglip", "objective.embed_dim=16",
                      "objective.text_width=16", "objective.text_heads=2", "objective.text_layers=1",
                      "objective.context_length=16",
                      "data.resolution=naflex", "data.aspect_ratios=[0.5,1,2]", "data.naflex.loss_scale=sqrt"],
}
# The distillation runs' first teacher (its preset and sizes), also built by the tests that check it
DISTILL_TEACHER = ("vit_test_aimv2", dict(img_size=21, patch_size=3))
# CLIP (a second tower, a loss gathered across ranks, accumulation) under all five strategies; masked_patch under
# DDP (the reference of the ZeRO-2 non-finite, ZeRO-3 offload and bf16 tests; MAE and masked_patch ran under all
# five when the strategies landed, DINOv2 when it landed: DINOv3's runs cover its code now).
RUNS = [("clip", config) for config in STRATEGIES] + [("masked_patch", "ddp_cpu2")]
# The EMA-teacher objectives under DDP, ZeRO-2, ZeRO-3 and FSDP2. ZeRO-1 takes the same path as ZeRO-2 through
# ours (ssl_vit.train.strategy tells only stage 3 apart) and through DeepSpeed's (one stage-1-and-2 optimizer, which
# also partitions the gradients at stage 2): CLIP runs under both; DINOv3, MoCo v3 and I-JEPA ran under ZeRO-1 too
# until the suite was tiered.
RUNS += [(objective, config) for objective in ("dinov3", "mocov3", "ijepa") for config in STRATEGIES
         if config != "zero1_cpu2"]
# DeiT (its frozen teacher outside the sharded model, the hybrid's init under zero.Init) ran under all five when it
# landed; ZeRO-1/2 hold whole parameters as DDP does, so DDP, ZeRO-3 and FSDP2 are the ones that differ for it.
RUNS += [(objective, config) for objective in ("deit", "distill") for config in ("ddp_cpu2", "zero3_cpu2",
                                                                                 "fsdp2_cpu2")]
RUNS += [("supervised", "ddp_cpu2")]  # the eager reference of a compiled run (test_compile)
RUNS += [("masked_patch", "zero3_cpu2"), ("mae", "zero3_cpu2")]  # consolidated with their heads (test_checkpoint)
# The windowed fine-tune under DDP, ZeRO-3 and FSDP2, the last with its blocks compiled and checkpointed selectively
RUNS += [("windowed", config) for config in ("ddp_cpu2", "zero3_cpu2", "fsdp2_cpu2")]
# NaFlex batches under DDP, ZeRO-3 and FSDP2, the supervised FSDP2 run with compiled blocks
RUNS += [(objective, config) for objective in ("naflex_supervised", "naflex_siglip")
         for config in ("ddp_cpu2", "zero3_cpu2", "fsdp2_cpu2")]
PER_RUN = {("distill", "zero3_cpu2"): ["objective.teachers.0.shard=true"],
           ("naflex_supervised", "fsdp2_cpu2"): ["trainer.compile=true"],
           ("windowed", "fsdp2_cpu2"): ["trainer.compile=true", "model.grad_checkpointing=true",
                                        "model.checkpoint_policy=selective"]}
# CLIP under FSDP2 through the real launcher, the FSDP2 config file alone setting it up (CLIP ran under all five
# launched for real until the suite was tiered: the forked ranks get their environment from the same accelerate
# functions, and DDP and ZeRO-3 are launched for real by test_preemption, test_fault_injection and the two-machine
# test).
REAL_LAUNCHES = {("clip", "fsdp2_cpu2")}


def strategy_run(config: str, out: Path, *overrides: str, env: dict | None = None, timeout: float = 300):
    """scripts/pretrain.py on the ranks of configs/accelerate/<config>.yaml (forked: helpers.ranks), on vit_test
    unless a model= is given, 5 steps of 8 images."""
    model = [] if any(o.startswith("model=") for o in overrides) else ["model=vit_test"]
    return pretrain_ranks(*model, *STEPS, *overrides, f"hydra.run.dir={out}", config=config,
                          log_dir=out.parent / f"{out.name}.ranks", env=env, timeout=timeout)


def _fill(override: str, files: dict) -> str:
    """An override with its {name} placeholders replaced by the pool's files."""
    for name, path in files.items():
        override = override.replace("{" + name + "}", str(path))
    return override


class RunPool:
    """`pool[objective, config]`: that run's directory, launched the first time it is asked for."""

    def __init__(self, root: Path):
        self.root = root
        self._runs: dict[tuple[str, str], Path] = {}
        self._failed: set[tuple[str, str]] = set()
        self._files: dict[str, Path] | None = None

    def files(self) -> dict[str, Path]:
        """The teachers' weights the DeiT and distillation runs read, written once."""
        if self._files is None:
            import timm
            from safetensors.torch import save_file

            from ssl_vit.artifacts import save_encoder
            from ssl_vit.backbone import build_vit
            from ssl_vit.preprocess import Preprocess

            files = {"teacher": self.root / "resnet10t.safetensors",
                     "distill_teacher": self.root / "distill_teacher.safetensors",
                     "vit_teacher": self.root / "vit_tiny.safetensors",
                     "windowed_source": self.root / "windowed_source.safetensors"}
            save_encoder(build_vit("vit_test"), files["windowed_source"],
                         Preprocess(16, mean=[0.5] * 3, std=[0.25] * 3))
            save_file(timm.create_model("resnet10t", num_classes=8).state_dict(), str(files["teacher"]))
            save_encoder(build_vit(DISTILL_TEACHER[0], **DISTILL_TEACHER[1]), files["distill_teacher"],
                         Preprocess(21, mean=[0.5] * 3, std=[0.25] * 3))
            save_file(timm.create_model("vit_tiny_patch16_224", num_classes=0).state_dict(), str(files["vit_teacher"]))
            self._files = files
        return self._files

    def overrides(self, objective: str, config: str = "") -> list[str]:
        """The objective's overrides with the pool's files filled in."""
        needed = OBJECTIVES[objective] + PER_RUN.get((objective, config), [])
        files = self.files() if any("{" in o for o in needed) else {}
        return [_fill(o, files) for o in needed]

    def __getitem__(self, key: tuple[str, str]) -> Path:
        objective, config = key
        out = self.root / f"{objective}-{config}"
        # a run that failed is not launched again into its directory: every test that needs it fails on the
        # first failure, whose whole output stays in <run>.log
        assert key not in self._failed, f"the pool's run {key} failed earlier in this session; see {out}.log"
        if key not in self._runs:
            assert key in RUNS, f"{key} is not in the pool's RUNS"
            overrides = [*EVAL, *self.overrides(objective, config)]
            if key in REAL_LAUNCHES:  # the config file alone sets the strategy up (nothing in the environment)
                model = [] if any(o.startswith("model=") for o in overrides) else ["model=vit_test"]
                proc = launch(*model, *STEPS, *overrides, f"hydra.run.dir={out}", config=config,
                              env={"ACCELERATE_USE_CPU": None})
            else:
                proc = strategy_run(config, out, *overrides, env={"ACCELERATE_USE_CPU": None})
            Path(f"{out}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                self._failed.add(key)
            check_ok(proc)
            self._runs[key] = out
        return self._runs[key]

    def log(self, key: tuple[str, str]) -> str:
        return Path(f"{self[key]}.log").read_text()
