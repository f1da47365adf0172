"""One line of Dynamo's own counters for a job run with --compile: what torch.compile did in this process."""


def dynamo_line() -> str:
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    recompiles = sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else 0
    return (f"dynamo: graphs {counters['stats']['unique_graphs']} graph_breaks {breaks} "
            f"recompiles {recompiles}")


def print_dynamo_line(rank: int) -> None:
    """Print ``rank <rank> dynamo: ...`` in one write: torchrun runs its workers unbuffered (``python -u``), where
    print() writes a line's text and its newline apart, so the lines of ranks ending together could interleave."""
    import sys

    sys.stdout.write(f"rank {rank} {dynamo_line()}\n")
    sys.stdout.flush()
