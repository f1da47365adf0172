"""torch's own abort at a rank's exit, after training: "terminate called without an active exception" (gloo's
threads still alive at process exit, pytorch issue #190489). It hits jobs with and without dtprof alike: the same
3-rank DDP job aborted so in 3 of 32 runs without dtprof and 4 of 32 under it (2026-11-24), even after a barrier and
destroy_process_group. The tests that run real torchrun jobs run such a job once more; anything else fails them."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

GLOO_EXIT_ABORT = "terminate called without an active exception"


def aborted_at_exit(p: subprocess.CompletedProcess) -> bool:
    return p.returncode != 0 and GLOO_EXIT_ABORT in (p.stderr or "")


def once_more_on_exit_abort(launch: Callable[[int], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """``launch(attempt)`` runs the job (attempt 0, then 1: a fresh run directory and port are the caller's); the
    second run only after torch's exit abort."""
    p = launch(0)
    return launch(1) if aborted_at_exit(p) else p



def run_dir_once_more_on_exit_abort(out: Path, launch: Callable[[Path], subprocess.CompletedProcess]
                                    ) -> tuple[subprocess.CompletedProcess, Path]:
    """``launch(out)`` records a run into ``out``; after torch's exit abort, once more into a fresh ``<out>-again``
    (a run directory is never reused). (the process, the directory holding the run)."""
    p = launch(out)
    if aborted_at_exit(p):
        out = out.with_name(out.name + "-again")
        p = launch(out)
    return p, out
