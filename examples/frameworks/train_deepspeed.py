"""A DeepSpeed job on CPU (gloo): ZeRO stages 0-3 or the PipelineEngine, with its own clock of communication.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/frameworks/train_deepspeed.py --zero 2
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/frameworks/train_deepspeed.py --pipeline
    dtprof run -- deepspeed --num_gpus 2 examples/frameworks/train_deepspeed.py --zero 3     # profiled, unchanged

The model is blocks of Linear(dim, 4·dim) → ReLU → Linear(4·dim, dim). ``--pipeline`` runs DeepSpeed's
PipelineEngine (``deepspeed.pipe.PipelineModule``, 2 stages, ``train_batch`` with ``--accum`` micro-batches): twelve
layers, six blocks, four parameterless ReLUs, two blocks, so the default ``uniform`` partition (layer counts) puts
six blocks on stage 0 and two on stage 1, while ``--partition parameters`` balances them four and four.
``--partition uniform,parameters`` builds one engine per method (the same initial weights) and alternates them step
by step (step k on the k mod 2-th): the unbalanced and the balanced pipeline in one job, so that a busy machine's
load hits both alike. ZeRO's ``--bucket B0,B1`` does the same for two bucket sizes (docs/what-if.md). ``--device-ms
T`` gives each block a stand-in for device time: a wait of T ms in its forward and 2T in its backward that holds no
CPU (as the host thread waits for a GPU kernel), so that stages that compute at once do not also compete for the
host's cores. ZeRO jobs step the optimizer every ``--accum`` micro-batches (``engine.step()`` at the boundary).

The job measures its own truth, independent of any profiler: the time its training thread spends inside
``torch.distributed`` calls and ``Work.wait`` (comm_clock.py, installed before DeepSpeed looks any of them up),
per step. Each
rank prints one line ``clock <rank> {"steps": [[duration, communication], ...]}`` (s, one pair per optimizer
step). Every rank prints
``parameters <rank> <count>`` (its model's, before DeepSpeed partitions it: its stage's under the pipeline) and
``weights <rank> <sha256>`` of its final parameters (its own partition under ZeRO-3, its stage's under the
pipeline), to compare a bare run with a profiled one. At its exit each rank prints ``engine methods <rank> training
<own> exit <own>``: whether DeepSpeed's engine methods that a profiler may wrap (``DeepSpeedEngine.step``,
``PipelineEngine.train_batch``) were DeepSpeed's own code after training and at the very end of the process (its
exit hook is registered before torch is imported, so it runs after any exit hook a profiler registers then).
``--time-flushes`` (ZeRO-1/2) also times DeepSpeed's bucket flushes (``reduce_ipg_grads``, each bucket's reduction
and the engine's own work around it) and prints ``flush <rank> {"steps": [[flushes, flush_s, comm_s], ...]}`` per
optimizer step: the engine's own work per bucket is flush_s - comm_s (benchmarks/zero_bucket_whatif.py).
``--compile BACKEND`` compiles each engine's model as DeepSpeed users do, ``engine.compile(backend=BACKEND,
compile_kwargs=--compile-kwargs)`` (its model's ``Module.compile()``), ``--compiled-autograd`` also compiles the
backward (``compiled_autograd_enabled``: DeepSpeed's ``engine.backward()`` runs under compiled autograd, with the
accelerator's backend, inductor, and the same compile_kwargs; Dynamo traces ZeRO-2's gradient hooks, bucket flushes
included, with graph breaks at the collectives). ZeRO-2 (or ZeRO-1 with ``--overlap-comm``: flushes in the hooks)
under compiled autograd fails without any profiler on torch 2.13 / DeepSpeed 0.19.8 (Dynamo's "sources must not be
empty for symbol" at a guard of the hooks' graph) unless ``--compile-kwargs '{"dynamic": false}'``. Each rank then
prints Dynamo's own counters at the end, ``dynamo <rank> {"graphs": ..., "graph_breaks": ..., "recompiles": ...,
"frames": ...}`` (``dynamo_counters``), to compare a bare run with a profiled one.
"""
import argparse
import atexit
import hashlib
import json
import math
import os
import sys
import time

_own_after_training: list[bool] = []


def engine_methods_own() -> bool:
    """DeepSpeed's engine methods are the code of DeepSpeed's own files (not a wrapper's)."""
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    root = os.path.dirname(deepspeed.__file__) + os.sep
    return all(f.__code__.co_filename.startswith(root) for f in (DeepSpeedEngine.step, PipelineEngine.train_batch,
                                                                 DeepSpeedZeroOptimizer.reduce_ipg_grads))


def print_engine_methods() -> None:
    if "deepspeed" in sys.modules and _own_after_training:
        print(f"engine methods {os.environ.get('RANK')} training {_own_after_training[0]} exit "
              f"{engine_methods_own()}", flush=True)


atexit.register(print_engine_methods)   # before torch is imported: the last exit hook to run (module docstring)
os.environ.setdefault("DS_ACCELERATOR", "cpu")   # before DeepSpeed picks its accelerator
import comm_clock  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

comm_clock.install()   # the job's own clock of communication, before DeepSpeed looks up torch.distributed's functions
import deepspeed  # noqa: E402  (after the clock: deepspeed.comm looks some functions up once)


class _DeviceTime(torch.autograd.Function):
    """Waits ``seconds`` in forward and twice that in backward without holding a CPU, as the host thread waits for
    a GPU kernel's time: the block's compute on a device of its own, whatever the host's load."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class DeviceTime(torch.nn.Module):
    def __init__(self, ms: float):
        super().__init__()
        self.seconds = ms / 1000

    def forward(self, x):
        return _DeviceTime.apply(x, self.seconds)


def block(dim, device_ms=0.0):
    layers = [torch.nn.Linear(dim, 4 * dim), torch.nn.ReLU(), torch.nn.Linear(4 * dim, dim)]
    return torch.nn.Sequential(*layers, *([DeviceTime(device_ms)] if device_ms else []))


class Net(torch.nn.Module):
    def __init__(self, dim, blocks, device_ms=0.0):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[block(dim, device_ms) for _ in range(blocks)])

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.blocks(x), y)


def weights_hash(params) -> str:
    h = hashlib.sha256()
    for p in params:
        t = getattr(p, "ds_tensor", None)
        h.update((t if t is not None else p).detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def time_flushes() -> list:
    """Times DeepSpeed ZeRO-1/2's bucket flushes: returns the running [count, seconds, communication seconds] of
    the step in progress (the training loop takes and resets it at each step's end)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    out: list = [0, 0.0, 0.0]
    orig = DeepSpeedZeroOptimizer.reduce_ipg_grads

    def reduce_ipg_grads(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), comm_clock.comm_s()
        try:
            return orig(self, *args, **kwargs)
        finally:
            out[0] += 1
            out[1] += time.perf_counter() - t0
            out[2] += comm_clock.comm_s() - c0

    DeepSpeedZeroOptimizer.reduce_ipg_grads = reduce_ipg_grads
    return out


def dynamo_counters() -> dict:
    """Dynamo's own counters of this process: tests/compile_jobs/forms.py's (graphs compiled, graph breaks,
    recompiles) and the frames Dynamo's frame callback was handed (``frames``: compiled or skipped)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
            "frames": counters["frames"]["total"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, default=2, help="ZeRO stage 0-3 (not with --pipeline)")
    p.add_argument("--overlap-comm", action="store_true")
    p.add_argument("--decay-groups", action="store_true",
                   help="two parameter groups (weight decay on matrices only), as the HF Trainer makes")
    p.add_argument("--sub-group-size", type=int, default=None,
                   help="ZeRO-3 steps the optimizer once per sub-group of this many elements (DeepSpeed's 1e9)")
    p.add_argument("--bucket", default="5e8",
                   help="ZeRO's reduce and all-gather bucket sizes (elements); several, comma-separated: one engine "
                        "each, alternating step by step")
    p.add_argument("--pipeline", action="store_true", help="DeepSpeed's PipelineEngine, 2 stages")
    p.add_argument("--partition", default="uniform",
                   help="PipelineModule partition_method; several, comma-separated: one engine each, alternating")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="micro-batch per rank")
    p.add_argument("--print-health", action="store_true",
                   help="each rank prints HEALTH <rank> <step> <loss> <grad norm> <lr> per step: its micro-batches' "
                        "mean loss and the engine's get_global_grad_norm() (ZeRO jobs; None at stage 0 in fp32: "
                        "there the job's own float64 norm of its all-reduced gradients, before any clip)")
    p.add_argument("--clip", type=float, default=0.0, help="DeepSpeed's gradient_clipping (0: none)")
    p.add_argument("--device-ms", type=float, default=0.0,
                   help="each block also waits this long in forward (twice in backward) holding no CPU: a stand-in "
                        "for a device's compute time that a busy host does not stretch")
    p.add_argument("--time-flushes", action="store_true",
                   help="time ZeRO-1/2's bucket flushes (module docstring)")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="engine.compile(backend=BACKEND): inductor, aot_eager, ... (module docstring)")
    p.add_argument("--compile-kwargs", type=json.loads, default={},
                   help="with --compile: engine.compile(compile_kwargs=...), JSON (e.g. '{\"dynamic\": false}')")
    p.add_argument("--compiled-autograd", action="store_true",
                   help="with --compile: engine.compile(compiled_autograd_enabled=True), the backward compiled too")
    p.add_argument("--local_rank", type=int, default=-1)   # passed by DeepSpeed's launcher
    args = p.parse_args()

    flushes = time_flushes() if args.time_flushes else None
    flush_steps: list = []
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
           "gradient_clipping": args.clip}
    engines = []
    for method in args.partition.split(",") if args.pipeline else [float(b) for b in args.bucket.split(",")]:
        torch.manual_seed(0)
        if args.pipeline:
            from deepspeed.pipe import PipelineModule
            layers = [block(args.dim, args.device_ms) for _ in range(6)] + [torch.nn.ReLU() for _ in range(4)] + \
                     [block(args.dim, args.device_ms) for _ in range(2)]
            model = PipelineModule(layers=layers, num_stages=2, partition_method=method,
                                   loss_fn=torch.nn.functional.mse_loss)
        else:
            cfg["zero_optimization"] = {"stage": args.zero, "overlap_comm": args.overlap_comm,
                                        "reduce_bucket_size": method, "allgather_bucket_size": method}
            if args.sub_group_size:
                cfg["zero_optimization"]["sub_group_size"] = args.sub_group_size
            model = Net(args.dim, args.blocks, args.device_ms)
        params = [q for q in model.parameters() if q.requires_grad]
        if args.decay_groups:   # the HF Trainer's two groups: ZeRO steps the torch optimizer once per group
            opt = torch.optim.AdamW([{"params": [q for q in params if q.dim() > 1], "weight_decay": 0.01},
                                     {"params": [q for q in params if q.dim() <= 1], "weight_decay": 0.0}], lr=1e-3)
        else:
            opt = torch.optim.AdamW(params, lr=1e-3)
        if not engines:   # this rank's model (its stage's under the pipeline), before ZeRO-3 partitions it
            n_params = sum(q.numel() for q in model.parameters())
        engines.append(deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0])
        if args.compile:
            engines[-1].compile(backend=args.compile, compile_kwargs=args.compile_kwargs,
                                compiled_autograd_enabled=args.compiled_autograd)

    g = torch.Generator().manual_seed(1 + (0 if args.pipeline else rank))
    n_micro = args.steps * args.accum
    data = [(torch.randn(args.batch, args.dim, generator=g), torch.randn(args.batch, args.dim, generator=g))
            for _ in range(n_micro)]
    per_step = []
    it = iter(data)
    for step in range(args.steps):
        engine = engines[step % len(engines)]
        t0, c0 = time.perf_counter(), comm_clock.comm_s()
        if args.pipeline:
            loss = engine.train_batch(it)
        else:
            losses, own_norm = [], None
            for i in range(args.accum):
                x, y = next(it)
                loss = engine(x, y)
                engine.backward(loss)
                if args.print_health and args.zero == 0 and i == args.accum - 1:
                    # stage 0: the boundary's backward all-reduced the whole gradients; norm them before the step
                    own_norm = math.sqrt(sum(float(q.grad.double().pow(2).sum())
                                             for q in engine.module.parameters() if q.grad is not None))
                engine.step()
                losses.append(float(loss) if args.print_health else 0.0)
        per_step.append([time.perf_counter() - t0, comm_clock.comm_s() - c0])
        if flushes is not None:
            flush_steps.append(list(flushes))
            flushes[:] = [0, 0.0, 0.0]
        if args.print_health and not args.pipeline:
            norm = engine.get_global_grad_norm()
            norm = own_norm if norm is None else float(norm)
            print(f"HEALTH {rank} {step} {sum(losses) / len(losses)!r} {norm!r} {engine.get_lr()[0]!r}", flush=True)
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f}", flush=True)
    print(f"clock {rank} " + json.dumps({"steps": per_step}), flush=True)
    if flushes is not None:
        print(f"flush {rank} " + json.dumps({"steps": flush_steps}), flush=True)
    print(f"weights {rank} {weights_hash(q for e in engines for q in e.module.parameters())}", flush=True)
    print(f"parameters {rank} {n_params}", flush=True)
    if args.compile:
        print(f"dynamo {rank} " + json.dumps(dynamo_counters()), flush=True)
    _own_after_training.append(engine_methods_own())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
