"""scripts/slurm/pretrain.sbatch as far as a machine without SLURM can try it: run by bash with SLURM's variables
for 2 nodes x 8 GPUs, `srun` and `scontrol` replaced by stand-ins and the launcher by one that records its command
line and writes the summary a run would leave. The real two-machine launch (machine_rank 0 and 1 on localhost) is
in test_strategies."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"


def _stand_ins(tmp_path, exit_status):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: the command once per node, as SLURM runs one task per node with its own SLURM_NODEID
    (bin_dir / "srun").write_text('#!/bin/bash\nshift\nfor i in $(seq 0 $((SLURM_NNODES - 1))); do '
                                  'SLURM_NODEID=$i "$@"; done\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = show ]; then printf "gpu-a01\\ngpu-a02\\n"; '
                                      f'else echo "$@" >> {tmp_path}/scontrol.log; fi\n')
    # the launcher: records its arguments and leaves the summary of a run that stopped with `exit_status`
    (bin_dir / "python").write_text(
        f'#!/bin/bash\nif [ "$1" = -m ]; then printf "%s\\n" "$*" >> {tmp_path}/launches.log; '
        f'mkdir -p {tmp_path}/run; echo \'{{"exit_status": {json.dumps(exit_status)}}}\' > {tmp_path}/run/summary.json;'
        f' exit 1; fi\nexec {sys.executable} "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("exit_status, requeued", [(75, True), (None, False)])
def test_the_sbatch_template_launches_every_node_and_requeues_a_preempted_run(tmp_path, exit_status, requeued):
    bin_dir = _stand_ins(tmp_path, exit_status)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    proc = subprocess.run(["bash", str(SBATCH), str(tmp_path / "run"), "objective=dino", "model=vit_b16",
                           "data=wds", "data.urls='/data/shards/train-{000000..000999}.tar'"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    launches = (tmp_path / "launches.log").read_text().splitlines()
    assert len(launches) == 2
    for rank, line in enumerate(launches):
        assert line.startswith("-m accelerate.commands.launch --config_file configs/accelerate/ddp_gpu8.yaml "
                               f"--num_machines 2 --num_processes 16 --machine_rank {rank} "
                               "--main_process_ip gpu-a01 --main_process_port 29500 scripts/pretrain.py ")
        assert line.endswith(f"out={tmp_path / 'run'} trainer.resume=auto objective=dino model=vit_b16 data=wds "
                             "data.urls='/data/shards/train-{000000..000999}.tar'")  # the quotes reach Hydra
    scontrol = tmp_path / "scontrol.log"
    if requeued:
        assert proc.returncode == 75 and scontrol.read_text() == "requeue 4242\n", proc.stdout + proc.stderr
        assert "requeueing 4242" in proc.stdout
    else:
        assert proc.returncode == 0 and not scontrol.exists(), proc.stdout + proc.stderr
