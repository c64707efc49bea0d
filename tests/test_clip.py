"""objective=clip / siglip and LiT: losses against open_clip and their formulas, the clamped logit scale, two processes
against one, feature-caching accumulation against one big batch, zero-shot and retrieval, a short run that learns
shapes, LiT's frozen tower, the open_clip export."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, check_ok, export_script, pretrain_in_process, read_metrics
from helpers.builders import CLIP_TOWERS, WORDS, clip_batch, clip_model
from helpers.ranks import on_ranks
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from ssl_vit.backbone import build_vit
from ssl_vit.cli import register_configs
from ssl_vit.eval.zeroshot import retrieval_recall, zeroshot_accuracy, zeroshot_classifier
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.objectives import Objective, load_trained
from ssl_vit.objectives.clip import CLIP, share_gradient
from ssl_vit.preprocess import Preprocess
from ssl_vit.schema import ConfigError


def _config(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("pretrain", overrides=[*overrides])


def test_the_clip_loss_is_open_clips_and_the_symmetric_cross_entropy_and_ln_b_at_zero():
    from open_clip.loss import ClipLoss

    model = clip_model()
    batch = clip_batch(model)
    loss = model(batch)["loss"]
    image = F.normalize(model.encode_image(batch["image"]), dim=-1)
    text = F.normalize(model.encode_text(batch["text"]), dim=-1)
    scale = model.logit_scale.exp()
    assert float(scale.detach()) == pytest.approx(1 / 0.07)
    logits = scale * image @ text.T
    targets = torch.arange(len(image))
    formula = (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2
    assert float((loss - formula).abs()) <= 1e-6
    assert float((loss - ClipLoss()(image, text, scale)).abs()) <= 1e-6
    with torch.no_grad():
        model.image_proj.weight.zero_()  # zero image features: every logit 0
    assert float(model(batch)["loss"]) == pytest.approx(math.log(len(image)), abs=1e-6)


def test_the_siglip_loss_is_open_clips_and_the_pairwise_sigmoid_formula():
    from open_clip.loss import SigLipLoss

    model = clip_model("siglip")
    assert float(model.logit_scale) == pytest.approx(math.log(10)) and float(model.logit_bias) == -10
    with torch.no_grad():
        model.logit_bias.fill_(-2.0)  # away from the init, where every pair is near "negative"
    batch = clip_batch(model)
    loss = model(batch)["loss"]
    image = F.normalize(model.encode_image(batch["image"]), dim=-1)
    text = F.normalize(model.encode_text(batch["text"]), dim=-1)
    logits = model.logit_scale.exp() * image @ text.T + model.logit_bias
    signs = 2 * torch.eye(len(image)) - 1
    formula = -F.logsigmoid(signs * logits).sum() / len(image)
    assert float((loss - formula).abs()) <= 1e-5
    assert float((loss - SigLipLoss()(image, text, model.logit_scale.exp(), model.logit_bias)).abs()) <= 1e-5


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_the_effective_logit_scale_is_clamped_at_100_inside_the_forward(kind):
    model = clip_model(kind)
    batch = clip_batch(model)
    with torch.no_grad():
        model.logit_scale.fill_(6.0)  # pushed past ln 100
    out = model(batch)
    assert float(out["logit_scale"]) == pytest.approx(100.0)
    out["loss"].backward()
    assert float(model.logit_scale.grad.abs()) == 0.0  # clamped: no gradient pushes it further
    model.zero_grad()
    with torch.no_grad():
        model.logit_scale.fill_(2.0)
    model(batch)["loss"].backward()
    assert float(model.logit_scale.grad.abs()) > 0


def _rank_gradients(rank, kind, out):
    torch.manual_seed(0)
    model = clip_model(kind)
    batch = clip_batch(model, n=8)
    half = {k: v[rank * 4:(rank + 1) * 4] for k, v in batch.items()}
    model(half)["loss"].backward()
    grads = {}
    for name, param in model.named_parameters():
        torch.distributed.all_reduce(param.grad)  # DDP: the mean over ranks
        grads[name] = param.grad / 2
    torch.save(grads, out / f"rank{rank}.pt")


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_two_processes_give_the_gradients_of_one_process_on_the_whole_batch(tmp_path, kind):
    """open_clip's ClipLoss(local_loss, gather_with_grad) / SigLipLoss's exchange over gloo, the gradients averaged as
    DDP does: the gradients of the loss of the concatenated batch on one process."""
    on_ranks(_rank_gradients, kind, tmp_path, log_dir=tmp_path / "ranks")
    out = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    torch.manual_seed(0)
    model = clip_model(kind)
    model(clip_batch(model, n=8))["loss"].backward()
    for name, param in model.named_parameters():  # within 1e-6 of each gradient's scale (fp32 sums differ)
        for rank in (0, 1):
            assert float((out[rank][name] - param.grad).abs().max()) <= 1e-6 * max(1, float(param.grad.abs().max()))


def test_share_gradient_keeps_the_value_and_divides_the_gradient():
    value = torch.tensor([3.0], requires_grad=True)
    shared = share_gradient(value, 4)
    assert torch.equal(shared, value)
    (5 * shared).sum().backward()
    assert float(value.grad) == pytest.approx(5 / 4)


def _train(tmp_path, name, *overrides):
    from ssl_vit.train.trainer import pretrain

    cfg = _config("objective=clip_tiny", *[f"objective.{k}={v}" for k, v in CLIP_TOWERS.items()], "model=vit_test",
                  "data.num_samples=64", "trainer.max_steps=2", "trainer.log_every=1", "trainer.progress=false",
                  "trainer.trackers=[]", "optim.warmup_steps=0", f"output_dir={tmp_path / name}", *overrides)
    pretrain(cfg)
    return read_metrics(tmp_path / name)


@pytest.mark.slow
def test_accumulation_with_cached_features_equals_one_big_batch(tmp_path, monkeypatch):
    """Batch 8 x 2 micro-steps = batch 16 at once: the same gradient (norm before clipping), losses and next step;
    plain accumulation (each micro-batch its own negatives) gives another gradient."""
    big = _train(tmp_path, "big", "data.batch_size=16")
    cached = _train(tmp_path, "cached", "data.batch_size=8", "trainer.grad_accum_steps=2")
    for step in (0, 1):
        assert cached[step]["grad_norm"] == pytest.approx(big[step]["grad_norm"], rel=1e-5)
        assert cached[step]["loss"] == pytest.approx(big[step]["loss"], rel=1e-5)
    monkeypatch.setattr(CLIP, "micro_steps", Objective.micro_steps)  # one forward per micro-batch
    plain = _train(tmp_path, "plain", "data.batch_size=8", "trainer.grad_accum_steps=2")
    assert abs(plain[0]["grad_norm"] - big[0]["grad_norm"]) > 1e-3 * big[0]["grad_norm"]


def test_zeroshot_weights_are_the_renormalised_mean_of_the_normalised_prompt_embeddings():
    model = clip_model().eval()
    tokenizer = model.text_tokenizer()
    names, templates = ["disc", "star", "ring"], ["a {}", "a small {}", "a picture of a {}."]
    weights = zeroshot_classifier(model, tokenizer, names, templates)
    assert weights.shape == (CLIP_TOWERS["embed_dim"], 3)
    with torch.no_grad():
        for c, name in enumerate(names):
            prompts = model.encode_text(tokenizer([t.format(name) for t in templates]))
            mean = (prompts / prompts.norm(dim=1, keepdim=True)).mean(dim=0)
            torch.testing.assert_close(weights[:, c], mean / mean.norm(), atol=1e-6, rtol=0)
    images = F.normalize(torch.stack([weights[:, 2], weights[:, 0], weights[:, 1] + 0.1 * weights[:, 0]]), dim=1)
    scores = zeroshot_accuracy(images, torch.tensor([2, 0, 0]), weights)
    assert scores["accuracy"] == pytest.approx(2 / 3) and scores["top3"] == 1.0


def test_retrieval_recall_on_a_hand_made_case():
    images = torch.eye(4)
    # text 0 matches image 0; text 1 is closest to image 2; text 2 to image 1; text 3 second-closest to image 3
    texts = torch.tensor([[1.0, 0, 0, 0], [0, 0.2, 0.9, 0], [0, 0.9, 0.2, 0], [0.8, 0, 0, 0.6]])
    recall = retrieval_recall(images, texts, ["a", "b", "c", "d"], ks=(1, 2))
    # image->text: image 0 -> text 0 (hit); 1 -> text 2 (miss at 1, text 1 second: hit at 2); 2 -> text 1 (miss,
    # then 2: hit); 3 -> text 3 (hit)
    assert recall["image_to_text_R@1"] == 0.5 and recall["image_to_text_R@2"] == 1.0
    # text->image: text 0 -> image 0 (hit); 1 -> image 2 (miss), image 1 second (hit at 2); 2 -> image 1 (miss),
    # image 2 second; 3 -> image 0 (miss), image 3 second
    assert recall["text_to_image_R@1"] == 0.25 and recall["text_to_image_R@2"] == 1.0
    # identical captions are interchangeable: texts 1 and 2 both say "b"
    assert retrieval_recall(images, texts, ["a", "b", "b", "d"], ks=(1,))["image_to_text_R@1"] == 1.0


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory):
    """~40 s of objective=clip_tiny (2-block ViT at 24 px) on synthetic shapes."""
    from ssl_vit.train.trainer import pretrain

    out = tmp_path_factory.mktemp("clip_run")
    pretrain(_config("objective=clip_tiny", "model=vit_tiny", "model.depth=2", "data.img_size=24",
                     "data.num_samples=8192", "trainer.max_steps=300", "optim.lr=3e-3", "objective.embed_dim=32",
                     "objective.text_width=32", "objective.text_heads=2", "objective.context_length=16",
                     "trainer.progress=false", "trainer.trackers=[]", f"output_dir={out}"))
    return out


@pytest.mark.slow
def test_a_short_clip_run_classifies_held_out_shapes_zero_shot_above_chance(clip_run, tmp_path):
    from ssl_vit.eval.run import evaluate

    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"checkpoint={clip_run}", "data=synthetic", "eval=zeroshot",
                                             "data.num_samples=4000", "cache_dir=null", f"output_dir={tmp_path}"])
        retrieval = compose("evaluate", overrides=[f"checkpoint={clip_run}", "data=synthetic", "eval=retrieval",
                                                   "data.num_samples=2000", "cache_dir=null", f"output_dir={tmp_path}"])
    report = evaluate(cfg, progress=False)
    assert report["num_test"] == 1000
    assert report["results"]["zeroshot"]["accuracy"] >= 0.15  # chance 0.125 (8 shapes; 0.0105 std at 1000 images)
    recall = evaluate(retrieval, progress=False)["results"]["retrieval"]["accuracy"]
    assert recall["image_to_text_R@1"] > 0.1 and recall["text_to_image_R@10"] > 0.5  # chance ~0.01 and ~0.03


@pytest.mark.slow
def test_the_open_clip_export_reproduces_encode_image_and_encode_text(clip_run, tmp_path):
    import open_clip

    assert export_script().main([str(clip_run), "--to", "open_clip", "--out", str(tmp_path / "export")]) == 0
    ours = load_trained(clip_run)
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'export'}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{tmp_path / 'export'}")
    model.eval()
    images = torch.randn(4, 3, 24, 24)
    captions = ["a small red disc in the top left", "a large blue star", "a ring"]
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(images), ours.encode_image(images), atol=1e-5, rtol=0)
        torch.testing.assert_close(model.encode_text(tokenizer(captions)),
                                   ours.encode_text(ours.text_tokenizer()(captions)), atol=1e-5, rtol=0)
    assert preprocess.transforms[0].size == 24
    assert float(model.logit_scale.detach()) == float(ours.scale_and_bias()[0].log().detach())
    card = (tmp_path / "export" / "README.md").read_text()  # the model card (the run's command: in test_first_hour)
    assert "library_name: open_clip" in card and "pipeline_tag: zero-shot-image-classification" in card
    card = card.split("\n---\n", 1)[1].lstrip()  # after the Hub's front matter
    assert card.startswith("# vit_tiny pre-trained with clip") and "- steps: 300 of 300, " in card
    assert f"open_clip.create_model_and_transforms('local-dir:{tmp_path / 'export'}')" in card
    imported = load_pretrained(f"open_clip:{tmp_path / 'export'}")  # and back: open_clip's image tower as ours
    with torch.no_grad():
        torch.testing.assert_close(imported.encoder(images), ours.backbone(images), atol=1e-5, rtol=0)
    assert imported.preprocess.img_size == 24 and imported.preprocess.mean == ours.data.mean


@pytest.mark.parametrize("options", [
    {"pre_norm": False, "global_pool": "avg", "class_token": True},  # a patch bias folded into the positions
    {"layer_scale": 0.1, "qk_norm": True, "qkv_bias": False, "norm_bias": False},
])
def test_the_open_clip_export_maps_every_image_tower_option(tmp_path, options):
    import open_clip

    from ssl_vit.interop.open_clip import export_open_clip

    torch.manual_seed(0)
    ours = clip_model("siglip", model_overrides=options).eval()
    with torch.no_grad():  # make the options matter: non-trivial norms, biases and scales
        for param in ours.backbone.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    with torch.no_grad():
        ours.logit_scale.fill_(5.0)  # past ln 100: open_clip does not clamp, so the export writes the clamped value
    export_open_clip(ours, tmp_path, Preprocess(16, mean=[0.5] * 3, std=[0.3] * 3, resize_mode="squash"))
    model = open_clip.create_model(f"local-dir:{tmp_path}").eval()
    assert float(model.logit_scale.detach().exp()) == pytest.approx(100.0)
    imported = load_pretrained(f"open_clip:{tmp_path}")
    assert imported.preprocess == Preprocess(16, mean=[0.5] * 3, std=[0.3] * 3, resize_mode="squash")
    back = imported.encoder  # the import maps every option back
    with torch.no_grad():
        images = torch.randn(2, 3, 16, 16)
        torch.testing.assert_close(back(images), ours.backbone(images), atol=1e-5, rtol=0)
    images, tokens = torch.randn(3, 3, 16, 16), ours.text_tokenizer()(["a disc", "a red star"])
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(images), ours.encode_image(images), atol=1e-5, rtol=0)
        torch.testing.assert_close(model.encode_text(tokens), ours.encode_text(tokens), atol=1e-5, rtol=0)
    assert float(model.logit_bias) == float(ours.logit_bias)


@pytest.mark.parametrize("vision", [{"layers": 2, "width": 32, "head_width": 16, "patch_size": 4, "image_size": 16},
                                    {"layers": 2, "width": 32, "head_width": 16, "patch_size": 4, "image_size": 16,
                                     "ls_init_value": 0.1, "no_ln_pre": True, "pool_type": "avg",
                                     "final_ln_after_pool": True}])
def test_open_clip_checkpoints_import_by_name_and_file_with_quick_gelu(tmp_path, vision):
    """open_clip:<name>:<file>: a registered open_clip architecture (OpenAI-style QuickGELU, nn.MultiheadAttention
    blocks) and its checkpoint file; our encoder's pooled embedding x visual.proj = open_clip's image features."""
    import open_clip

    config = {"embed_dim": 16, "quick_gelu": True, "vision_cfg": vision,
              "text_cfg": {"context_length": 8, "vocab_size": 100, "width": 32, "heads": 2, "layers": 1}}
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny-quickgelu.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "configs")
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-quickgelu").eval()
    with torch.no_grad():
        for param in model.visual.parameters():
            param.add_(0.1 * torch.randn_like(param))
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    imported = load_pretrained(f"open_clip:tiny-quickgelu:{tmp_path / 'weights.pt'}")
    assert imported.encoder.config.act_layer == "quick_gelu"
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(imported.encoder(images) @ model.visual.proj, model.visual(images),
                                   atol=1e-5, rtol=0)
    from ssl_vit.interop.open_clip import from_open_clip_visual

    model.visual.register_parameter("head_scale", torch.nn.Parameter(torch.ones(2)))  # an option we lack
    with pytest.raises(ValueError, match=r"without an equivalent here \(weights \['head_scale'\]\)"):
        from_open_clip_visual(model.visual)
    del model.visual.head_scale
    # at another size, the position embeddings resample as open_clip's own loader does (resize_pos_embed)
    model_24 = open_clip.create_model("tiny-quickgelu", pretrained=str(tmp_path / "weights.pt"),
                                      force_image_size=24).eval()
    imported.encoder.set_img_size(24)
    images = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(imported.encoder(images) @ model.visual.proj, model_24.visual(images),
                                   atol=1e-5, rtol=0)


def test_the_open_clip_export_refuses_what_it_cannot_represent(tmp_path):
    from ssl_vit.interop.open_clip import export_open_clip

    with pytest.raises(ValueError, match="num_registers=2 .*open_clip's ViT has no registers"):
        export_open_clip(clip_model(model_overrides={"num_registers": 2}), tmp_path)


@pytest.mark.slow
def test_a_lit_run_trains_only_the_text_side_from_a_saved_encoder(clip_run, tmp_path):
    """Through the CLI: the image tower comes from the CLIP run's encoder file (its architecture and 24 px, not
    model=), stays bit-identical, and the text tower trains."""
    overrides = ["objective=clip_tiny", "objective.lock_image=true", f"objective.image_encoder={clip_run}",
                 "objective.embed_dim=16", "objective.text_width=16", "objective.text_heads=2",
                 "objective.text_layers=1"]
    check_ok(pretrain_in_process(*overrides, "data.batch_size=16", "trainer.max_steps=3", f"hydra.run.dir={tmp_path}"))
    before, after = load_file(clip_run / "encoder.safetensors"), load_file(tmp_path / "encoder.safetensors")
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert load_trained(tmp_path).backbone.patch_embed.img_size[0] == 24

    from accelerate.utils import set_seed

    from ssl_vit.train.build import build_components

    set_seed(0)  # the run's initial weights: pretrain seeds with cfg.seed before building
    initial, *_ = build_components(_config(*overrides, "output_dir=x"))
    assert all(not p.requires_grad for p in initial.backbone.parameters())
    trained = load_file(tmp_path / "heads.safetensors")
    for name in ("text.transformer.resblocks.0.attn.in_proj_weight", "image_proj.weight"):
        assert not torch.equal(trained[name], initial.state_dict()[name]), name


def test_the_hf_text_tower_trains_from_a_config_and_a_local_directory(tmp_path):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    hf = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
          "intermediate_size": 32}
    model = clip_model(text_tower="hf", hf_config=hf)
    assert model.text.transformer.pooler is None  # mean pooling: BERT's pooler would never get a gradient
    batch = clip_batch(model)
    model(batch)["loss"].backward()
    assert all(p.grad is not None for p in model.text.parameters())

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "number", *WORDS, *map(str, range(10))]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path)
    local = clip_model(text_tower="hf", hf_model=str(tmp_path), hf_pooler="cls_pooler")
    tokens = local.text_tokenizer()(["a red disc", "a small blue star number 3"])
    assert tokens.shape == (2, 16) and int(tokens[0, 0]) == vocab.index("[CLS]")
    loss = local({"image": torch.randn(2, 3, 16, 16), "text": tokens})["loss"]
    assert torch.isfinite(loss)


@pytest.mark.parametrize("option", ["clip", "siglip", "clip_tiny", "siglip_tiny"])
def test_every_clip_config_composes_and_bad_values_name_the_choices(option):
    from ssl_vit.train.build import build_components

    cfg = _config(f"objective={option}", "model=vit_test", "output_dir=x")
    assert cfg.objective.name == option.removesuffix("_tiny")
    assert math.exp(cfg.objective.init_logit_scale) == pytest.approx(1 / 0.07 if "clip" in option else 10)
    with pytest.raises(ConfigError, match=r"^objective.text_tower=gpt is not one of open_clip, hf$"):
        build_components(_config(f"objective={option}", "objective.text_tower=gpt", "model=vit_test",
                                 "output_dir=x"))
    with pytest.raises(ConfigError, match="needs captions but data=digits has none"):
        build_components(_config(f"objective={option}", "data=digits", "model=vit_test", "output_dir=x"))


def test_clip_turns_on_the_pre_norm_unless_the_model_config_says_otherwise():
    from ssl_vit.train.build import build_components

    objective, *_ = build_components(_config("objective=clip_tiny", "model=vit_test", "output_dir=x"))
    assert objective.backbone.config.pre_norm and objective.backbone.patch_embed.proj.bias is None
    objective, *_ = build_components(_config("objective=clip_tiny", "model=vit_test", "model.pre_norm=false",
                                             "output_dir=x"))
    assert not objective.backbone.config.pre_norm


@pytest.mark.slow
def test_the_image_tower_exports_to_transformers_clip_vision_with_the_projection(clip_run, tmp_path):
    """scripts/export.py --to hf: CLIPVisionModelWithProjection.from_pretrained loads every weight (no missing or
    unexpected key), pooler_output = our pooled embedding and image_embeds = our CLIP image embedding."""
    from transformers import CLIPVisionModelWithProjection

    assert export_script().main([str(clip_run), "--to", "hf", "--out", str(tmp_path)]) == 0
    model, info = CLIPVisionModelWithProjection.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = load_trained(clip_run)
    images = torch.randn(3, 3, 24, 24)
    with torch.no_grad():
        out = model.eval()(pixel_values=images)
        torch.testing.assert_close(out.image_embeds, ours.encode_image(images), atol=1e-5, rtol=0)
        pooled = ours.backbone.pool(ours.backbone.forward_features(images))
        torch.testing.assert_close(model.vision_model(pixel_values=images).pooler_output, pooled, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", [{"pre_norm": True, "layer_scale": 0.1, "qkv_bias": False, "norm_bias": False}])
def test_the_hf_export_folds_layer_scale_and_refuses_what_clip_cannot_hold(tmp_path, options):
    from transformers import CLIPVisionModel

    from ssl_vit.interop.hf import export_hf

    torch.manual_seed(0)
    encoder = build_vit("vit_test", **options).eval()
    with torch.no_grad():
        for param in encoder.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    export_hf(encoder, tmp_path, "clip")
    model, info = CLIPVisionModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # without a projection: a plain CLIPVisionModel directory
    model.eval()
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values=images).pooler_output, encoder(images),
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"qk_norm=True \(.*open_clip does\); pre_norm=False .*--hf-arch vit"):
        export_hf(build_vit("vit_test", qk_norm=True), tmp_path / "refused", "clip")
