"""The process pool that trains a toy run's arms in parallel.

Arms are independent (each seeds itself and copies what it trains), so they run in spawned
worker processes, one CPU thread each (`worker_init`). Ctrl-C or a failed
arm stops every worker at once; each arm saved its state after its last finished step.
"""

from __future__ import annotations

import os


def cores_available() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or taskset's
    limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # not Linux
        return os.cpu_count() or 1


def default_workers(n_jobs: int) -> int:
    """One worker per available core, no more workers than jobs."""
    return max(1, min(cores_available(), n_jobs))


def worker_init():
    """Set up a worker process: one CPU thread, quiet libraries, and exit when the parent dies.

    One thread is also what makes a toy arm's numbers the same on every machine: a matrix
    product summed by two threads differs in the last bits from one summed by one, and over
    50 steps that changes the result (seed 0's RL (Single) arm: 0.241 on one thread, 0.246
    on two). The 64-wide models gain little from a second thread anyway."""
    import torch

    from .models import quiet

    quiet()
    torch.set_num_threads(1)   # several small processes beat one process fighting for cores
    try:                       # Linux: a killed parent must not leave workers running
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_init():
    """A worker of the arms' pool: one CPU thread, quiet libraries, exit when the parent dies,
    and deaf to Ctrl-C. The terminal sends SIGINT to every process of the
    group; the parent alone decides, and stops the workers (each arm's state is saved after
    every step, atomically, so a killed worker loses at most the step in progress)."""
    import signal

    worker_init()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_pool(fn, jobs: list, workers: int, on_result, initializer=_worker_init, initargs=()) -> None:
    """fn(job) for every job in `workers` spawned processes; on_result(result) as each
    finishes. Ctrl-C (or a failed job) stops every worker at once, queued jobs included,
    and is raised here; the workers themselves ignore Ctrl-C (see `_worker_init`)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=initializer,
                             initargs=initargs) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
        try:
            for fut in as_completed(futures):
                on_result(fut.result())
        except BaseException:
            _stop_workers(pool)
            raise


def _stop_workers(pool) -> None:
    """Cancel the queued arms and end the running ones now (after Ctrl-C or a failed arm).
    Each arm saved its state after its last finished step, atomically: ending a worker
    mid-step loses that step only. (Python 3.14 has pool.terminate_workers(); before it,
    the pool's processes are reached directly.)"""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    running = list((getattr(pool, "_processes", None) or {}).values())   # shutdown forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in running:
        proc.terminate()
