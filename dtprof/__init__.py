"""dtprof: profiling and performance analysis for distributed PyTorch training.

The public Python API for training code. All of it is a no-op (cheap, never raising) when the rank is not being
profiled, so jobs can keep these calls in production:

    import dtprof
    dtprof.init()                      # only for jobs not started by `dtprof run` (srun, ...)
    for batch in loader:
        with dtprof.span("my_phase"):
            ...
        dtprof.annotate(tokens=batch.numel())
        dtprof.step()                  # only for loops without torch.optim optimizers

Analysis lives in `dtprof.rundir.run.open_run` (tables) and `dtprof.analyzers`.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "init", "step", "span", "annotate", "ray_train"]


def _runtime():
    from dtprof.collectors import runtime

    return runtime


def init(out: str | None = None, **options) -> bool:
    """Start profiling this rank without `dtprof run`. Returns True if profiling is active."""
    return _runtime().init(out=out, **options)


def step() -> None:
    """Mark the end of a training step (optimizer steps are detected on their own)."""
    _runtime().step()


def span(name: str):
    """Context manager recording a named user span on this rank."""
    return _runtime().span(name)


def annotate(**fields) -> None:
    """Attach facts to the current step: tokens=, samples=, stage=, microbatch=."""
    _runtime().annotate(**fields)


def ray_train(train_func, run_dir, **options):
    """``train_func`` for Ray Train's ``TorchTrainer`` with every worker recorded as a rank of the run at
    ``run_dir``, on a Ray cluster that dtprof did not start (collectors/raytrain.py). Options as ``init``'s."""
    from dtprof.collectors.raytrain import ray_train as wrap

    return wrap(train_func, run_dir, **options)
