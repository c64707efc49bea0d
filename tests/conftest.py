"""What the test files share (helpers.* has the machinery): the tiers' markers enforced, the session's pool of
2-process runs, the reference 30-step run, and small helpers.

Tiers (markers registered in pyproject.toml): `slow` trains for more than a few steps or starts processes;
`distributed` runs several processes. `make test-fast` runs the rest (`-m "not slow and not distributed"`); a test
outside those markers that starts a process fails, naming the marker it needs."""

import io
import os
import subprocess
import tarfile
from pathlib import Path

import helpers.ranks
import pytest
import torch
from helpers.cores import own_share
from helpers.inprocess import pretrain as pretrain_in_process
from helpers.pool import RunPool
from helpers.processes import ACCELERATE, ACCELERATE_LAUNCH, ROOT, check_ok, launch, read_metrics  # noqa: F401

own_share()  # helpers.cores: a pytest-xdist worker on its share of the cores
TINY = ["model=vit_test", "data.num_samples=32", "data.batch_size=16", "trainer.log_every=1",
        "optim.lr=3e-3", "optim.lr_scaling=none", "optim.warmup_steps=3", "trainer.checkpoint_every=10"]


@pytest.fixture(scope="session", autouse=True)
def _own_cache(tmp_path_factory):
    """ssl-vit's user cache (features of evaluated imports) in the session's temporary directory, not ~/.cache."""
    os.environ["SSL_VIT_CACHE"] = str(tmp_path_factory.mktemp("ssl_vit_cache"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """accelerate keeps one process-wide state (precision, device); each test starts from a clean one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _refuse_processes(nodeid: str):
    """Make starting a process (subprocess, or a forked one of helpers.ranks) fail, naming the marker; returns the
    function that undoes it."""
    started, forked = subprocess.Popen.__init__, helpers.ranks._start

    def refuse(self, args, *rest, **kwargs):
        program = args.split()[0] if isinstance(args, str) else str(args[0])
        if Path(program).name in {"ldconfig", "uname", "lscpu"}:
            return started(self, args, *rest, **kwargs)  # torch, platform, DeepSpeed asking the system about itself
        raise AssertionError(f"{nodeid} starts a process ({args!r}): mark it slow (pytest.mark.slow)")

    def refuse_fork(process):
        raise AssertionError(f"{nodeid} starts a process ({process.name}): mark it distributed (several processes "
                             "in one group) or slow")

    subprocess.Popen.__init__, helpers.ranks._start = refuse, refuse_fork

    def undo():
        subprocess.Popen.__init__, helpers.ranks._start = started, forked
    return undo


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The fast tier starts no process: a test that does, or a fixture it is the first to ask for, carries `slow`
    or `distributed`."""
    marked = item.get_closest_marker("slow") or item.get_closest_marker("distributed")
    undo = None if marked else _refuse_processes(item.nodeid)
    try:
        yield
    finally:
        if undo is not None:
            undo()


SHARED = ("pool", "reference_run")  # the session fixtures: computed once on whichever worker runs their modules


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into the groups it schedules by
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (`make test`: -n 2 --dist loadgroup) each module's tests run on one worker (their module
    fixtures computed once), and every module that uses a session fixture of SHARED on the same worker (the pool's
    runs launched once, as without xdist)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    parent: dict[str, str] = {}  # modules and shared fixtures, joined when a module's test uses the fixture

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    for item in items:
        for shared in SHARED:
            if shared in item.fixturenames:
                parent[root(item.module.__name__)] = root(shared)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(root(item.module.__name__)))


@pytest.fixture(scope="session")
def pool(tmp_path_factory) -> RunPool:
    """The 2-process runs several files compare (helpers.pool), each launched once, when first asked for."""
    return RunPool(tmp_path_factory.mktemp("pool"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """An uninterrupted 30-step run of TINY through the CLI, in this process (shared by the resume, Ctrl-C and
    fault-injection tests)."""
    out = tmp_path_factory.mktemp("reference")
    check_ok(pretrain_in_process(*TINY, "trainer.max_steps=30", f"hydra.run.dir={out}"))
    return out


def script_module(path: str):
    """A script of the repository (scripts/..., benchmarks/...) as a module, to call its functions in-process:
    each CLI process costs ~6 s of imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_script():
    """scripts/export.py as a module (its `main(argv)` in-process)."""
    return script_module("scripts/export.py")


def assert_weights_close(ours: dict, reference: dict, atol: float, rtol: float, key_bias_atol: float) -> None:
    """State dicts equal within atol / rtol, the key part of every fused qkv bias within key_bias_atol: its exact
    gradient is zero (softmax ignores a shift of all of a query's logits), so its computed gradient is rounding noise,
    which Adam turns into lr-sized steps whose sign the order of the float sums decides."""
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        got = ours[name]
        if name.endswith("qkv.bias"):
            keys = slice(value.shape[0] // 3, 2 * value.shape[0] // 3)
            torch.testing.assert_close(got[keys], value[keys], atol=key_bias_atol, rtol=0, msg=name)
            got = torch.cat([got[: keys.start], value[keys], got[keys.stop:]])
        torch.testing.assert_close(got, value, atol=atol, rtol=rtol, msg=name)


def write_tar(path, samples) -> None:
    """A tar shard from [(key, {extension: bytes})], written member by member (for shards made bad on purpose)."""
    with tarfile.open(path, "w") as tar:
        for key, files in samples:
            for extension, data in files.items():
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
