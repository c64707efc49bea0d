"""The shape of the house, checked: no import circles (traced as Python imports each module alone), no imports
inside functions to dodge one, and an engine (ssl_vit/train/) that names no objective, no objective config key and
no dataset."""

import ast
import json
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import ROOT

from ssl_vit.backbone import ViTConfig
from ssl_vit.config import EvalConfig, ModelConfig, OptimConfig, PlanConfig, PretrainConfig, TrainerConfig
from ssl_vit.data import DATASETS
from ssl_vit.data.config import AugRegConfig
from ssl_vit.objectives import OBJECTIVES, ObjectiveConfig

TRACE = ROOT / "tests" / "helpers" / "import_trace.py"
PACKAGES = ("ssl_vit", "objectives")  # the folders; installed, objectives/ is ssl_vit.objectives
FOLDERS = ("ssl_vit", "objectives=ssl_vit.objectives")


def _trace(root: Path, packages, parts: int = 2) -> dict:
    """The tracer's report, its modules shared by `parts` processes at once (one a core here)."""
    procs = [subprocess.Popen([sys.executable, str(TRACE), str(root), ",".join(packages), f"{part}/{parts}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in range(parts)]
    report = {"modules": [], "circles": [], "errors": {}}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        part = json.loads(out.splitlines()[-1])
        report["modules"] += part["modules"]
        report["circles"] += part["circles"]
        report["errors"].update(part["errors"])
    report["circles"].sort()
    return report


@pytest.mark.slow
def test_no_module_imports_another_while_that_one_is_still_being_imported(tmp_path):
    """Every module imported alone, from nothing, with each import checked against the modules still executing;
    the tracer itself is shown to see a circle in a package made with one."""
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loop.b import B\nA = 1\n")
    (package / "b.py").write_text("import loop.a\nB = 2\n")
    # each module alone: a's import of b meets a still executing, and b's of a meets b
    assert _trace(tmp_path, ["loop"])["circles"] == [["loop.a", "loop.b"], ["loop.b", "loop.a"]]
    report = _trace(ROOT, FOLDERS)
    assert len(report["modules"]) > 50 and "ssl_vit.train.trainer" in report["modules"]
    assert report["errors"] == {} and report["circles"] == []


def _functions_imports(path: Path):
    """(line, modules, whether a comment is on it or the two lines above) of each import inside a function."""
    lines = path.read_text().splitlines()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    names = [inner.module or ""] if isinstance(inner, ast.ImportFrom) else [a.name for a in
                                                                                            inner.names]
                    commented = any("#" in line for line in lines[max(inner.lineno - 3, 0):inner.lineno])
                    yield inner.lineno, names, commented or getattr(inner, "level", 0) > 0


def test_imports_inside_functions_are_only_of_heavy_optional_libraries_and_say_so():
    """No project module is imported inside a function (that only hides a circle); a third-party one may be, for
    import time, with a comment saying why."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, names, commented in _functions_imports(path):
                where = f"{path.relative_to(ROOT)}:{line} {names}"
                if any(name.split(".")[0] == "ssl_vit" for name in names):
                    found.append(f"{where}: a project module")
                elif not commented:
                    found.append(f"{where}: no comment saying why it is imported here")
    assert found == []


def _code_words(path: Path) -> tuple[set[str], set[str]]:
    """(identifiers, attribute names, keyword names and whole string constants; the words inside string constants)
    of a module's code, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names, words = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
            words.update("".join(c if c.isalnum() or c == "_" else " " for c in node.value).split())
    return names, words


def test_the_engine_names_no_objective_no_objective_config_key_and_no_dataset():
    """ssl_vit/train/ speaks the objective contract and the dataset registry only: no name of an objective (or of
    its config options, e.g. dino_tiny), no key of an objective's config that the engine's own schemas lack, no
    dataset name (a dataset name may be an English word inside a message: "needs captions")."""
    engine_keys = {f.name for schema in (ObjectiveConfig, ModelConfig, OptimConfig, TrainerConfig, EvalConfig,
                                         PretrainConfig, AugRegConfig, *(kind.config for kind in DATASETS.values()))
                   for f in fields(schema)}
    objective_keys = {f.name for cls in OBJECTIVES.values() for f in fields(cls.config_class)} - engine_keys
    names = set(OBJECTIVES) | {path.stem for path in (ROOT / "configs" / "objective").glob("*.yaml")} | {"lit"}
    found = {}
    for path in sorted((ROOT / "ssl_vit" / "train").glob("*.py")):
        code_names, message_words = _code_words(path)
        found[str(path.relative_to(ROOT))] = sorted((code_names & (names | objective_keys | set(DATASETS)))
                                                    | (message_words & (names | objective_keys)))
    assert len(found) >= 8 and "mask_ratio" in objective_keys and "lock_image" in objective_keys
    assert {path: words for path, words in found.items() if words} == {}


def _unbounded_loops(source: str) -> list[int]:
    """Lines of `while <constant true>` loops that never yield: only a stream's generator loop (which hands out an
    item every pass, e.g. the loader's batch sampler) may run without a bound."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.While) and isinstance(node.test, ast.Constant) and node.test.value
            and not any(isinstance(inner, ast.Yield | ast.YieldFrom) for inner in ast.walk(node))]


def test_no_loop_of_the_library_runs_without_a_bound():
    """Rejection sampling retries a bounded number of times (I-JEPA's block placement once retried for ever when
    no placement could keep enough patches: a step that never ended)."""
    assert _unbounded_loops("while True:\n    tries += 1\n") == [1]
    assert _unbounded_loops("def draws():\n    while True:\n        yield 1\n") == []
    found = [f"{path.relative_to(ROOT)}:{line}" for package in (*PACKAGES, "scripts", "tools")
             for path in sorted((ROOT / package).rglob("*.py")) for line in _unbounded_loops(path.read_text())]
    assert found == []


def _torch_loads(source: str) -> list[tuple[int, str]]:
    """(line, its weights_only argument as source, or "absent") of each torch.load call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
            value = next((kw.value for kw in node.keywords if kw.arg == "weights_only"), None)
            found.append((node.lineno, "absent" if value is None else ast.unparse(value)))
    return found


def test_the_library_loads_pickles_safely_unless_the_user_says_to_trust_the_file():
    """Every torch.load of ssl_vit/, objectives/, scripts/ and benchmarks/ says weights_only=True, or follows the
    user's --trust-pickle (`not trust_pickle`, whose default is False); never weights_only=False."""
    assert _torch_loads("torch.load(f)\ntorch.load(f, weights_only=False)\n") == [(1, "absent"), (2, "False")]
    found = {f"{path.relative_to(ROOT)}:{line}": arg for package in (*PACKAGES, "scripts", "benchmarks", "tools")
             for path in sorted((ROOT / package).rglob("*.py")) for line, arg in _torch_loads(path.read_text())}
    assert len(found) >= 3 and set(found.values()) == {"True", "not trust_pickle"}, found
    assert any(where.startswith("ssl_vit/untrusted.py:") for where in found)  # load_tensors, shared by readers
    source = (ROOT / "ssl_vit" / "train" / "consolidate.py").read_text()
    defaults = [ast.unparse(node) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.arg)
                and node.arg == "trust_pickle"]
    assert len(defaults) >= 3 and "trust_pickle: bool = False" in source


def _calls(source: str) -> list[tuple[str, list[str]]]:
    """(the called name as written, its keyword arguments as `name=value` source) of every call."""
    return [(ast.unparse(node.func), [f"{kw.arg}={ast.unparse(kw.value)}" for kw in node.keywords])
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]


def test_nothing_but_the_untrusted_module_unpickles_and_resume_checks_before_accelerate_loads():
    """The other ways a file could run code: pickle.load(s) only in ssl_vit/untrusted.py (its allowlisted
    Unpickler), no numpy allow_pickle, no yaml.load / unsafe_load / full_load, no trust_remote_code=True; and the
    one accelerate load_state, in ssl_vit/train/checkpoint.py, comes after the main process's check_contents."""
    found = []
    for package in (*PACKAGES, "scripts", "benchmarks", "tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, keywords in _calls(path.read_text()):
                where = f"{path.relative_to(ROOT)}: {name}({', '.join(keywords)})"
                if name in ("pickle.load", "pickle.loads", "pickle.Unpickler") and \
                        path != ROOT / "ssl_vit" / "untrusted.py":
                    found.append(where)
                if name.endswith(("yaml.load", "yaml.unsafe_load", "yaml.full_load")) or \
                        "allow_pickle=True" in keywords or "trust_remote_code=True" in keywords:
                    found.append(where)
                if name.endswith(".load_state") and path != ROOT / "ssl_vit" / "train" / "checkpoint.py":
                    found.append(where)
    assert found == []
    source = (ROOT / "ssl_vit" / "train" / "checkpoint.py").read_text()
    body = source[source.index("def load_checkpoint"):]
    assert body.index("check_contents") < body.index("accelerator.load_state(")


def _schemas() -> list[type]:
    """The schemas written out in source (ModelConfig is made from ViTConfig's fields, with their checks)."""
    return [ViTConfig, OptimConfig, TrainerConfig, EvalConfig, PretrainConfig, PlanConfig, AugRegConfig,
            *(kind.config for kind in DATASETS.values()), *(cls.config_class for cls in OBJECTIVES.values())]


def test_every_string_choice_is_stated_once_in_its_schema():
    """A string option with a fixed set of values carries `checked(choices=<the library's tuple>)` (validated with
    one message: value, valid choices, closest); none lists its choices only in a comment ("a | b")."""
    import inspect

    found = []
    for schema in _schemas():
        lines, _ = inspect.getsourcelines(schema)
        for f in fields(schema):
            if "str" not in str(f.type) or "choices" in f.metadata:
                continue
            line = next((text for text in lines if text.strip().startswith(f"{f.name}:")), "")
            comment = line.partition("#")[2]
            if " | " in comment:
                found.append(f"{schema.__name__}.{f.name}: {comment.strip()}")
    checked_fields = [f"{s.__name__}.{f.name}" for s in _schemas() for f in fields(s) if "choices" in f.metadata]
    assert len(checked_fields) >= 25 and "DINOConfig.centering" in checked_fields
    assert found == []


STRATEGY_FACTS = ("DistributedType", "distributed_type", "deepspeed_plugin", "zero_stage", "fsdp_plugin",
                  "fully_shard", "DTensor", "ds_tensor", "ds_status", "GatheredParameters")


def test_the_engine_asks_strategy_facts_of_the_strategy_module_only():
    """Which strategy runs (ZeRO-3? FSDP2?) and how to gather are read in ssl_vit/train/strategy.py alone; the rest
    of the engine calls its verbs (is_sharded, full_state_dict, prepare_model, ...). Below the engine, objectives
    use the shared shard helpers (ssl_vit.partition, ssl_vit.ema) without naming the engine."""
    found = {}
    for path in sorted((ROOT / "ssl_vit" / "train").glob("*.py")):
        if path.name != "strategy.py":
            names, _ = _code_words(path)
            found[path.name] = sorted(names & set(STRATEGY_FACTS))
    assert "trainer.py" in found and {name: words for name, words in found.items() if words} == {}
    strategy = ROOT / "ssl_vit" / "train" / "strategy.py"
    assert {"DistributedType", "zero_stage"} <= _code_words(strategy)[0]
    assert "def prepare_model(" in strategy.read_text()


@pytest.mark.parametrize("overrides", [["objective=supervised", "data=folder", "data.root=/nonexistent"],
                                       ["objective=dino_tiny"], ["objective=mae"], ["objective=clip_tiny"]])
def test_building_a_run_reads_its_config_and_never_writes_it(overrides, tmp_path):
    """The build step takes a read-only config (pretrain sets it read-only once built): resolved values (the
    folder's labels, a distilled student's teachers) are passed on, not written back."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ssl_vit.cli import register_configs
    from ssl_vit.train.build import build_components

    register_configs()
    root = tmp_path / "images"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        from PIL import Image

        Image.new("RGB", (8, 8)).save(root / label / "0.png")
    overrides = [o.replace("/nonexistent", str(root)) for o in overrides]
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("pretrain", overrides=["model=vit_test", "data.num_samples=8", "output_dir=x", *overrides]
                      if "data=folder" not in overrides else ["model=vit_test", "output_dir=x", *overrides])
    OmegaConf.set_readonly(cfg, True)
    objective, dataset, *_ = build_components(cfg)
    assert OmegaConf.is_readonly(cfg) and len(dataset) > 0 and objective.backbone is not None


def test_the_backbone_forward_asks_no_input_kind_and_its_config_is_frozen():
    """Dense and NaFlex batches differ in ssl_vit/backbone/embeddings.py alone (the placement it returns is all the
    blocks see); a built model's ViTConfig cannot be changed in place, and a resize gives a new one."""
    import dataclasses

    import pytest

    from ssl_vit.backbone import build_vit

    backbone = ROOT / "ssl_vit" / "backbone"
    asking = [path.name for path in sorted(backbone.glob("*.py"))
              if "is_naflex" in path.read_text() and path.name != "embeddings.py"]
    assert asking == []
    vit = build_vit("vit_test")
    before = vit.config
    with pytest.raises(dataclasses.FrozenInstanceError):
        vit.config.embed_dim = 64
    vit.set_img_size(32)
    assert before.img_size == 16 and vit.config.img_size == (32, 32) and vit.config is not before


def test_a_parameters_full_shape_and_size_are_read_through_the_partition_module():
    """`full_shape` / `full_numel` (ssl_vit/partition.py) are the one place that knows a ZeRO-3 parameter's real shape
    lives in `ds_shape`; nothing else reads it by name, except the strategy's ZeRO-3 gather (which rebuilds it)."""
    readers = {f"{path.relative_to(ROOT)}:{number}" for package in PACKAGES
               for path in sorted((ROOT / package).rglob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if ("ds_shape" in line or "ds_numel" in line) and path.name != "partition.py"}
    assert {where.split(":")[0] for where in readers} <= {"ssl_vit/train/strategy.py"}, readers


def test_no_view_type_is_asked_outside_the_data_package():
    """The view builders (ssl_vit/data: ViewBuilder, NaFlexViews, NaFlexEvalViews) answer for their own batches:
    their sampler, the shape schedule, the images and tokens of a batch, the loss factor, what a feature cache must
    key on. Nothing outside ssl_vit/data asks which builder it holds (isinstance, or an attribute probed by name)."""
    view_classes = ("ViewBuilder", "NaFlexViews", "NaFlexEvalViews", "MultiCropViews")
    asking = re.compile(r"isinstance\([^)]*(" + "|".join(view_classes) + r")|getattr\([^,]*views\b")
    found = [f"{path.relative_to(ROOT)}:{number}" for package in PACKAGES
             for path in sorted((ROOT / package).rglob("*.py")) if "data" not in path.relative_to(ROOT).parts
             for number, line in enumerate(path.read_text().splitlines(), 1) if asking.search(line)]
    assert not found, found
    assert asking.search("if isinstance(views, NaFlexViews):") and asking.search('getattr(self.run.views, "x")')


def test_evaluate_and_benchmark_read_one_protocol_table():
    """`ssl-vit evaluate` and `ssl-vit benchmark` run the frozen-feature protocols and key their settings through
    ssl_vit/eval/protocols.py alone: neither calls an evaluator function of those protocols itself."""
    runners = re.compile(r"\b(linear_probe|knn_eval|fewshot_eval)\(")
    found = [f"{name}:{number}" for name in ("run.py", "benchmark.py")
             for number, line in enumerate((ROOT / "ssl_vit" / "eval" / name).read_text().splitlines(), 1)
             if runners.search(line)]
    assert not found, found
    assert runners.search("details = knn_eval(train_x, ...)")
