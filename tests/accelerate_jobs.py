"""Run several scripts, one after another, inside the same ``accelerate launch`` processes.

    accelerate launch --multi_gpu --num_processes 2 tests/accelerate_jobs.py JOBS.json

JOBS.json is a list of ``{"name", "script", "argv", "log_dir", "timeout"}``. Every rank runs every job as
``python SCRIPT ARGV...`` would (``runpy``, ``__name__ == "__main__"``, ``sys.argv`` set), with fd 1 and fd 2
sent to ``log_dir/rank<R>.out|.err``, and writes ``log_dir/rank<R>.json`` (exit status, traceback). The
fixture ``accelerate_batch`` in tests/conftest.py builds the list and reads the results; this file is not
a test module.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import runpy
import sys
import time
import traceback
import warnings
from pathlib import Path

# a rank whose job failed waits this long for the other ranks to finish the job; past it they are taken to be
# waiting in a collective for it, and the batch stops (as one crashed process stops a plain launch)
PEER_GRACE_S = 60.0


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return 1


class _Baseline:
    """What a fresh process starts each job with; the jobs may change any of it."""

    def __init__(self):
        import torch
        from transformers.utils import logging as hf_logging

        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.sys_path = list(sys.path)
        self.streams = (sys.stdout, sys.stderr)
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.torch_seed = torch.initial_seed()
        self.hf_verbosity = hf_logging.get_verbosity()

    def restore(self):
        import numpy as np
        import torch
        from accelerate.state import AcceleratorState, GradientState
        from transformers.utils import logging as hf_logging

        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        sys.stdout, sys.stderr = self.streams
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.manual_seed(self.torch_seed)
        random.seed()
        np.random.seed()
        hf_logging.set_verbosity(self.hf_verbosity)
        # accelerate's singletons hold the last job's Accelerator settings (mixed precision, gradient
        # accumulation, the DDP plugin); a new job builds them again from its own arguments. The process group
        # itself stays: PartialState reuses an initialized one, as a fresh process would create the same.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _wait_for_peers(log_dir: Path, world: int, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    while not all((log_dir / f"rank{r}.json").is_file() for r in range(world)):
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def run_job(job: dict, rank: int, world: int, baseline: _Baseline) -> int:
    log_dir = Path(job["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    baseline.restore()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_dir / f"rank{rank}.out", "w") as out, open(log_dir / f"rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        # a rank stuck in a collective cannot be interrupted from Python: dump every thread's stack into the
        # job's stderr and end the process, so torchrun stops the batch and the fixture names this job
        faulthandler.dump_traceback_later(job["timeout"], exit=True, file=err)
        status, tb = 1, None
        start = time.monotonic()
        try:
            sys.argv = [job["script"], *job["argv"]]
            sys.path[0] = str(Path(job["script"]).resolve().parent)  # as `python SCRIPT` sets it
            with warnings.catch_warnings():  # restores the filters and shows once-per-process warnings again
                runpy.run_path(job["script"], run_name="__main__")
            status = 0
        except SystemExit as e:
            status = _exit_status(e)
        except BaseException:  # noqa: BLE001 - recorded for the test that owns the job, like a crashed process
            tb = traceback.format_exc()
            print(tb, file=sys.stderr)
        finally:
            for stream in (sys.stdout, sys.stderr, *baseline.streams):
                stream.flush()
            (log_dir / f"rank{rank}.json").write_text(json.dumps(
                {"status": status, "traceback": tb, "seconds": round(time.monotonic() - start, 1)}))
            peers_done = _wait_for_peers(log_dir, world, None if status == 0 else PEER_GRACE_S)
            faulthandler.cancel_dump_traceback_later()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    print(f"[accelerate_jobs] rank {rank}: {job['name']} status {status} in {time.monotonic() - start:.1f} s",
          flush=True)
    if not peers_done:
        print(f"[accelerate_jobs] rank {rank}: {job['name']} failed here and the other ranks did not finish it "
              f"in {PEER_GRACE_S:.0f} s: stopping the batch", file=sys.stderr, flush=True)
        os._exit(1)
    return status


def main(jobs_file: str) -> int:
    import torch.distributed as dist

    jobs = json.loads(Path(jobs_file).read_text())
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    baseline = _Baseline()
    for job in jobs:
        run_job(job, rank, world, baseline)
        if dist.is_initialized():
            dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
