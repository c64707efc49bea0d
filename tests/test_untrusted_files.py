"""Every reader of a file a user hands us, against crafted files: a pickle whose unpickling would create a marker
file (what a malicious checkpoint does), damaged files and files of the wrong kind. The marker never appears; each
refusal is one line naming the file and how to trust it (or, for our own caches, the file is computed again with
one line saying so). Covered: resume (accelerate's registered state, the optimizer, the RNG states; DeepSpeed
shards, DCP metadata and byte items under the sharded strategies), consolidation, model.init_from and evaluate's
specs (ours, timm:, open_clip:, hf:, dino:), DeiT's teacher, the feature cache and the benchmark's cells; and the
smaller loaders' refusals (a .pth named as our encoder, a teacher file that is no run)."""

from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import TINY, check_ok, pretrain_in_process
from helpers.inprocess import run_script
from helpers.pool import OBJECTIVES, strategy_run
from hydra import compose, initialize_config_dir
from PIL import Image
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ssl_vit.cli import register_configs
from ssl_vit.data.decode import decode_rgb
from ssl_vit.data.errors import BadSampleError
from ssl_vit.data.shards import _is_remote, expand_urls
from ssl_vit.eval.benchmark import run_benchmark
from ssl_vit.eval.features import cached
from ssl_vit.interop.sources import load_pretrained
from ssl_vit.objectives import objective_class, recorded_objective_class
from ssl_vit.objectives.feature_teacher import load_feature_teacher
from ssl_vit.objectives.teacher import load_teacher
from ssl_vit.schema import ConfigError
from ssl_vit.train.checkpoint import check_contents
from ssl_vit.train.checkpoint_files import check_pickled_files
from ssl_vit.train.consolidate import full_state
from ssl_vit.untrusted import UntrustedFile, file_kind

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickled in full, this creates `marker`: the stand-in for a crafted file's code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "PAYLOAD_RAN"


def crafted(path: Path, marker: Path, raw: bool = False) -> Path:
    """`path` replaced by a torch.save (or, raw: a plain pickle) holding the payload beside ordinary entries."""
    if raw:
        path.write_bytes(pickle.dumps({"step": 3, "x": Payload(marker)}, protocol=2))
    else:
        torch.save({"step": 3, "x": Payload(marker), "w": torch.zeros(2)}, path)
    return path


def grey_png(side: int) -> bytes:
    """A side x side PNG of one grey level, encoded row by row (never held decoded): under 1 MB at 30,000 px."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(b"\0" * (side + 1)) for _ in range(side)) + packer.flush()  # filter + grey
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def one_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def test_the_payload_is_real_when_unpickled_in_full(tmp_path, marker):
    """The fixture does what a crafted file does (so a test that finds no marker shows a refusal, not a dud)."""
    torch.load(crafted(tmp_path / "x.pt", marker), weights_only=False)
    assert marker.is_file()


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    """A 4-step run of ours (checkpoints at 2 and 4), shared by the tests that craft files in copies of it."""
    run = tmp_path_factory.mktemp("short") / "run"
    check_ok(pretrain_in_process(*TINY, "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.trackers=[]",
                                 f"out={run}"))
    return run


def _copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("tb"))
    return to


@pytest.mark.parametrize("name, raw", [("custom_checkpoint_0.pkl", False), ("custom_checkpoint_0.pkl", True),
                                       ("optimizer.bin", False)])
def test_resuming_from_a_crafted_checkpoint_refuses_it_in_one_line_and_runs_nothing(short_run, tmp_path, marker,
                                                                                    name, raw):
    """The issue's case: accelerate's custom-state file (which accelerate unpickles in full) holding a payload,
    as a torch.save and as a raw pickle; and the optimizer state. trainer.resume refuses before anything loads
    (exit 2, one line naming the file and trainer.trust_pickle); trusting it runs the payload."""
    run = _copy_run(short_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step_00000004"
    crafted(checkpoint / name, marker, raw)
    args = [*TINY, "trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.trackers=[]", f"out={run}"]
    proc = pretrain_in_process(*args, f"trainer.resume={checkpoint}")
    assert proc.returncode == 2
    line = one_line(proc)
    assert line.startswith(f"ssl-vit: error: trainer.resume: {checkpoint / name} holds Python objects beyond "
                           "tensors and plain containers (")
    assert line.endswith("if you trust the file, resume with trainer.trust_pickle=true")
    assert "builtins.open" in line or "io.open" in line  # what the file wanted to call
    assert not marker.exists()
    if name == "custom_checkpoint_0.pkl" and not raw:
        proc = pretrain_in_process(*args, f"trainer.resume={checkpoint}", "trainer.trust_pickle=true")
        assert marker.is_file()  # trusted: accelerate unpickled it in full
        said = proc.stdout + proc.stderr
        assert "trainer.trust_pickle=true: " in said and "is unpickled without the weights-only check" in said


def test_a_damaged_rng_state_is_refused_unless_an_inexact_resume_is_allowed(short_run, tmp_path):
    """accelerate skips an RNG state it cannot read with an info-level log; a resume that would silently not
    reproduce is refused, or continues with the warning under trainer.allow_inexact_resume."""
    run = _copy_run(short_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step_00000004"
    state = checkpoint / "random_states_0.pkl"
    state.write_bytes(state.read_bytes()[:300])  # truncated
    args = [*TINY, "trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.trackers=[]", f"out={run}",
            f"trainer.resume={checkpoint}"]
    proc = pretrain_in_process(*args)
    assert proc.returncode == 2
    line = one_line(proc)
    assert (f"trainer.resume: {checkpoint} holds an RNG state accelerate cannot restore: random_states_0.pkl is "
            "unreadable (") in line and line.endswith("set trainer.allow_inexact_resume=true to continue anyway")
    proc = check_ok(pretrain_in_process(*args, "trainer.allow_inexact_resume=true"))
    assert "RESUME IS NOT EXACT" in proc.stdout + proc.stderr
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    torch.save({"random_state": (3, (1, 2), None)}, state)  # readable, but not what accelerate restores
    assert "lacks ['numpy_random_seed', 'torch_manual_seed']" in one_line(pretrain_in_process(*args))


def test_consolidating_a_crafted_checkpoint_refuses_it_unless_trusted(short_run, tmp_path, marker):
    checkpoint = _copy_run(short_run, tmp_path / "run") / "checkpoints" / "step_00000004"
    crafted(checkpoint / "optimizer.bin", marker)
    script = ROOT / "scripts" / "consolidate.py"
    proc = run_script(script, str(checkpoint), "--out", str(tmp_path / "whole"))
    assert proc.returncode == 2 and not marker.exists()
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"consolidate: error: {checkpoint / 'optimizer.bin'} holds Python objects beyond tensors")
    assert line.endswith("if you trust the file, consolidate with --trust-pickle")


def test_checkpoint_files_of_every_kind_are_checked_shard_by_shard(tmp_path, marker):
    """The check itself on hand-made layouts (the real checkpoints of every strategy pass it, and their DCP byte
    items are crafted in test_sharded_checkpoints_pass_and_crafted_shards_are_refused): a DeepSpeed shard, DCP's
    metadata (a raw pickle, read by an allowlist), and a shard folder that is a symbolic link to one elsewhere
    (which the libraries follow)."""
    deep = tmp_path / "deepspeed" / "pytorch_model"
    deep.mkdir(parents=True)
    crafted(deep / "zero_pp_rank_1_mp_rank_00_optim_states.pt", marker)
    with pytest.raises(UntrustedFile, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt holds Python objects .* "
                                            r"if you trust the file, HINT$"):
        check_pickled_files(tmp_path / "deepspeed", "HINT", deepspeed=True)
    dcp = tmp_path / "dcp" / "optimizer_0"
    dcp.mkdir(parents=True)
    crafted(dcp / ".metadata", marker, raw=True)
    with pytest.raises(UntrustedFile, match=r"\.metadata holds Python .*unsupported global (io|builtins)\.open"):
        check_pickled_files(tmp_path / "dcp", "HINT")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "pytorch_model").symlink_to(deep, target_is_directory=True)
    (linked / "loop").symlink_to(linked, target_is_directory=True)  # and a cycle, walked once
    with pytest.raises(UntrustedFile, match=r"linked/pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt holds"):
        check_pickled_files(linked, "HINT", deepspeed=True)
    assert not marker.exists()


def test_loading_an_import_spec_with_a_crafted_weights_file_is_one_line(tmp_path, marker):
    """timm:, open_clip:, dino: and hf: read their files as weights only (the libraries' own loaders); the
    refusal names the spec and how to trust the file, for evaluate, model.init_from and a benchmark alike."""
    transformers = pytest.importorskip("transformers")
    weights = crafted(tmp_path / "weights.pth", marker)
    hf_dir = tmp_path / "hf"
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=16)
    config.save_pretrained(hf_dir)
    crafted(hf_dir / "pytorch_model.bin", marker)
    architecture = {"img_size": 32, "patch_size": 16, "embed_dim": 192, "depth": 1, "num_heads": 3}
    for spec in (f"timm:vit_tiny_patch16_224:{weights}", f"open_clip:ViT-B-32:{weights}", f"dino:{weights}",
                 f"hf:{hf_dir}"):
        with pytest.raises(UntrustedFile) as err:
            load_pretrained(spec, architecture=lambda: architecture)
        message = str(err.value)
        assert spec in message and "holds Python objects beyond tensors" in message and "\n" not in message
        assert "builtins.open" in message or "io.open" in message, message  # what the file wanted to call
        assert "save its state dict with safetensors.torch.save_file" in message, message
    assert not marker.exists()


def test_init_from_and_evaluate_refuse_a_crafted_weights_file_in_one_line(tmp_path, marker):
    weights = crafted(tmp_path / "weights.pth", marker)
    spec = f"timm:vit_tiny_patch16_224:{weights}"
    proc = pretrain_in_process(*TINY, "trainer.max_steps=1", f"model.init_from={spec}", f"out={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert one_line(proc).startswith(f"ssl-vit: error: model.init_from: {spec}: its weights file holds Python")
    proc = run_script(ROOT / "scripts" / "evaluate.py", f"checkpoint={spec}", "data=digits", "eval=knn",
                      f"output_dir={tmp_path / 'eval'}")
    assert proc.returncode == 2 and one_line(proc).startswith(f"ssl-vit: error: checkpoint: {spec}: its weights")
    assert not marker.exists()


def test_a_teacher_file_that_is_crafted_or_no_run_is_named_in_one_line(tmp_path, marker):
    weights = crafted(tmp_path / "teacher.pth", marker)
    with pytest.raises(UntrustedFile, match=rf"^objective.teacher={weights}: its weights file holds Python objects "
                                            r".* safetensors"):
        load_teacher(f"timm:resnet10t:{weights}", 10)
    for spec in (f"open_clip:ViT-B-32:{weights}", f"timm:vit_tiny_patch16_224:{weights}"):  # distill's teachers
        with pytest.raises(UntrustedFile, match=rf"^{spec}: its weights file holds Python objects"):
            load_feature_teacher(spec)
    with pytest.raises(ValueError, match=rf"^objective.teacher: {weights} is a PyTorch file \(torch.save\), not a "
                                         rf"run's encoder.safetensors; valid forms: .*timm:<model name>:{weights}"):
        load_teacher(str(weights), 10)  # named as a run: the file, not its folder, is what is wrong
    assert not marker.exists()


def test_a_pytorch_file_named_as_our_encoder_says_what_it_is(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "encoder.pth")
    with pytest.raises(ValueError, match=r"is a PyTorch file \(torch.save\), not an ssl_vit encoder file "
                                         r"\(safetensors\); weights of another library load through its spec: "
                                         r"timm:<model name>:"):
        load_pretrained(str(tmp_path / "encoder.pth"))
    assert file_kind(tmp_path / "encoder.pth") == "a PyTorch file (torch.save)"
    (tmp_path / "x.json").write_text("{}")
    assert file_kind(tmp_path / "x.json") == "JSON"


def test_a_feature_cache_file_that_is_crafted_damaged_or_of_another_shape_is_computed_again(tmp_path, marker,
                                                                                             caplog):
    fresh = (torch.ones(3, 2), torch.tensor([0, 1, 0]))
    path = tmp_path / "key.pt"
    cases = {"crafted": lambda: crafted(path, marker), "damaged": lambda: path.write_bytes(b"PK\x03\x04 cut"),
             "another shape": lambda: torch.save({"features": torch.ones(2, 2), "labels": torch.ones(3)}, path)}
    for what, make in cases.items():
        make()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            features, labels = cached(tmp_path, "key", lambda: fresh)
        assert torch.equal(features, fresh[0]) and torch.equal(labels, fresh[1]), what
        assert len(caplog.records) == 1 and caplog.records[0].getMessage().endswith(": computed again"), what
        assert torch.equal(torch.load(path, weights_only=True)["features"], fresh[0])  # rewritten whole
    assert not marker.exists()
    assert cached(tmp_path, "key", lambda: pytest.fail("read back, not computed"))[0].shape == (3, 2)


@pytest.mark.slow
def test_benchmark_cells_of_the_wrong_shape_are_computed_again_with_a_line(tmp_path, caplog):
    """Valid JSON that is no cell ([], {"scores": 5}, another protocol's record) or no JSON at all: each rerun
    says which file and computes it again, instead of a traceback on every rerun."""
    register_configs()
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=[f"out={tmp_path / 'bench'}", "img_size=32", "encoders=[timm:resnet10t]",
                                              "datasets=[digits]", "protocols=[knn]"])
    first = run_benchmark(cfg, progress=False)
    (cell,) = (tmp_path / "bench" / "cells").glob("*.json")
    good = json.loads(cell.read_text())
    for damaged in ("[]", '{"scores": 5}', json.dumps({**good, "protocol": "linear"}), "{not json"):
        cell.write_text(damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ssl_vit"):
            again = run_benchmark(cfg, progress=False)
        assert again["computed"] == 1 and again["cells"][0]["scores"] == first["cells"][0]["scores"], damaged
        said = [r.getMessage() for r in caplog.records if "computed again" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith(f"benchmark: {cell} ") and "\n" not in said[0], damaged
    assert run_benchmark(cfg, progress=False)["read_back"] == 1


def test_a_run_file_naming_an_objective_module_in_the_working_directory_does_not_import_it(tmp_path, monkeypatch):
    """A run's heads.safetensors names its objective; `module:Class` read there is not imported from the working
    directory (where a downloaded run directory could bring the module)."""
    (tmp_path / "shipped_objective.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w')\nclass Probe: pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")
    with pytest.raises(ValueError, match=r"cannot import 'shipped_objective'"):
        recorded_objective_class("shipped_objective:Probe")
    assert not (tmp_path / "IMPORTED").exists() and "shipped_objective" not in sys.modules
    with pytest.raises(ValueError, match="has no Objective subclass"):  # the user's own config may name it
        objective_class("shipped_objective:Probe")
    sys.modules.pop("shipped_objective", None)


def test_shards_found_by_a_glob_or_a_directory_stay_files_never_shell_commands(tmp_path, monkeypatch):
    (tmp_path / "pipe:touch HACKED;.tar").write_bytes(b"\0" * 1024)
    monkeypatch.chdir(tmp_path)
    for urls in (".", "*.tar"):
        found = expand_urls(urls)
        assert found == ["./pipe:touch HACKED;.tar"] and not any(_is_remote(url) for url in found)


def test_pil_reads_raster_formats_only_never_postscript(tmp_path):
    """An EPS file named .jpg would reach Ghostscript through PIL's plugin: refused as a bad sample."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n"
    (tmp_path / "drawing.jpg").write_bytes(eps)
    with pytest.raises(BadSampleError, match=r"drawing.jpg: cannot decode the image"):
        decode_rgb(tmp_path / "drawing.jpg")


def test_a_decompression_bomb_is_skipped_before_its_pixels_are_decoded(tmp_path):
    """A 20,000 x 20,000 PNG of one grey level (under 1 MB; 1.1 GiB as RGB pixels) is refused from its header,
    whatever the decoder (data.max_pixels, PIL's bound by default); a smaller bound refuses a small image too, and
    an animation counts every frame (torchvision decodes them all)."""
    bomb = grey_png(20_000)
    assert len(bomb) < 2**20
    with pytest.raises(BadSampleError, match=r"image is 400,000,000 pixels, over data.max_pixels=89,478,485 "
                                             r"\(decoded it would take 1.1 GiB; skipped before decoding\)"):
        decode_rgb(bomb)  # past PIL's own bound, which stops its header read: the count from PIL's message
    with pytest.raises(BadSampleError, match=r"image is 12000 x 12000 = 144,000,000 pixels, over data.max_pixels"):
        decode_rgb(grey_png(12_000))
    small = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(small, format="PNG")
    assert decode_rgb(small.getvalue(), max_pixels=1200).shape == (3, 30, 40)
    with pytest.raises(BadSampleError, match=r"40 x 30 = 1,200 pixels, over data.max_pixels=1,199"):
        decode_rgb(small.getvalue(), max_pixels=1199)
    animation = io.BytesIO()
    frames = [Image.new("L", (50, 50), grey) for grey in range(0, 200, 10)]
    frames[0].save(animation, format="GIF", save_all=True, append_images=frames[1:])
    assert decode_rgb(animation.getvalue(), max_pixels=50_000).shape == (3, 50, 50)  # 20 x 2,500 pixels
    with pytest.raises(BadSampleError, match=r"image is 20 frames of 50 x 50 = 50,000 pixels, over data.max_pixels"):
        decode_rgb(animation.getvalue(), max_pixels=49_999)


def test_check_contents_reports_a_damaged_file_with_the_checkpoints_left(short_run, tmp_path):
    checkpoint = _copy_run(short_run, tmp_path / "run") / "checkpoints" / "step_00000004"
    (checkpoint / "optimizer.bin").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(ConfigError, match=r"^trainer.resume: .*step_00000004/optimizer.bin is unreadable \(.*\); an "
                                          r"earlier checkpoint of this run may still be good: trainer.resume=.*"
                                          r"step_00000002$"):
        check_contents(checkpoint, 1, False, False)
    with pytest.raises(ValueError, match=r"step_00000004/optimizer.bin is unreadable \(RuntimeError: "):
        full_state(checkpoint)  # consolidation reads the same files through the same check


@pytest.mark.slow
def test_a_folder_with_a_decompression_bomb_trains_in_bounded_memory(tmp_path):
    """The issue's case: a 30,000 x 30,000 single-colour PNG among a folder's images. The 3-step run skips and
    counts it; its peak resident memory (the process and its 2 loader workers, the largest of them) stays far
    below the 2.5 GiB that decoding it takes (5.8 GB measured before the bound)."""
    root = tmp_path / "images" / "a"
    root.mkdir(parents=True)
    for i in range(8):
        Image.new("RGB", (16, 16), (20 * i, 40, 90)).save(root / f"{i}.png")
    (root / "bomb.png").write_bytes(grey_png(30_000))
    child = ("import resource, runpy, sys\n"
             "sys.argv = sys.argv[1:]\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "finally:\n"
             "    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
             " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
             "    print(f'PEAK_KIB {peak}', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", child, str(ROOT / "scripts" / "pretrain.py"), "model=vit_test",
                           "objective=masked_patch", "data=folder", f"data.root={tmp_path / 'images'}",
                           "data.img_size=16", "data.batch_size=4", "data.num_workers=2", "trainer.max_steps=3",
                           "trainer.progress=false", "trainer.trackers=[]", f"out={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak_gib = int(proc.stderr.split("PEAK_KIB ")[1].split()[0]) / 2**20
    assert peak_gib < 2.5, peak_gib  # the decoded bomb alone is 2.5 GiB (0.83 GiB measured alone on 2 cores)
    said = proc.stdout + proc.stderr
    assert "bomb.png: image is 900,000,000 pixels, over data.max_pixels=89,478,485" in said
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_samples"] == 1


def _craft_dcp_byte_item(directory: Path, marker: Path) -> str:
    """The payload as the first byte item of DCP's `directory` (.metadata's offsets moved to fit it); its name."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn],
                                                                  BytesStorageMetadata))
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    payload = buffer.getvalue()
    data_file = directory / info.relative_path
    data = bytearray(data_file.read_bytes())
    data[info.offset:info.offset + info.length] = payload
    for other in metadata.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += len(payload) - info.length
    info.length = len(payload)
    data_file.write_bytes(bytes(data))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return index.fqn


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["zero1_cpu2", "zero2_cpu2", "zero3_cpu2", "fsdp2_cpu2"])
def test_sharded_checkpoints_pass_and_crafted_shards_are_refused(pool, tmp_path, marker, config):
    """The real checkpoints of 2-process DINOv3 runs (EMA and Gram teachers, sharded optimizer; CLIP's under ZeRO-1)
    pass the check; a payload in a DeepSpeed optimizer shard (which DeepSpeed and zero_to_fp32 unpickle in full),
    in DCP's .metadata (pickle.load) or in a DCP byte item (torch.load(weights_only=False)) is refused by the
    resume's check and by consolidation; the ZeRO-2 one through a real 2-process resume."""
    run = pool["clip" if config == "zero1_cpu2" else "dinov3", config]  # the pool's ZeRO-1 run is CLIP's
    real = run / "checkpoints" / "step_00000003"
    check_contents(real, 2, False, False)
    copy = tmp_path / "run" / "checkpoints" / "step_00000003"
    shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("tb", "step_00000005"))
    if config == "fsdp2_cpu2":
        cases = {"metadata": lambda: crafted(copy / "optimizer_0" / ".metadata", marker, raw=True),
                 "byte item": lambda: _craft_dcp_byte_item(copy / "optimizer_0", marker)}
    else:
        shard = copy / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        cases = {"optimizer shard": lambda: crafted(shard, marker)}
    for what, craft in cases.items():
        shutil.rmtree(copy)
        shutil.copytree(real, copy)
        named = craft()
        with pytest.raises(ConfigError, match=r"^trainer.resume: .* holds Python objects beyond tensors .* resume "
                                              r"with trainer.trust_pickle=true$") as err:
            check_contents(copy, 2, False, False)
        if what == "byte item":
            assert f"(item {named})" in str(err.value)
        with pytest.raises(UntrustedFile, match="consolidate with --trust-pickle"):
            full_state(copy)
        assert not marker.exists(), what
    if config == "zero2_cpu2":
        proc = strategy_run(config, tmp_path / "resumed", *OBJECTIVES["dinov3"], f"trainer.resume={copy}")
        assert proc.returncode != 0 and not marker.exists()
        assert (f"ssl-vit: error: trainer.resume: {copy / 'pytorch_model' / shard.name} holds Python objects"
                in proc.stderr), proc.stderr[-3000:]


def test_an_hf_directory_that_names_its_own_code_is_refused_and_the_code_never_runs(tmp_path, marker):
    """A config.json with auto_map (transformers' remote code): loaded with trust_remote_code=False, as a ViT or a
    library-native encoder, so transformers refuses it instead of asking on a terminal; its module never runs."""
    pytest.importorskip("transformers")
    model = tmp_path / "custom"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "crafted_vision", "architectures": ["CraftedModel"],
        "auto_map": {"AutoConfig": "configuration_crafted.CraftedConfig",
                     "AutoModel": "modeling_crafted.CraftedModel"}}))
    for name in ("configuration_crafted.py", "modeling_crafted.py"):
        (model / name).write_text(f"open({str(marker)!r}, 'w')\n")
    for native in ("fallback", "always"):
        with pytest.raises(ValueError, match="trust_remote_code"):
            load_pretrained(f"hf:{model}", native=native)
    assert not marker.exists()
