"""What the first GPU run would meet, caught on the CPU: the device a logged tensor is made on, which module an
evaluation moves, the dtypes of losses and teachers under 16-bit weights or bf16 autocast, FSDP2's mixed-precision
policy, TF32."""

import contextlib
from pathlib import Path

import pytest
import timm
import torch
from accelerate.utils import DistributedType
from helpers.builders import clip_batch, clip_model, objective_and_batch
from safetensors.torch import save_file

from ssl_vit.backbone import build_vit
from ssl_vit.data import SyntheticShapes
from ssl_vit.eval.features import extract_features
from ssl_vit.preprocess import Preprocess
from ssl_vit.train import strategy
from ssl_vit.train.strategy import compile_cache_dir, enable_tf32, fsdp2_mixed_precision, fused_optimizer
from ssl_vit.train.trainer import Meter, MicroSteps


class _DeepSpeedLike:
    """An accelerator as MicroSteps sees it under DeepSpeed, on a device other than the CPU ('meta'), whose
    `clip_grad_norm_` reports the norm as a Python float (accelerate's get_global_grad_norm)."""

    device = torch.device("meta")
    distributed_type = DistributedType.DEEPSPEED
    sync_gradients = True

    def accumulate(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        pass

    def clip_grad_norm_(self, parameters, max_norm):
        return 1.5


class _Engine(torch.nn.Module):
    def forward(self, batch):
        return {"loss": torch.zeros((), device="meta")}

    def was_step_applied(self):
        return True


def test_a_gradient_norm_reported_as_a_float_is_logged_on_the_device_of_the_losses():
    """Under DeepSpeed the norm is a Python float: made into a CPU tensor, it could not be stacked with CUDA losses
    at the first log step."""
    meter = Meter()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    micro = MicroSteps(_DeepSpeedLike(), _Engine(), optimizer, grad_clip=1.0, step=1, meter=meter)
    outputs = micro.step({})
    assert micro.applied and outputs["grad_norm"].device.type == "meta" and meter.sums["grad_norm"].is_meta


def test_feature_extraction_leaves_the_live_encoder_where_it_is(monkeypatch):
    """Periodic evaluation extracts features from the training encoder itself: it must not be moved (once it was
    moved to the CPU, and rank 0's next step failed on the GPU)."""
    encoder = build_vit("vit_test")
    moved = []
    monkeypatch.setattr(encoder, "to", lambda *args, **kwargs: moved.append((args, kwargs)) or encoder)
    views = Preprocess(16).view_builder()
    features, labels = extract_features(encoder, SyntheticShapes(8, 16), views, batch_size=4, progress=False)
    assert moved == [] and features.shape == (8, 32) and labels.shape == (8,)
    extract_features(encoder, SyntheticShapes(4, 16), views, device="cpu", progress=False)
    assert len(moved) == 1  # asked for: moved


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_image_text_logits_and_loss_are_fp32_under_bf16_weights_and_autocast(kind):
    """DeepSpeed's bf16 mode makes the towers' weights bf16; DDP / FSDP2 run the forward under bf16 autocast.
    Either way the normalised features, the scale and the loss are fp32, and the loss is what open_clip's loss
    gives on those fp32 features."""
    torch.manual_seed(0)
    model = clip_model(kind)
    batch = clip_batch(model)
    reference = model(batch)["loss"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_loss = model(batch)["loss"]
    model = model.bfloat16()
    bf16_loss = model(batch)["loss"]
    for loss in (autocast_loss, bf16_loss):
        assert loss.dtype == torch.float32
        assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=3e-2)  # bf16 towers, fp32 scoring
    image = model.encode_image(batch["image"], normalize=True)
    text = model.encode_text(batch["text"], normalize=True)
    scale, bias = model.scale_and_bias()
    assert image.dtype == text.dtype == scale.dtype == torch.float32
    expected = model.loss_fn(image, text, scale, bias) if kind == "siglip" else model.loss_fn(image, text, scale)
    assert float(bf16_loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)


def test_the_deit_teacher_runs_in_the_students_precision(tmp_path):
    """The teacher is fp32 and outside the trained model: where the student's weights are bf16 (DeepSpeed, no
    autocast) it runs under bf16 autocast, under DDP's autocast in it, and with fp32 weights alone in fp32."""
    path = tmp_path / "resnet10t.safetensors"
    save_file(timm.create_model("resnet10t", num_classes=8).state_dict(), str(path))
    objective, batch = objective_and_batch("objective=deit", f"objective.teacher=timm:resnet10t:{path}")
    seen = []
    objective.teacher.register_forward_hook(lambda module, args, out: seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    objective._teacher_logits(batch["image"])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # DDP / FSDP2: accelerate's autocast around the forward
        objective._teacher_logits(batch["image"])
    objective.backbone.bfloat16()
    logits = objective._teacher_logits(batch["image"])
    assert seen[0][0] is False and seen[1] == seen[2] == (True, torch.bfloat16) and logits.dtype == torch.float32


def test_fsdp2_reduces_gradients_in_fp32_and_leaves_the_loss_uncast():
    policy = fsdp2_mixed_precision()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert policy.output_dtype is None  # accelerate's default casts the loss dict to bf16


def test_tf32_is_enabled_on_cuda_only():
    before = torch.get_float32_matmul_precision()
    try:
        enable_tf32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == before == "highest"
        enable_tf32(torch.device("cuda"))  # sets the process-wide mode, no GPU needed
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_deepspeed_bf16_accumulates_gradients_in_fp32_unless_its_json_says_otherwise():
    """DeepSpeed's default accumulation dtype is the model's (bf16); a run's JSON may still choose."""
    from types import SimpleNamespace

    from ssl_vit.config import Precision
    from ssl_vit.train.strategy import StrategySettings, configure_deepspeed

    def configured(json: dict, precision: Precision) -> dict:
        plugin = SimpleNamespace(deepspeed_config=json, zero_stage=json.get("zero_optimization", {}).get("stage", 2))
        accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)
        configure_deepspeed(accelerator, StrategySettings(precision, micro_batch=4, grad_accum_steps=2))
        return json

    assert configured({"zero_optimization": {"stage": 2}}, Precision.bf16)["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in configured({"zero_optimization": {"stage": 2}}, Precision.fp32)
    kept = configured({"data_types": {"grad_accum_dtype": "bf16"}}, Precision.bf16)
    assert kept["data_types"] == {"grad_accum_dtype": "bf16"}


def test_fused_adamw_is_chosen_on_cuda_outside_deepspeed():
    def accelerator(device, kind):
        return type("Accelerator", (), {"device": torch.device(device), "distributed_type": kind})()

    assert fused_optimizer(accelerator("cuda", DistributedType.MULTI_GPU))
    assert fused_optimizer(accelerator("cuda", DistributedType.FSDP))
    assert not fused_optimizer(accelerator("cuda", DistributedType.DEEPSPEED))  # its engine steps its partitions
    assert not fused_optimizer(accelerator("cpu", DistributedType.MULTI_CPU))


def test_the_compile_cache_is_the_configured_one_else_the_users_else_under_the_run(monkeypatch, tmp_path):
    """A default that inductor wrote into the environment during an earlier run in this process is not a user's
    choice: the next run still caches under its own directory."""
    monkeypatch.setitem(strategy._USER_CACHES, "TORCHINDUCTOR_CACHE_DIR", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_default")
    assert compile_cache_dir(None, tmp_path) == tmp_path / "compile_cache"
    assert compile_cache_dir(str(tmp_path / "mine"), tmp_path) == tmp_path / "mine"
    monkeypatch.setitem(strategy._USER_CACHES, "TORCHINDUCTOR_CACHE_DIR", "/scratch/inductor")
    assert compile_cache_dir(None, tmp_path) == Path("/scratch/inductor")
