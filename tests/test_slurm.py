"""scripts/slurm/pretrain.sbatch as far as a machine without SLURM can try it: run by bash with SLURM's variables
for 2 nodes x 8 GPUs, `srun` and `scontrol` replaced by stand-ins and the launcher by one that records its
arguments and leaves the summary a run would. The real two-machine launch (machine_rank 0 and 1 on localhost) is
in test_strategies."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"
OVERRIDES = ["objective=dino", "model=vit_b16", "data=folder", "data.root=/data/my images",  # a space in a value
             "data.urls='/data/shards/train-{000000..000999}.tar'"]


def _stand_ins(tmp_path, run, exit_status):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: the command once per node, as SLURM runs one task per node with its own SLURM_NODEID
    (bin_dir / "srun").write_text('#!/bin/bash\nshift\nfor i in $(seq 0 $((SLURM_NNODES - 1))); do '
                                  'SLURM_NODEID=$i "$@"; done\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = show ]; then printf "gpu-a01\\ngpu-a02\\n"; '
                                      f'else echo "$@" >> {tmp_path}/scontrol.log; fi\n')
    # the launcher: records its arguments (JSON) and leaves the summary of a run that ended with `exit_status`
    summary = "" if exit_status is None else (f"import pathlib; pathlib.Path({str(run)!r}).mkdir(exist_ok=True); "
                                              f"pathlib.Path({str(run / 'summary.json')!r}).write_text("
                                              f"json.dumps({{'exit_status': {exit_status}}})); ")
    record = (f"import json, sys; open({str(tmp_path / 'launches.log')!r}, 'a').write(json.dumps(sys.argv[1:]) + "
              f"'\\n'); {summary}sys.exit(1)")
    (bin_dir / "python").write_text(f'#!/bin/bash\nif [ "$1" = -m ]; then exec {sys.executable} -c "{record}" "$@"; '
                                    f'fi\nexec {sys.executable} "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("exit_status, overrides, status", [
    (75, OVERRIDES, 75),  # stopped with a checkpoint: requeued
    (0, [], 0),  # finished (no overrides at all)
    (1, OVERRIDES, 1),  # failed
    (None, OVERRIDES, 1),  # failed before writing a summary: an earlier job's 75 must not requeue it
])
@pytest.mark.slow
def test_the_sbatch_template_launches_every_node_and_requeues_only_a_run_stopped_with_a_checkpoint(
        tmp_path, exit_status, overrides, status):
    run = tmp_path / "shared runs" / "vit b"  # spaces in the path
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"exit_status": 75}))  # the previous job's
    bin_dir = _stand_ins(tmp_path, run, exit_status)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    proc = subprocess.run(["bash", str(SBATCH), str(run), *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    launches = [json.loads(line) for line in (tmp_path / "launches.log").read_text().splitlines()]
    assert launches == [["-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/ddp_gpu8.yaml",
                         "--num_machines", "2", "--num_processes", "16", "--machine_rank", str(rank),
                         "--main_process_ip", "gpu-a01", "--main_process_port", "29500", "scripts/pretrain.py",
                         f"out={run}", "trainer.resume=auto", *overrides] for rank in (0, 1)]
    assert proc.returncode == status, proc.stdout + proc.stderr
    scontrol = tmp_path / "scontrol.log"
    assert (scontrol.read_text() if scontrol.exists() else "") == ("requeue 4242\n" if status == 75 else "")
    assert json.loads((run / "summary.previous.json").read_text()) == {"exit_status": 75}
