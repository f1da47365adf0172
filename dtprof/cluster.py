"""The global analysis from node summaries with its per-instance reductions on a Dask cluster (docs/scale.md).

The node summaries are the map (``summarize.make_summaries`` runs them on the cluster). Of the global analysis,
the reductions per collective instance (the arrivals the stragglers are named from, the collective table's
instances) read a row per instance and node, the tables that grow with instances × nodes: here they are split
into ``partitions`` by the instance's hash (``Rows.partition``), each partition reduced by the same SQL on a
worker (its DuckDB reads every node's file and keeps its instances' rows), and the partitions joined on the client
(``stragglers.merge_arrivals``, ``collectives.merge_instances``): an instance is whole in one partition, so the
result is the one-machine path's to the last bit. The per rank-step work (steps, breakdown, what-if replay) stays
in the client process. The workers must see the run directory and have dtprof installed, as for
``dtprof summarize --address``.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from dtprof.analyzers import collectives as coll_mod
from dtprof.analyzers import stragglers as strag_mod


class DaskReduce:
    """``analyze(..., reduce=DaskReduce(client))``: the per-instance reductions on the Dask ``client``'s cluster,
    in ``partitions`` parts each (default: one per worker)."""

    def __init__(self, client, partitions: int | None = None):
        self.client = client
        self.partitions = partitions or max(1, len(client.scheduler_info()["workers"]))

    def __call__(self, model, ns) -> tuple[Future, Future]:
        measured = sorted(model.measured_steps)   # read here once, not by two threads
        pool = ThreadPoolExecutor(2, thread_name_prefix="dtprof-dask")
        # the arrivals' thread fits the clocks first (the model's, on the first use), as the local thread does
        arrivals = pool.submit(self._arrivals, model, ns, measured)
        instances = pool.submit(self._instances, ns, measured)
        pool.shutdown(wait=False)
        return arrivals, instances

    def _map(self, fn, rows, key: str, *args) -> list:
        n = self.partitions
        return self.client.gather([self.client.submit(fn, rows.partition(key, i, n), *args, pure=False)
                                   for i in range(n)])

    def _arrivals(self, model, ns, measured):
        counts = self.client.submit(strag_mod.measured_rows_per_rank, ns.arrival_counts, measured, pure=False)
        no_steps, rows_per_rank = counts.result()
        parts = self._map(strag_mod.instance_arrivals, ns.arrival_parts, strag_mod.ARRIVALS_KEY, model.clock,
                          measured, no_steps)
        return strag_mod.merge_arrivals(parts), rows_per_rank

    def _instances(self, ns, measured):
        parts = self._map(coll_mod.instances_of, ns.instance_rows, coll_mod.INSTANCE_KEY, measured, True)
        return coll_mod.merge_instances(parts)


def analyze_on_cluster(run, client, options=None, partitions: int | None = None, **kw):
    """``analyze(run, options, **kw)`` with the node summaries that are missing made on the Dask ``client``'s
    cluster and the per-instance reductions run there (``DaskReduce``): the one-machine path's Analysis."""
    from dtprof.analyzers.summary import analyze
    from dtprof.rundir.run import Run, open_run
    from dtprof.summarize import make_summaries

    run = run if isinstance(run, Run) else open_run(run)
    make_summaries(run, client=client)
    return analyze(run, options, reduce=DaskReduce(client, partitions), **kw)
