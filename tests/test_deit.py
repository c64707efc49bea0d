"""DeiT: the teacher is frozen and never saved; hard targets are the teacher's argmax, soft distillation is DeiT's
formula; inference averages the two heads (as timm's distilled DeiT with the same weights); teachers from timm files
and from a supervised run of this framework; bad teachers are named."""

import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import ROOT, check_ok, pretrain_in_process, read_metrics
from helpers.builders import objective_and_batch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

from ssl_vit.artifacts import load_encoder
from ssl_vit.backbone import VisionTransformer
from ssl_vit.cli import register_configs
from ssl_vit.objectives.teacher import load_teacher
from ssl_vit.schema import ConfigError

NUM_CLASSES = 8  # data=synthetic's shapes


@pytest.fixture(scope="module")
def timm_teacher(tmp_path_factory):
    """A timm CNN with 8 classes saved as a local weights file (random weights: the invariants do not need a good
    teacher)."""
    path = tmp_path_factory.mktemp("teacher") / "resnet10t.safetensors"
    torch.manual_seed(1)
    save_file(timm.create_model("resnet10t", num_classes=NUM_CLASSES).state_dict(), str(path))
    return f"timm:resnet10t:{path}"


def test_the_teacher_gets_no_gradient_stays_in_eval_mode_and_is_outside_the_module_tree(timm_teacher):
    objective, batch = objective_and_batch("objective=deit", f"objective.teacher={timm_teacher}")
    teacher = objective.teacher
    for head in (objective.head, objective.head_dist):  # default head_init=torch: nn.Linear's U(+-1/sqrt(fan_in))
        bound = 1 / head.in_features ** 0.5
        assert head.weight.abs().max() <= bound and head.bias.abs().max() <= bound and head.bias.any()
        assert float(head.weight.detach().std()) == pytest.approx(bound / 3 ** 0.5, rel=0.1)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    optimizer = torch.optim.SGD(objective.parameters(), lr=0.1)
    objective.train()
    objective(batch)["loss"].backward()
    optimizer.step()
    assert not teacher.training and all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    # nothing of the teacher is a parameter, buffer or state-dict entry of the trained model
    teacher_ids = {id(t) for t in [*teacher.parameters(), *teacher.buffers()]}
    assert not teacher_ids & {id(t) for t in [*objective.parameters(), *objective.buffers()]}
    assert all(k.startswith(("backbone.", "head.", "head_dist.")) for k in objective.state_dict())
    assert objective.backbone.dist_token is not None  # objective=deit turns the token on
    zero_heads, _ = objective_and_batch("objective=deit", f"objective.teacher={timm_teacher}",
                                        "objective.head_init=auto")
    assert not zero_heads.head.weight.any() and not zero_heads.head_dist.weight.any()  # auto: vit_test's jax, zero


def test_hard_targets_are_the_teachers_argmax_and_soft_is_deits_formula(timm_teacher):
    objective, batch = objective_and_batch("objective=deit", f"objective.teacher={timm_teacher}")
    objective.eval()  # no dropout: the two forward passes below see the same network
    images, labels = batch["image"], batch["label"]
    with torch.no_grad():
        tokens = objective.backbone.forward_features(images)
        cls_logits, dist_logits = objective.head(tokens[:, 0]), objective.head_dist(tokens[:, 1])
        teacher = objective.teacher(images)
        targets = teacher.argmax(dim=-1)
        out = objective(batch)
    expected = 0.5 * F.cross_entropy(cls_logits, labels) + 0.5 * F.cross_entropy(dist_logits, targets)
    torch.testing.assert_close(out["loss"], expected)
    assert out["teacher_agreement"] == (dist_logits.argmax(-1) == targets).float().mean()

    objective.cfg.distillation, objective.cfg.tau, objective.cfg.alpha = "soft", 3.0, 0.25
    with torch.no_grad():
        out = objective(batch)
    tau = 3.0
    p_teacher = (teacher / tau).softmax(-1)
    kl = (p_teacher * (p_teacher.log() - (dist_logits / tau).log_softmax(-1))).sum()
    expected = 0.75 * F.cross_entropy(cls_logits, labels) + 0.25 * kl * tau**2 / dist_logits.numel()
    torch.testing.assert_close(out["loss"], expected)


def test_inference_averages_the_two_heads_as_timms_distilled_deit(timm_teacher):
    objective, batch = objective_and_batch("objective=deit", f"objective.teacher={timm_teacher}")
    objective.eval()
    with torch.no_grad():
        for p in objective.parameters():
            p.normal_(0, 0.1)  # every weight random, the zero-initialised heads too
        config = objective.backbone.config.replace(num_classes=NUM_CLASSES)
        theirs = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=16, patch_size=4,
                                   embed_dim=32, depth=2, num_heads=2, num_classes=NUM_CLASSES).eval()
        state = {k.removeprefix("backbone."): v for k, v in objective.state_dict().items()}
        theirs.load_state_dict(state, strict=True)  # timm's names, the heads included
        images = batch["image"]
        tokens = objective.backbone.forward_features(images)
        averaged = (objective.head(tokens[:, 0]) + objective.head_dist(tokens[:, 1])) / 2
        torch.testing.assert_close(objective.predict(images), averaged)
        torch.testing.assert_close(objective.predict(images), theirs(images), atol=1e-5, rtol=0)
        # the encoder's embedding is timm's pre-logits: the mean of the class and distillation tokens
        torch.testing.assert_close(objective.backbone(images), theirs.forward_head(theirs.forward_features(images),
                                                                                   pre_logits=True), atol=1e-5, rtol=0)
    assert config.dist_token is True


@pytest.mark.slow
def test_a_supervised_run_is_a_teacher_and_deit_saves_neither_teacher_nor_its_weights(tmp_path, timm_teacher):
    """objective=supervised saves its head; objective=deit through the CLI distils from that run; its checkpoint,
    heads and encoder hold the student only."""
    supervised = tmp_path / "supervised"
    tiny = ["model=vit_test", "data.num_samples=32", "data.batch_size=8", "trainer.max_steps=3", "trainer.log_every=1"]
    check_ok(pretrain_in_process(*tiny, "objective=supervised", "objective.head=mlp", f"hydra.run.dir={supervised}"))
    teacher = load_teacher(str(supervised), NUM_CLASSES)
    encoder = load_encoder(supervised / "encoder.safetensors").eval()
    heads = load_file(supervised / "heads.safetensors")
    assert sorted(heads) == ["head.0.bias", "head.0.weight", "head.2.bias", "head.2.weight"]  # the tanh MLP head
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():  # the supervised run's classifier by hand
        hidden = torch.tanh(encoder(images) @ heads["head.0.weight"].T + heads["head.0.bias"])
        torch.testing.assert_close(teacher(images), hidden @ heads["head.2.weight"].T + heads["head.2.bias"])

    student = tmp_path / "deit"
    check_ok(pretrain_in_process(*tiny, "objective=deit", f"objective.teacher={supervised}",
                                 f"hydra.run.dir={student}"))
    metrics = [m for m in read_metrics(student) if "loss" in m]
    assert len(metrics) == 3 and all(0 <= m["teacher_agreement"] <= 1 for m in metrics)
    encoder = load_encoder(student / "encoder.safetensors")
    assert set(encoder.state_dict()) == set(VisionTransformer(encoder.config).state_dict())
    assert encoder.config.dist_token is True
    assert sorted(load_file(student / "heads.safetensors")) == ["head.bias", "head.weight", "head_dist.bias",
                                                                "head_dist.weight"]
    (checkpoint,) = (student / "checkpoints").glob("*/model.safetensors")
    names = set(load_file(checkpoint))
    assert names == {f"backbone.{k}" for k in encoder.state_dict()} | {"head.bias", "head.weight", "head_dist.bias",
                                                                       "head_dist.weight"}
    # and a DeiT run is a teacher in turn (its two heads averaged)
    assert load_teacher(str(student), NUM_CLASSES)(images).shape == (4, NUM_CLASSES)
    # a teacher must fit the student's images: their size and, for a run teacher, their normalisation
    with pytest.raises(ValueError, match="cannot classify 18 px images .*not divisible by the patch size 4x4"):
        load_teacher(str(supervised), NUM_CLASSES, img_size=18)
    with pytest.raises(ValueError, match=r"normalised with mean=\[0.485, 0.456, 0.406\].* this run's are "
                                         r"mean=\[0.1, 0.1, 0.1\].* set data.mean=\[0.485, 0.456, 0.406\]"):
        load_teacher(str(supervised), NUM_CLASSES, img_size=16, mean=[0.1] * 3, std=[0.2] * 3)


@pytest.mark.parametrize("teacher, message", [
    ("timm:resnet10t:/nonexistent.pth", "weights file '/nonexistent.pth' does not exist"),
    ("timm:not_a_model:{file}", "'not_a_model' is not a timm model name"),
    ("timm:resnet18:{file}", "does not fit timm's resnet18 with 8 classes"),
    ("/nonexistent/run", r"does not exist; valid forms: \['timm:<timm model name>"),
])
def test_bad_teachers_are_named(timm_teacher, teacher, message):
    file = timm_teacher.rsplit(":", 1)[1]
    with pytest.raises(ConfigError, match=message):
        objective_and_batch("objective=deit", f"objective.teacher={teacher.format(file=file)}")


def test_deit_needs_its_token_and_a_teacher(timm_teacher):
    with pytest.raises(ConfigError, match=r"objective.teacher is not set; .*objective.teacher=outputs/"):
        from ssl_vit.schema import validate_config

        register_configs()
        with initialize_config_dir(str(ROOT / "configs"), version_base=None):
            validate_config(compose("pretrain", ["objective=deit", "output_dir=unused"]))
    with pytest.raises(ConfigError, match=r"needs a backbone with a distillation token \(model.dist_token=true; "):
        objective_and_batch("objective=deit", f"objective.teacher={timm_teacher}", "model.dist_token=false")
    with pytest.raises(ValueError, match="dist_token=True .* needs class_token=True and global_pool='token'"):
        VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, dist_token=True,
                          class_token=False, global_pool="avg")


def test_a_deit_encoder_exports_to_timm_as_distilled_deit_and_transformers_refuses_it(tmp_path):
    from ssl_vit.interop.hf import hf_config
    from ssl_vit.interop.timm import export_timm, from_timm

    encoder = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, dist_token=True).eval()
    with torch.no_grad():
        for p in encoder.parameters():
            p.normal_(0, 0.1)
    export_timm(encoder, tmp_path)
    theirs = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    assert type(theirs).__name__ == "VisionTransformerDistilled"
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(theirs(images), encoder(images), atol=1e-5, rtol=0)
        torch.testing.assert_close(from_timm(theirs)(images), encoder(images), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="dist_token=True"):
        hf_config(encoder.config, "vit")
