"""Cores under pytest-xdist (`make test`: 2 workers on this 2-core machine).

Each worker keeps to its share of the cores, and what it runs in-process or in one process sizes its threads by that
share (torch and the trainer read the affinity; the BLAS and OpenMP pools of numpy, scipy and scikit-learn are
limited to it): two workers that each ran 2 threads on 2 cores spun against each
other (measured: the same tests took 1.8x the CPU time). A run of several processes gets the session's cores back
(`widen`), so its ranks (one thread each) use the whole machine once the other worker is idle instead of sharing one
core: the worker that runs the session's pool runs little else."""

from __future__ import annotations

import os

import torch
from threadpoolctl import threadpool_limits

SESSION_CORES = "SSL_VIT_TESTS_SESSION_CORES"  # the cores the pytest session started with, for `widen`


def own_share() -> None:
    """In an xdist worker: keep to cores[worker index::workers] and size torch's threads to them."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or count < 2 or len(cores) < count:
        return
    os.environ[SESSION_CORES] = ",".join(map(str, cores))
    mine = cores[int(worker.removeprefix("gw")) % count::count]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    # numpy's / scipy's OpenBLAS and scikit-learn's OpenMP sized their pools to every core at import: on one core
    # their threads spin against each other (measured on a 2-core AMD EPYC: scikit-learn's LogisticRegression in
    # test_native took over 15 min in a worker instead of 67 s)
    threadpool_limits(len(mine))


def widen() -> None:
    """This process (and what it starts) on the session's cores again; nothing outside an xdist worker."""
    if cores := os.environ.get(SESSION_CORES):
        os.sched_setaffinity(0, [int(core) for core in cores.split(",")])
