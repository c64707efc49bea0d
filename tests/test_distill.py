"""objective=distill (multi-teacher distillation, AM-RADIO's losses): the losses, the standardisation and the
resizing of teacher grids against independent computations, teacher views against each library's own processor,
frozen teachers out of checkpoints and exports, zero-shot through an exact CLIP adaptor equal to the teacher's, and
the real CLI: a student of a CLIP run and another encoder, evaluated through its adaptors."""

import copy
import json
import math

import numpy as np
import pytest
import timm
import torch
from conftest import ROOT, TINY, check_ok, export_script, launch, pretrain_in_process, read_metrics, script_module
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file, save_file

from ssl_vit.artifacts import load_encoder, save_encoder, save_encoder_state, save_heads
from ssl_vit.backbone import build_vit
from ssl_vit.cli import explain_hydra_error, register_configs
from ssl_vit.config import EvalConfig
from ssl_vit.data.views import PairedCrops, ViewBuilder
from ssl_vit.eval.run import evaluate, zeroshot_eval
from ssl_vit.objectives import DataInfo, load_trained
from ssl_vit.objectives.clip import CLIP
from ssl_vit.objectives.distill import Distill, DistillConfig, RunningStandardizer, StudentConfig, TeacherConfig
from ssl_vit.objectives.feature_teacher import load_feature_teacher
from ssl_vit.objectives.patches import resize_patch_features
from ssl_vit.preprocess import Preprocess
from ssl_vit.schema import ConfigError, validate_config
from ssl_vit.train.build import build_components

CLIP_TOWERS = dict(embed_dim=12, context_length=16, text_width=16, text_heads=2, text_layers=1)


def _save_run(model, out, preprocess):
    """A run directory of `model` (encoder.safetensors + heads.safetensors, as the trainer writes them)."""
    artifacts = model.artifacts(model.state_dict())
    save_encoder_state(artifacts.encoder, model.encoder.config, out / "encoder.safetensors", preprocess, step=0)
    save_heads(artifacts.heads, out / "heads.safetensors", step=0, **artifacts.metadata)
    return out


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A CLIP run (random towers; 48 px, 16 px patches: a 3 x 3 grid) and an encoder file with 14 px patches at
    70 px (a 5 x 5 grid), its own normalisation."""
    root = tmp_path_factory.mktemp("teachers")
    torch.manual_seed(1)
    clip = CLIP(build_vit("vit_test", img_size=48, patch_size=16, pre_norm=True),
                OmegaConf.structured(CLIP.config_class(**CLIP_TOWERS)), DataInfo(0, 48))
    clip_run = _save_run(clip, root / "clip", Preprocess(48, mean=[0.4] * 3, std=[0.3] * 3))
    encoder = save_encoder(build_vit("vit_test", img_size=70, patch_size=14), root / "dino.safetensors",
                           Preprocess(70, mean=[0.5] * 3, std=[0.25] * 3))
    return {"clip": clip_run, "dino": encoder}


def _student(teachers, **overrides):
    cfg = OmegaConf.structured(DistillConfig(**{"adaptor_hidden_dim": 24, **overrides}, teachers=[
        TeacherConfig(source=str(teachers["clip"]), name="clip"),
        TeacherConfig(source=str(teachers["dino"]), name="dino", patch_weight=0.5)]))
    OmegaConf.set_readonly(cfg, True)  # the teachers' resolved facts go into the objective's own copy
    return Distill(build_vit("vit_test", img_size=64, patch_size=16), cfg, DataInfo(0, 64))


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _mlp(adaptor, x):
    w1, b1, w2, b2 = (t.detach().double().numpy() for t in (adaptor.fc1.weight, adaptor.fc1.bias,
                                                            adaptor.fc2.weight, adaptor.fc2.bias))
    return _gelu(x @ w1.T + b1) @ w2.T + b2


def _bilinear(features, out_h, out_w):
    """(C, h, w) -> (C, out_h, out_w): half-pixel centres, clamped at the edges (align_corners=False)."""
    def axis(n_in, n_out):
        source = np.maximum((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0)
        low = np.floor(source).astype(int)
        return low, np.minimum(low + 1, n_in - 1), source - low
    (r0, r1, fr), (c0, c1, fc) = axis(features.shape[1], out_h), axis(features.shape[2], out_w)
    rows = features[:, r0] * (1 - fr)[None, :, None] + features[:, r1] * fr[None, :, None]
    return rows[:, :, c0] * (1 - fc)[None, None, :] + rows[:, :, c1] * fc[None, None, :]


def _cosine(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _smooth_l1(a, b):
    d = np.abs(a - b)
    return np.where(d < 1, 0.5 * d ** 2, d - 0.5).mean()


def _standardised(rows):
    mean, var = rows.mean(0), (rows ** 2).mean(0) - rows.mean(0) ** 2
    return lambda x: (x - mean) / np.sqrt(np.maximum(var, 1e-6))


def test_the_loss_is_radios_on_standardised_teacher_features_resized_to_the_students_grid(teachers):
    """The first training step's loss, written out in numpy: each teacher's summary and patches standardised by
    the batch's per-channel statistics (the first update takes them whole), the 14 px teacher's 5 x 5 and the CLIP
    teacher's 3 x 3 grids resized bilinearly to the student's 4 x 4 (16 px patches), adaptors Linear-GELU-Linear,
    1 - cos on the summary, 0.9 (1 - cos) + 0.1 smooth-L1 on the patches, per-teacher weights."""
    torch.manual_seed(0)
    student = _student(teachers).train()
    generator = torch.Generator().manual_seed(0)
    batch = {"image": torch.randn(3, 3, 64, 64, generator=generator),
             "teacher_images": [torch.randn(3, 3, 48, 48, generator=generator),
                                torch.randn(3, 3, 70, 70, generator=generator)]}
    out = student(batch)
    tokens = student.backbone.forward_features(batch["image"]).detach().double().numpy()
    summary, patches = tokens[:, 0], tokens[:, 1:]
    clip = load_trained(teachers["clip"])
    dino = load_encoder(teachers["dino"])
    with torch.no_grad():
        clip_tokens = clip.backbone.forward_features(batch["teacher_images"][0])
        targets = {"clip": (clip.image_proj(clip_tokens[:, 0]), clip_tokens[:, 1:], 3),
                   "dino": (*(lambda t: (t[:, 0], t[:, 1:]))(dino.forward_features(batch["teacher_images"][1])), 5)}
    expected = 0.0
    for name, patch_weight in (("clip", 1.0), ("dino", 0.5)):
        teacher_summary, teacher_patches, side = (t.double().numpy() if torch.is_tensor(t) else t
                                                  for t in targets[name])
        target_summary = _standardised(teacher_summary)(teacher_summary)
        channels = teacher_patches.shape[-1]
        standardised = _standardised(teacher_patches.reshape(-1, channels))(teacher_patches)
        target_patches = np.stack([_bilinear(image.T.reshape(channels, side, side), 4, 4).reshape(channels, 16).T
                                   for image in standardised])
        predicted_summary = _mlp(student.summary_adaptors[name], summary)
        predicted_patches = _mlp(student.patch_adaptors[name], patches)
        summary_loss = (1 - _cosine(predicted_summary, target_summary)).mean()
        patch_loss = (0.9 * (1 - _cosine(predicted_patches, target_patches)).mean()
                      + 0.1 * _smooth_l1(predicted_patches, target_patches))
        assert out[f"{name}_summary_loss"].item() == pytest.approx(summary_loss, abs=1e-5)
        assert out[f"{name}_patch_loss"].item() == pytest.approx(patch_loss, abs=1e-5)
        expected += summary_loss + patch_weight * patch_loss
    assert out["loss"].item() == pytest.approx(expected, abs=1e-5)


def test_resizing_a_14_px_teachers_grid_to_a_16_px_students_is_bilinear_with_half_pixel_centres():
    features = torch.randn(2, 5, 16, 16, dtype=torch.float64)  # a 14 px teacher at 224: 16 x 16
    tokens = features.flatten(2).transpose(1, 2)
    resized = resize_patch_features(tokens, (16, 16), (14, 14), "bilinear")  # a 16 px student at 224: 14 x 14
    assert resized.shape == (2, 196, 5)
    for image in range(2):
        expected = _bilinear(features[image].numpy(), 14, 14).reshape(5, 196).T
        np.testing.assert_allclose(resized[image].numpy(), expected, atol=1e-5)  # computed in fp32
    coarse = features[:, :, :3, :3]
    upsampled = resize_patch_features(coarse.flatten(2).transpose(1, 2), (3, 3), (4, 4), "bilinear")
    np.testing.assert_allclose(upsampled[0].numpy(), _bilinear(coarse[0].numpy(), 4, 4).reshape(5, 16).T, atol=1e-5)
    assert resize_patch_features(tokens, (16, 16), (16, 16), "bilinear") is tokens


def test_running_statistics_are_the_cumulative_mean_then_an_ema():
    """momentum 0.5: the first update takes the batch's statistics, the second averages both batches, from the
    third on each batch weighs 1 - momentum; standardize / restore are inverse, and running 'none' is identity."""
    stats = RunningStandardizer(3, momentum=0.5)
    rng = np.random.default_rng(0)
    batches = [rng.normal(loc=3, scale=2, size=(20, 3)) for _ in range(4)]
    mean, square = batches[0].mean(0), (batches[0] ** 2).mean(0)
    for index, batch in enumerate(batches):
        stats.update(torch.tensor(batch, dtype=torch.float32))
        if index:
            weight = max(1 / (index + 1), 0.5)
            mean = (1 - weight) * mean + weight * batch.mean(0)
            square = (1 - weight) * square + weight * (batch ** 2).mean(0)
        np.testing.assert_allclose(stats.mean.numpy(), mean, rtol=1e-5)
        np.testing.assert_allclose(stats.std().numpy(), np.sqrt(square - mean ** 2), rtol=1e-4)
    stats.update(torch.full((4, 3), float("nan")))  # a batch with a non-finite feature is left out
    np.testing.assert_allclose(stats.mean.numpy(), mean, rtol=1e-5)
    x = torch.randn(5, 3)
    torch.testing.assert_close(stats.restore(stats.standardize(x)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.standardize(x), (x - stats.mean) / stats.std())
    # a channel with a large offset keeps its small spread (E[x^2] - E[x]^2 in fp32 would lose it entirely)
    offset = RunningStandardizer(2, momentum=0.99)
    for _ in range(300):
        offset.update(torch.tensor(rng.normal(loc=[300, 3000], scale=[0.05, 1.0], size=(512, 2)), dtype=torch.float32))
    np.testing.assert_allclose(offset.std().numpy(), [0.05, 1.0], rtol=0.02)
    off = RunningStandardizer(3, momentum=0.5, enabled=False)
    off.update(x)
    assert torch.equal(off.standardize(x), x) and off.count.item() == 0


def _image(height, width):
    rng = np.random.default_rng(3)
    base = np.linspace(0, 255, height * width * 3).reshape(height, width, 3)
    return np.clip(base + rng.normal(0, 40, size=base.shape), 0, 255).astype(np.uint8)


def test_teacher_views_equal_each_teachers_own_processor(teachers, tmp_path):
    """Without augmentation a teacher's view is its library's own processor applied to the image (the recipe its
    loader read: size, interpolation, normalisation): ours exactly; timm's and open_clip's eval transforms and
    transformers' ViTImageProcessor (all PIL) within PIL's resampling rounding (measured: mean 6e-5, at most one
    8-bit level, in normalised units). A non-square image is resized by its
    shorter side and centre-cropped, as they do."""
    import open_clip
    from timm.data import create_transform, resolve_data_config
    from transformers import ViTImageProcessor

    vit = timm.create_model("vit_tiny_patch16_224", num_classes=0)
    save_file(vit.state_dict(), str(tmp_path / "vit.safetensors"))
    timm_teacher = load_feature_teacher(f"timm:vit_tiny_patch16_224:{tmp_path / 'vit.safetensors'}", img_size=48)
    ours = load_feature_teacher(str(teachers["dino"]))
    recipes = [ours.preprocess, timm_teacher.preprocess,
               Preprocess(40, mean=list(open_clip.OPENAI_DATASET_MEAN), std=list(open_clip.OPENAI_DATASET_STD),
                          interpolation="bicubic")]
    picture = _image(60, 80)
    tensor = torch.from_numpy(picture).permute(2, 0, 1).contiguous()
    views = ViewBuilder(("image", "teacher_images"), 32, [0.5] * 3, [0.5] * 3, teacher_inputs=recipes)
    student, *teacher_views = (lambda out: [out["image"], *out["teacher_images"]])(views({"image": tensor}))
    assert [tuple(v.shape) for v in teacher_views] == [(3, 70, 70), (3, 48, 48), (3, 40, 40)]
    torch.testing.assert_close(teacher_views[0], ours.preprocess.view_builder(("image",))({"image": tensor})["image"],
                               atol=0, rtol=0)
    data_config = resolve_data_config({}, model=vit)
    assert (data_config["mean"], data_config["std"]) == (tuple(recipes[1].mean), tuple(recipes[1].std))
    timm_view = create_transform(**{**data_config, "input_size": (3, 48, 48), "crop_pct": 1.0})(
        Image.fromarray(picture))
    open_clip_view = open_clip.image_transform(40, is_train=False)(Image.fromarray(picture))
    for ours_view, theirs in ((teacher_views[1], timm_view), (teacher_views[2], open_clip_view)):
        difference = (ours_view - theirs).abs()  # PIL vs torchvision's antialiased resampling: a level or two of 255
        assert difference.mean() < 2e-3 and difference.max() < 0.05, (difference.mean(), difference.max())
    square = _image(64, 64)
    square_views = ViewBuilder(("image", "teacher_images"), 32, [0.5] * 3, [0.5] * 3,
                               teacher_inputs=[Preprocess(48, mean=[0.5] * 3, std=[0.5] * 3)])
    ours_view = square_views({"image": torch.from_numpy(square).permute(2, 0, 1).contiguous()})["teacher_images"][0]
    processor = ViTImageProcessor(size={"height": 48, "width": 48}, resample=Image.BILINEAR, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3)
    hf_view = torch.from_numpy(processor(Image.fromarray(square), return_tensors="np")["pixel_values"][0])
    difference = (ours_view - hf_view).abs()
    assert difference.mean() < 2e-3 and difference.max() < 0.05, (difference.mean(), difference.max())
    assert student.shape == (3, 32, 32)


def test_augmented_teacher_views_are_cut_from_the_students_box():
    """With random resized crops and flips every view comes from one box: a teacher recipe at the student's size
    and normalisation gives the student's own crop, pixel for pixel, at any seed; a teacher at twice the size gives
    the same crop, finer (shrunk back to the student's size: within resampling error, far from another box)."""
    crops = PairedCrops([(32, "bilinear", [0.5] * 3, [0.5] * 3), (32, "bilinear", [0.5] * 3, [0.5] * 3),
                         (64, "bilinear", [0.2] * 3, [0.3] * 3)], augment=True, crop_scale=(0.2, 0.6))
    image = torch.from_numpy(_image(50, 70)).permute(2, 0, 1).contiguous()
    for seed in range(6):
        torch.manual_seed(seed)
        student, same, larger = crops(image)
        torch.testing.assert_close((student - 0.5) / 0.5, same, atol=1e-6, rtol=0)
        shrunk = torch.nn.functional.interpolate((larger * 0.3 + 0.2)[None], size=(32, 32), mode="bilinear",
                                                 antialias=True)[0]
        assert (shrunk - student).abs().mean() < 0.03
        torch.manual_seed(seed + 100)  # another box and flip
        assert (crops(image)[0] - student).abs().mean() > 0.05


def test_teachers_are_frozen_outside_the_module_tree_and_the_optimizer(teachers):
    torch.manual_seed(0)
    student = _student(teachers).train()
    before = [copy.deepcopy(t.state_dict()) for t in student.teachers]
    assert all(not p.requires_grad for t in student.teachers for p in t.parameters())
    assert not any(name.startswith("teachers") for name, _ in student.named_parameters())
    assert {name.split(".")[0] for name in student.state_dict()} == {
        "backbone", "summary_adaptors", "patch_adaptors", "summary_stats", "patch_stats"}
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        batch = {"image": torch.randn(2, 3, 64, 64, generator=generator),
                 "teacher_images": [torch.randn(2, 3, 48, 48, generator=generator),
                                    torch.randn(2, 3, 70, 70, generator=generator)]}
        student(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    for teacher, state in zip(student.teachers, before, strict=True):
        assert not teacher.training
        for name, value in teacher.state_dict().items():
            assert torch.equal(value, state[name]), name
    assert student.summary_stats["dino"].count.item() == 2
    # the run's artifacts: the student's encoder and its adaptors + statistics, the teachers' dimensions recorded
    artifacts = student.artifacts(student.state_dict())
    assert set(artifacts.encoder) == set(student.backbone.state_dict())
    assert {k.split(".")[0] for k in artifacts.heads} == {"summary_adaptors", "patch_adaptors", "summary_stats",
                                                           "patch_stats"}
    recorded = json.loads(artifacts.metadata["objective_config"])["teachers"]
    assert [(t["summary_dim"], t["patch_dim"], t["image_text"]) for t in recorded] == [(12, 32, True),
                                                                                      (32, 32, False)]


def test_zero_shot_through_an_exact_clip_adaptor_equals_the_teachers(teachers):
    """A student with the CLIP teacher's image tower and an adaptor that reproduces its projection exactly
    (GELU(a) - GELU(-a) = a: hidden [P; -P], out [I, -I] scaled by the statistics it is de-standardised with)
    classifies every test image as the teacher does, through the teacher's own text tower."""
    clip = load_trained(teachers["clip"])
    cfg = OmegaConf.structured(DistillConfig(adaptor_hidden_dim=2 * CLIP_TOWERS["embed_dim"],
                                             teachers=[TeacherConfig(source=str(teachers["clip"]), name="clip")]))
    student = Distill(load_encoder(teachers["clip"] / "encoder.safetensors"), cfg, DataInfo(0, 48)).eval()
    stats = student.summary_stats["clip"]
    with torch.no_grad():
        stats.update(torch.randn(64, 12) * 3 + 1)  # any statistics: the adaptor undoes them
        projection = clip.image_proj.weight
        adaptor = student.summary_adaptors["clip"]
        adaptor.fc1.weight.copy_(torch.cat([projection, -projection]))
        adaptor.fc1.bias.zero_()
        identity = torch.eye(12)
        adaptor.fc2.weight.copy_(torch.cat([identity, -identity], dim=1) / stats.std()[:, None])
        adaptor.fc2.bias.copy_(-stats.mean / stats.std())
    images = torch.randn(5, 3, 48, 48)
    torch.testing.assert_close(student.encode_image(images), clip.encode_image(images), atol=1e-5, rtol=1e-5)
    from ssl_vit.data.synthetic import SyntheticShapes

    test_set = SyntheticShapes(num_samples=200, img_size=48, seed=5)
    settings = EvalConfig(evaluators=["zeroshot"], batch_size=64)
    preprocess = Preprocess(48, mean=[0.4] * 3, std=[0.3] * 3)
    views = preprocess.view_builder(("image",))
    ours = zeroshot_eval(student, test_set, views, settings, "synthetic")
    theirs = zeroshot_eval(clip, test_set, views, settings, "synthetic")
    assert ours["accuracy"] == theirs["accuracy"] and ours["templates"] == theirs["templates"]


def _compose(name, *overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.fixture(scope="module")
def student_run(teachers, tmp_path_factory):
    """The CLI's entry (in this process): a vit_test student of both teachers, 6 steps, augmented crops."""
    out = tmp_path_factory.mktemp("student")
    spec = (f"objective.teachers=[{{source: '{teachers['clip']}', name: clip}}, "
            f"{{source: '{teachers['dino']}', name: dino, img_size: 56}}]")
    check_ok(pretrain_in_process("objective=distill_tiny", "model=vit_test", "objective.adaptor_hidden_dim=32", spec,
                                 "data.augment=crop_flip", "data.num_samples=64", "data.batch_size=8",
                                 "trainer.max_steps=6", "trainer.log_every=1", f"hydra.run.dir={out}"))
    return out


@pytest.mark.slow
def test_the_cli_trains_a_student_and_evaluates_it_through_its_adaptors(student_run, tmp_path):
    metrics = [m for m in read_metrics(student_run) if "loss" in m]
    assert len(metrics) == 6 and all(math.isfinite(m["loss"]) for m in metrics)
    assert {"clip_summary_loss", "clip_patch_loss", "dino_summary_loss", "dino_patch_cosine"} <= set(metrics[0])
    heads = load_file(student_run / "heads.safetensors")
    assert heads["patch_adaptors.dino.fc2.weight"].shape == (32, 32) and "summary_stats.clip.mean" in heads
    common = ["data=synthetic", "data.num_samples=256", "data.max_train_samples=128", "data.max_test_samples=64",
              "cache_dir=null", f"output_dir={tmp_path}"]
    knn = evaluate(_compose("evaluate", f"checkpoint={student_run}", "eval=knn", "eval.features=dino", *common),
                   progress=False)
    assert knn["feature_dim"] == 32 and 0 <= knn["results"]["knn"]["accuracy"] <= 1
    # the adaptors go with the exported encoder: the export evaluates through them as the run does
    assert export_script().main([str(student_run), "--to", "safetensors", "--out", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "heads.safetensors").is_file()
    exported = evaluate(_compose("evaluate", f"checkpoint={tmp_path / 'export'}", "eval=knn", "eval.features=dino",
                                 *common), progress=False)
    assert exported["results"]["knn"] == knn["results"]["knn"]
    clip_features = evaluate(_compose("evaluate", f"checkpoint={student_run}", "eval=knn", "eval.features=clip",
                                      *common), progress=False)
    assert clip_features["feature_dim"] == CLIP_TOWERS["embed_dim"]
    dense = evaluate(_compose("evaluate", f"checkpoint={student_run}", "eval=segmentation", "eval.features=dino",
                              *common), progress=False)["results"]["segmentation"]
    assert dense["grid"] == [4, 4] and dense["num_classes"] == 9  # the dino adaptor's patch features, 32 wide
    text = evaluate(_compose("evaluate", f"checkpoint={student_run}", "eval=zeroshot", *common), progress=False)
    assert text["results"]["zeroshot"]["num_test"] == 64
    retrieval = evaluate(_compose("evaluate", f"checkpoint={student_run}", "eval=retrieval", *common),
                         progress=False)
    assert set(retrieval["results"]["retrieval"]["accuracy"]) >= {"image_to_text_R@1", "text_to_image_R@10"}
    with pytest.raises(ConfigError, match=r"unknown eval.features 'sam'; valid choices: .* adaptors \['clip', "
                                          r"'dino'\]"):
        evaluate(_compose("evaluate", f"checkpoint={student_run}", "eval=knn", "eval.features=sam", *common))


@pytest.mark.slow
def test_bad_teacher_settings_are_one_line_each(teachers, tmp_path):
    base = ["objective=distill_tiny", "model=vit_test", f"output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"objective.teachers\[0\].summary_weight=-1.0 is invalid: must be >= 0"):
        validate_config(_compose("pretrain", *base, "objective.teachers=[{source: x, summary_weight: -1}]"))
    with pytest.raises(ConfigError, match=r"objective.teachers\[0\].source is not set; .*\(forms: "):
        validate_config(_compose("pretrain", *base, "objective.teachers=[{name: a}]"))
    typo = [*base, "objective.teachers=[{source: x, nme: a}]"]
    with pytest.raises(ConfigCompositionException) as err:
        _compose("pretrain", *typo)
    assert explain_hydra_error(err.value, "pretrain", typo).startswith(
        "unknown key 'nme' in an item of objective.teachers (TeacherConfig); did you mean name?")
    with pytest.raises(ConfigError, match="objective=distill needs at least one teacher"):
        build_components(_compose("pretrain", *base))
    with pytest.raises(ConfigError, match=r"objective.teachers\[teacher0\]: .*nowhere.*\(valid forms: "):
        build_components(_compose("pretrain", *base, "objective.teachers=[{source: /nowhere/run}]"))
    with pytest.raises(ConfigError, match=r"names must be distinct identifiers .*\['a', 'a'\]"):
        build_components(_compose("pretrain", *base, f"objective.teachers=[{{source: '{teachers['dino']}', name: a}}, "
                                                     f"{{source: '{teachers['dino']}', name: a}}]"))
    with pytest.raises(ConfigError, match="distillation teachers must see the same crop; use data.augment=crop_flip"):
        build_components(_compose("pretrain", *base, f"objective.teachers=[{{source: '{teachers['dino']}'}}]",
                                  "data.augment=augreg", "data.augreg.mixup=0", "data.augreg.cutmix=0"))
    with pytest.raises(ConfigError, match=r"^objective.teacher_precision=fp8 is not one of auto, bf16, fp32$"):
        build_components(_compose("pretrain", *base, f"objective.teachers=[{{source: '{teachers['dino']}'}}]",
                                  "objective.teacher_precision=fp8"))


# ----- one teacher, many students (DINOv3's multi-distillation) -----
STUDENTS = [{"name": "small", "model": "vit_test", "options": {"patch_size": 8, "depth": 1}, "lr_scale": 2.0},
            {"name": "glu", "model": "vit_test_aimv2", "options": {"patch_size": 16}}]


def _batch(generator, size=3):
    return {"image": torch.randn(size, 3, 64, 64, generator=generator),
            "teacher_images": [torch.randn(size, 3, 48, 48, generator=generator),
                               torch.randn(size, 3, 70, 70, generator=generator)]}


def test_students_share_one_teacher_forward_and_each_learns_as_if_alone(teachers):
    """Three students (the model= one, an 8 px-patch ViT, an AIMv2-family one) against one forward of each teacher
    per batch: each student's loss and gradients over two training steps equal those of a distill run of that
    student alone (its own teachers, its own statistics), and the running statistics each student saves are the
    ones it would have alone."""
    torch.manual_seed(0)
    multi = _student(teachers, students=[StudentConfig(**s) for s in STUDENTS]).train()
    alone = {"student": _student(teachers).train()}
    for student in STUDENTS:
        cfg = OmegaConf.structured(DistillConfig(adaptor_hidden_dim=24, teachers=[
            TeacherConfig(source=str(teachers["clip"]), name="clip"),
            TeacherConfig(source=str(teachers["dino"]), name="dino", patch_weight=0.5)]))
        alone[student["name"]] = Distill(build_vit(student["model"], img_size=64, **student["options"]), cfg,
                                         DataInfo(0, 64)).train()
    alone["student"].load_state_dict({k: v for k, v in multi.state_dict().items() if not k.startswith("students.")})
    for name, student in multi.students.items():
        alone[name].load_state_dict(student.state_dict())
    forwards = []
    for teacher in multi.teachers:
        teacher.register_forward_hook(lambda module, args, output: forwards.append(module))
    generator = torch.Generator().manual_seed(0)
    for step in range(2):
        batch = _batch(generator)
        out = multi(batch)
        out["loss"].backward()
        assert len(forwards) == 2 * (step + 1)  # each of the 2 teachers once per batch, not once per student
        for name, model in alone.items():
            expected = model(batch)
            expected["loss"].backward()
            torch.testing.assert_close(out[f"{name}_loss"], expected["loss"].detach(), atol=1e-6, rtol=1e-6)
            prefix = "" if name == "student" else f"{name}_"  # the model= student's metrics keep their names
            torch.testing.assert_close(out[f"{prefix}dino_patch_loss"], expected["dino_patch_loss"])
            ours = multi if name == "student" else multi.students[name]
            theirs = dict(model.named_parameters())
            for param_name, param in ours.named_parameters():
                if param_name.startswith("students."):
                    continue
                torch.testing.assert_close(param.grad, theirs[param_name].grad, atol=1e-6, rtol=1e-5,
                                           msg=f"{name}: {param_name}")
            for buffer_name, value in model.named_buffers():
                torch.testing.assert_close(dict(ours.named_buffers())[buffer_name], value, msg=buffer_name)
        torch.testing.assert_close(out["loss"], sum(out[f"{name}_loss"] for name in alone))
        for module in (multi, *alone.values()):
            module.zero_grad()
    # each further student is saved as a distill run of its own; the run's own files hold the model= student only
    state = multi.state_dict()
    members = multi.member_artifacts(state)
    assert set(members) == {"students/small", "students/glu"}
    config, files = members["students/glu"]
    assert config.mlp_kind == "swiglu" and config.norm_layer == "rmsnorm"
    assert set(files.encoder) == set(multi.students["glu"].backbone.state_dict())
    assert json.loads(files.metadata["objective_config"])["students"] == []
    # the run's own heads hold every further student too: it rebuilds whole
    heads = multi.artifacts(state).heads
    assert {k for k in heads if k.startswith("students.")} == {k for k in state if k.startswith("students.")}


def test_each_student_has_optimizer_groups_of_its_own_at_its_lr_scale(teachers):
    from ssl_vit.optim import param_groups

    multi = _student(teachers, students=[StudentConfig(**s) for s in STUDENTS])
    groups = param_groups(multi, weight_decay=0.05)
    owners = {}
    for group in groups:
        prefixes = {name.split(".")[1] if name.startswith("students.") else "student" for name in group["names"]}
        assert len(prefixes) == 1, prefixes  # a group holds one student's parameters
        owners.setdefault(prefixes.pop(), set()).add(group["lr_scale"])
    assert owners == {"student": {1.0}, "small": {2.0}, "glu": {1.0}}
    assert sum(len(g["params"]) for g in groups) == sum(1 for p in multi.parameters() if p.requires_grad)


def test_bad_students_are_one_line_each(teachers):
    register_configs()
    base = ["objective=distill_tiny", "objective.adaptor_hidden_dim=16", "model=vit_test", "data.img_size=32",
            "output_dir=x", f"objective.teachers=[{{source: {teachers['dino']}, name: dino}}]"]
    cases = {
        "[{name: a, model: vit_nope}]": "objective.students[a]: unknown model 'vit_nope'; valid choices: [",
        "[{name: a, model: vit_test, options: {patch_size: 5}}]":
            "objective.students[a]: model=vit_test at data.img_size=32: image size 32x32 is not divisible by the "
            "patch size 5x5",
        "[{name: a, model: vit_test}, {name: a, model: vit_test}]":
            "objective.students: names must be distinct identifiers (letters, digits, _), got ['a', 'a']",
        "[{model: vit_test}]": "objective.students[0].name is not set; give it on the command line, e.g. "
                               "objective.students=[{name: small, model: vit_s16}]",
    }
    for students, message in cases.items():
        with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("pretrain", overrides=[*base, f"objective.students={students}"])
        with pytest.raises(ConfigError) as caught:
            build_components(cfg)
        assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.slow
def test_a_killed_multi_student_run_resumes_loss_exact_and_saves_each_student_as_a_run(teachers, tmp_path):
    """The real CLI, SIGKILLed after step 5 (checkpoint at 4) and resumed: every student's losses equal the
    uninterrupted run's and so do the students' saved encoders; a student's directory evaluates and exports as a
    distill run."""
    args = [*TINY, "objective=distill_tiny", "objective.adaptor_hidden_dim=16", "data.img_size=32",
            "data.batch_size=8", "trainer.max_steps=6", "trainer.checkpoint_every=2",
            f"objective.teachers=[{{source: {teachers['dino']}, name: dino, img_size: 28}}]",
            "objective.students=[{name: small, model: vit_test, options: {patch_size: 8, depth: 1}, lr_scale: 2}]"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    check_ok(launch(*args, f"hydra.run.dir={whole}"))
    assert launch(*args, f"hydra.run.dir={parts}", env={"SSL_VIT_FAULT": "step_done@5"}).returncode != 0
    check_ok(launch(*args, f"hydra.run.dir={parts}", "trainer.resume=auto"))

    def losses(run):
        return {row["step"]: (row["student_loss"], row["small_loss"]) for row in read_metrics(run) if "loss" in row}

    assert losses(parts) == losses(whole) and len(losses(whole)) == 6
    for member in ("", "students/small"):
        saved = load_file(parts / member / "encoder.safetensors")
        for name, value in load_file(whole / member / "encoder.safetensors").items():
            assert torch.equal(saved[name], value), (member, name)
    rebuilt = load_trained(whole)  # the whole run: both students, as trained
    for name, value in rebuilt.students["small"].backbone.state_dict().items():
        assert torch.equal(value, load_file(whole / "students" / "small" / "encoder.safetensors")[name]), name
    small = load_trained(whole / "students" / "small")
    assert isinstance(small, Distill) and small.backbone.patch_embed.patch_size == (8, 8)
    assert small.summary_stats["dino"].count.item() == 6  # the statistics it trained with
    assert export_script().main([str(whole / "students" / "small"), "--to", "timm", "--out",
                                 str(tmp_path / "timm")]) == 0
    exported = timm.create_model("local-dir:" + str(tmp_path / "timm"), pretrained=True).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(exported.forward_features(images), small.backbone.forward_features(images),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_multi_student_benchmark_counts_one_teacher_forward_per_step_against_one_per_student(tmp_path, capsys):
    out = tmp_path / "multidistill.json"
    report = script_module("benchmarks/multidistill.py").main([
        "--teacher-steps", "2", "--steps", "2", "--knn-train", "64", "--knn-test", "32", "--work-dir",
        str(tmp_path / "work"), "--out", str(out)])
    assert json.loads(out.read_text())["teacher_forwards_per_step"] == {"together": 1.0, "separate": 3.0}
    assert set(report["students"]) == {"tiny", "narrow", "coarse"}
    assert all(0 <= row["together_knn"] <= 1 and 0 <= row["alone_knn"] <= 1 for row in report["students"].values())
    assert (tmp_path / "work" / "together" / "students" / "coarse" / "encoder.safetensors").is_file()
    assert "teacher forwards / step" in capsys.readouterr().out
