"""The installed face of the project: the `ssl-vit` command, the Python API, optional features without their extra,
shipped accelerate configs found from any directory, and `import ssl_vit` staying light."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.processes import index_reachable

import ssl_vit
from ssl_vit.commands import COMMANDS, main
from ssl_vit.extras import MissingExtra, require
from ssl_vit.launch import shipped_config
from ssl_vit.paths import CONFIG_DIR


def test_the_command_lists_every_script_and_refuses_an_unknown_one_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    listed = capsys.readouterr().out
    scripts = {path.stem for path in (CONFIG_DIR.parent / "scripts").glob("*.py")} - {"__init__"}
    assert {module for module, _ in COMMANDS.values() if module} == scripts
    assert all(f"  {name} " in listed for name in COMMANDS)
    with pytest.raises(SystemExit) as stop:
        main(["pretrian"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("ssl-vit: error: unknown command 'pretrian'; did you mean pretrain?")
    main(["--version"])
    assert capsys.readouterr().out == f"ssl-vit {ssl_vit.__version__}\n"


def test_a_missing_optional_package_is_one_line_naming_its_extra(monkeypatch, tmp_path):
    from ssl_vit.backbone import build_vit
    from ssl_vit.interop.hf import hf_config
    from ssl_vit.interop.onnx import export_onnx

    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ModuleNotFoundError, as when absent
    with pytest.raises(MissingExtra, match=r"^a transformers export \(--to hf\) needs transformers, which is not "
                                           r"installed here: pip install 'ssl-vit\[hf\]'$"):
        hf_config({}, "vit")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingExtra, match=r"pip install 'ssl-vit\[onnx\]'$"):
        export_onnx(build_vit("vit_test"), tmp_path)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(MissingExtra, match=r"^a DeepSpeed ZeRO launch .* pip install 'ssl-vit\[deepspeed\]'$"):
        require("deepspeed", "a DeepSpeed ZeRO launch (this accelerate config)")


def test_an_import_error_inside_an_installed_package_is_its_own(monkeypatch):
    def broken(name):
        raise ModuleNotFoundError("No module named 'numpy._core'", name="numpy._core")

    monkeypatch.setattr("ssl_vit.extras.importlib.import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="numpy._core"):
        require("onnxruntime", "an ONNX export")


def test_a_shipped_accelerate_config_is_found_by_name_with_its_deepspeed_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a checkout: configs/deepspeed/... does not resolve from here
    copy = Path(shipped_config("zero3_cpu2", tmp_path))
    json_file = Path(yaml.safe_load(copy.read_text())["deepspeed_config"]["deepspeed_config_file"])
    assert json_file.is_absolute() and json_file.is_file() and json_file.parent == CONFIG_DIR / "deepspeed"
    assert shipped_config(str(copy), tmp_path) == str(copy)  # a file is taken as it is
    with pytest.raises(FileNotFoundError, match=r"--config_file ddp_gpu9: .* \(shipped: cpu, ddp_cpu2, ddp_gpu8"):
        shipped_config("ddp_gpu9", tmp_path)


def test_keyword_overrides_become_the_command_lines():
    from ssl_vit.api import _keyword_overrides

    assert _keyword_overrides({"model": "vit_s16", "trainer": {"max_steps": 3, "compile": True, "resume": None},
                               "data": {"mean": [0.5, 0.5]}}) == [
        "model=vit_s16", "trainer.max_steps=3", "trainer.compile=true", "trainer.resume=null", "data.mean=[0.5,0.5]"]


@pytest.mark.slow
def test_import_ssl_vit_loads_neither_torch_nor_the_data_stack():
    probe = ("import sys, ssl_vit; print(sorted(m for m in ('torch', 'ssl_vit.data', 'hydra', 'accelerate') "
             "if m in sys.modules)); print(ssl_vit.__version__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", ssl_vit.__version__]


@pytest.mark.slow
def test_the_api_trains_twice_in_one_process_then_evaluates_the_first_run(tmp_path, monkeypatch):
    import timm
    import torch
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from safetensors.torch import load_file

    from ssl_vit.schema import ConfigError

    monkeypatch.chdir(tmp_path)
    first = ssl_vit.pretrain("objective=masked_patch", "model=vit_test", "data.num_samples=32",
                             "data.batch_size=16", out="mp", trainer={"max_steps": 2})
    second = ssl_vit.pretrain("objective=dino_tiny", "model=vit_test", "data.num_samples=16", "data.batch_size=8",
                              "trainer.max_steps=1", out=tmp_path / "dino")
    assert first == tmp_path / "mp" and second == tmp_path / "dino"
    for run, objective in ((first, "masked_patch"), (second, "dino")):
        assert (run / "encoder.safetensors").is_file() and (run / ".hydra" / "overrides.yaml").is_file()
        assert yaml.safe_load((run / "config.yaml").read_text())["objective"]["name"] == objective
    report = ssl_vit.evaluate(first, "data=digits", "eval=knn")
    assert report["checkpoint"] == str(first) and (first / "eval" / "digits" / "results.json").is_file()
    assert not GlobalHydra.instance().is_initialized() and not HydraConfig.initialized()
    with pytest.raises(ConfigError, match=r"^objective=nope is not an option of objective"):
        ssl_vit.pretrain("objective=nope", out="refused")
    assert not (tmp_path / "refused").exists()
    encoder = ssl_vit.load_encoder(first)
    assert encoder.hidden_size == ssl_vit.create_model("vit_test").embed_dim
    # the export of `ssl-vit export`: timm loads it with the run's weights
    assert "timm.create_model('local-dir:" in ssl_vit.export(first, "timm", tmp_path / "timm")
    exported = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True)
    torch.testing.assert_close(exported.state_dict()["patch_embed.proj.weight"],
                               load_file(first / "encoder.safetensors")["patch_embed.proj.weight"])
    with pytest.raises(ValueError, match=r"^to='tflite' is not a target; valid choices: \['hf', 'timm'"):
        ssl_vit.export(first, "tflite", tmp_path / "no")


@pytest.mark.slow
def test_the_built_wheel_installs_and_runs_from_an_empty_directory(tmp_path):
    """The wheel, installed without dependencies into a fresh venv that sees this venv's packages (a .pth line: not
    its editable install), trains, evaluates and exports from a directory that is not the checkout."""
    import sysconfig
    import zipfile

    root = CONFIG_DIR.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(root)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("ssl_vit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"ssl_vit", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "ssl_vit/configs/pretrain.yaml" in names and "ssl_vit/objectives/mae.py" in names
    assert "ssl_vit/configs/deepspeed/zero3.json" in names and "ssl_vit/scripts/export.py" in names
    shipped = {f"ssl_vit/configs/{path.relative_to(CONFIG_DIR)}" for path in CONFIG_DIR.rglob("*.*")
               if path.suffix in (".yaml", ".json")}
    assert len(shipped) > 50 and shipped <= set(names), sorted(shipped - set(names))  # a new group: pyproject
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "dev-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True)
    work = tmp_path / "empty"
    work.mkdir()
    command = str(venv / "bin" / "ssl-vit")
    for args in (["pretrain", "objective=masked_patch", "model=vit_test", "trainer.max_steps=3", "out=run"],
                 ["evaluate", "run", "data=digits", "eval=knn"], ["export", "run", "--to", "timm", "--out", "exp"]):
        done = subprocess.run([command, *args], cwd=work, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    assert (work / "run" / "eval" / "digits" / "results.json").is_file() and (work / "exp" / "config.json").is_file()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import ssl_vit.objectives as o; print(o.__file__)"],
                           cwd=work, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site))


def _python(version: str) -> str | None:
    """The interpreter of `version` here (e.g. a pyenv one), or None."""
    found = subprocess.run([f"python{version}", "-c", "import sys; print(sys.executable)"], capture_output=True,
                           text=True)
    return found.stdout.strip() if found.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.network
def test_the_wheelhouse_for_the_gpu_node_resolves_beside_its_torch_and_installs_offline(tmp_path):
    """tools/wheelhouse.py for the GPU node the README's figures come from (Python 3.12, torch 2.11.0, torchvision
    0.26.0, transformers 5.17.0, timm 1.0.29 pinned as the target has them, and its scientific stack): pip's
    --dry-run --report resolution of ssl-vit[deepspeed] beside them succeeds and installs none of them; the folder
    holds what the node lacks (the sdists deepspeed and antlr4 built into wheels), no torch, under 64 MiB; where a
    Python 3.12 is here, pip installs ssl-vit from the folder alone (--no-index) into a venv that has the node's
    packages (as stubs)."""
    if not index_reachable():
        pytest.skip("the package index (pypi.org) cannot be reached")
    root = CONFIG_DIR.parent
    python312 = _python("3.12")
    have = ("torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 timm==1.0.29 accelerate==1.15.0 safetensors "
            "scipy scikit-learn tensorboard matplotlib numpy pillow")  # the node's image (make wheelhouse's HAVE)
    done = subprocess.run([sys.executable, str(root / "tools" / "wheelhouse.py"), "--out", str(tmp_path / "wh"),
                           "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--have", have,
                           "--extras", "deepspeed", *(["--check", python312] if python312 else [])],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    manifest = json.loads((tmp_path / "wh" / "wheelhouse.json").read_text())
    names = {name.split("-")[0].lower() for name in manifest["files"]}
    assert {"ssl_vit", "hydra_core", "omegaconf", "antlr4_python3_runtime", "open_clip_torch", "webdataset",
            "torchdata", "kornia", "deepspeed"} <= names
    assert not names & {"torch", "torchvision", "torchaudio", "triton", "transformers", "timm", "accelerate"}
    assert not any(name.startswith("nvidia") for name in names) and manifest["left_out"] == []
    assert manifest["total_bytes"] < 64 * 2**20
    assert sorted(path.name for path in (tmp_path / "wh").glob("*.whl")) == sorted(manifest["files"])
    if python312:
        installed = {entry.split("==")[0] for entry in manifest["checked_install"]}
        assert "ssl-vit" in installed and not installed & {"torch", "torchvision", "transformers", "timm"}
