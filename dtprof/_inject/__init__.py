"""The sitecustomize injected into every rank by `dtprof run` (this directory goes first on PYTHONPATH)."""
