"""One line of Dynamo's own counters for a job run with --compile: what torch.compile did in this process."""


def dynamo_line() -> str:
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    recompiles = sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else 0
    return (f"dynamo: graphs {counters['stats']['unique_graphs']} graph_breaks {breaks} "
            f"recompiles {recompiles}")
