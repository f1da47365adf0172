"""dtprof's injected sitecustomize: profiles a training rank without touching train.py.

`dtprof run` puts this file's directory first on PYTHONPATH, so Python runs it at start-up in the torchrun
launcher, in every worker it spawns, and in a plain `python train.py`. It must cost next to nothing and never
break the program:

- It does nothing unless ``DTPROF_NODE_DIR`` is set.
- It never imports torch itself (~2 s). It puts a plain finder object on ``sys.meta_path`` (importing
  ``importlib.abc`` would double the interpreter's start-up cost) that waits for ``import torch``,
  lets torch load, then calls ``dtprof.collectors.runtime.install_from_env()``.
- Which processes are ranks is decided when torch has been imported, in ``runtime.install_from_env``: a process
  with ``RANK``/``LOCAL_RANK`` is a torchrun worker; one without them is the torchrun launcher if its main module is
  ``torch.distributed.run``/``launch`` or its argv[0] is ``torchrun`` (then nothing is recorded), and otherwise a
  plain single-process job, recorded as rank 0 of world 1.
- It hides any other ``sitecustomize`` further down the path (Debian ships one), so it loads that one afterwards.
- Any fault is swallowed: the job runs unprofiled and the fault is recorded in the run's events (the rank's, or
  this process's own ``unidentified-<pid>.jsonl.gz``), never printed into the job's output; the launcher names it in
  one line at the end. An error in the sitecustomize ours hides is printed as Python itself prints it.
"""
import os
import sys


class _TorchImportWatcher:
    """A meta-path finder that finds nothing itself; it wraps torch's loader so our hook runs after torch loads."""

    def __init__(self):
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self.done:
            return None
        self.done = True
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)          # torch itself: its errors are the user's and propagate unchanged
            _after_torch_import()

        try:
            spec.loader.exec_module = exec_module   # instance attribute; the loader is per-spec
        except Exception:
            pass
        return spec


def _record_fault(e):
    """dtprof failed in this process: an events row in the run (never a line in the job's output)."""
    try:
        import socket

        from dtprof.rundir.writer import FAULT_EVENT, process_event

        process_event(os.environ["DTPROF_NODE_DIR"], socket.gethostname(), "error",
                      f"{FAULT_EVENT} in pid {os.getpid()} at start-up: {type(e).__name__}: {e}")
    except BaseException:
        pass


def _after_torch_import():
    try:
        from dtprof.collectors import runtime

        runtime.install_from_env()
    except BaseException as e:  # never break the user's import of torch
        _record_fault(e)


def _chain_original_sitecustomize():
    """Import the sitecustomize that ours shadows (the next one on sys.path), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        del sys.modules["sitecustomize"]
        try:
            import sitecustomize  # noqa: F401  (the original, if any)
        except ImportError as exc:
            if exc.name != "sitecustomize":   # a missing original is fine; its own failing import is not
                raise
    except Exception as e:   # the job's own sitecustomize: reported as Python's site.py reports it
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}\n")
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _install():
    if not os.environ.get("DTPROF_NODE_DIR"):
        return
    if "torch" in sys.modules:        # unusual, but then there is nothing to wait for
        _after_torch_import()
    else:
        sys.meta_path.insert(0, _TorchImportWatcher())


try:
    _chain_original_sitecustomize()
    _install()
except Exception as _e:  # pragma: no cover - last resort
    if os.environ.get("DTPROF_NODE_DIR"):
        _record_fault(_e)
