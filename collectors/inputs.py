"""Samples and tokens per step, inferred from what the root module is called with (issue 14: throughput with no
code change). Stdlib and torch only; called once per top-level forward.

- samples: the batch dimension (dim 0) of the first tensor in the call's arguments (depth-first through lists,
  tuples and dicts; a keyword ``input_ids`` first, as Hugging Face models are called with keywords);
- tokens: batch × sequence when that tensor is an integer (batch, sequence) tensor (token ids), else unknown.
A step's figures are the sums over its top-level forwards with gradients enabled (gradient accumulation: every
micro-batch; not a frozen teacher's or encoder's forward under ``torch.no_grad``, nor evaluation between steps:
collectors/runtime.py, "Evaluation"). Under a pipeline schedule, the batch its ``step(*args)`` is given, once per
step (the first stage's; a later stage's module is called with what the stage before it sent: the same samples).
``dtprof.annotate(samples=..., tokens=...)`` overrides them for the step.
"""
from __future__ import annotations

SOURCE = {"samples": "inferred: batch dimension of the root module's input",
          "tokens": "inferred: batch × sequence of the root module's integer (batch, sequence) input"}


def batch_counts(args, kwargs) -> tuple[int, int | None] | None:
    """(samples, tokens or None) of one root-module call, or None when no tensor is found."""
    import torch

    kwargs = kwargs or {}
    # the first tensor of at least one dimension, depth-first through up to four levels of lists, tuples and dicts,
    # a keyword ``input_ids`` first: in one frame, without recursion (a framework's batch, walked every step)
    todo = [((kwargs.get("input_ids"), args, kwargs), 0)]
    t = None
    while todo:
        x, depth = todo.pop()
        if isinstance(x, torch.Tensor):
            if x.dim() >= 1:
                t = x
                break
        elif depth <= 3:
            if isinstance(x, dict):
                x = list(x.values())
            if isinstance(x, (list, tuple)):
                for v in reversed(x):
                    todo.append((v, depth + 1))
    if t is None:
        return None
    samples = int(t.shape[0])
    integer = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    return samples, (samples * int(t.shape[1]) if integer and t.dim() == 2 else None)
