"""Outputs that cannot be written: a full disk, a read-only file system, a file-size limit. The run stops with one
line naming the directory and the cause, removes the unfinished checkpoint and keeps every complete one."""

import json
import resource
import shutil
import subprocess
import uuid

import pytest
from conftest import TINY, check_ok, pretrain_in_process
from helpers.ranks import pretrain_ranks

from ssl_vit.train.outputs import drop_metrics_after, json_safe


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs root and mount rights, as on the development and CI machines)."""
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ssl-vit: error:")]
    assert lines, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_full_disk_stops_with_the_cause_keeps_complete_checkpoints_and_read_only_is_one_line(small_disk):
    run = small_disk / "run"
    args = [*TINY, "trainer.trackers=[]", "trainer.resume=auto", f"hydra.run.dir={run}"]
    check_ok(pretrain_in_process(*args, "trainer.max_steps=10"))
    free = shutil.disk_usage(small_disk).free
    (small_disk / "filler").write_bytes(b"\0" * (free - 64 * 1024))  # leave 64 KiB: less than one checkpoint
    proc = pretrain_in_process(*args, "trainer.max_steps=20")
    assert proc.returncode != 0
    line = _error_line(proc)
    assert f"cannot write checkpoint step_00000020 in {run / 'checkpoints'}: no space left on the device" in line
    assert "complete checkpoints kept: ['step_00000010']" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000010"]  # temp dir removed
    assert "Traceback" not in proc.stderr.split("ssl-vit: error:")[0]

    (small_disk / "filler").unlink()
    check_ok(pretrain_in_process(*args, "trainer.max_steps=20"))  # the kept checkpoint resumes once there is room
    assert json.loads((run / "summary.json").read_text())["step"] == 20

    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    proc = pretrain_in_process(*args, "trainer.max_steps=30")
    assert proc.returncode != 0
    assert _error_line(proc) == (f"ssl-vit: error: cannot write to the output directory {run}: the file system is "
                                 "read-only (hydra.run.dir)")


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))  # Python ignores SIGXFSZ: writes get EFBIG


@pytest.mark.slow
def test_a_file_size_limit_is_reported_with_its_cause(tmp_path):
    """In a process of its own (forked: helpers.ranks), whose file-size limit it lowers first."""
    proc = pretrain_ranks(*TINY, "trainer.max_steps=10", "trainer.trackers=[]", f"hydra.run.dir={tmp_path / 'run'}",
                          log_dir=tmp_path / "logs", setup=_limit_file_size)
    assert proc.returncode != 0
    assert "cannot write checkpoint step_00000010" in _error_line(proc)
    assert "the file size limit is exceeded (ulimit -f): 150000 bytes" in _error_line(proc)
    assert not list((tmp_path / "run" / "checkpoints").iterdir())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 10 and "file size limit" in summary["error"]


def test_metrics_rows_past_the_resumed_step_are_dropped_and_nan_is_null(tmp_path):
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(json_safe(r)) + "\n" for r in rows) + '{"step": 4, "lo')
    assert drop_metrics_after(tmp_path, 2) == 2  # step 3, and a line cut by a kill
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None}]
