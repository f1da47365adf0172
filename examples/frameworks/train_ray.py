"""A Ray Train job on CPU: ``TorchTrainer`` with 2 workers, a tiny MLP through ``prepare_model`` (DDP over gloo)
and ``prepare_data_loader``.

    python examples/frameworks/train_ray.py                          # starts a local Ray cluster of its own
    dtprof run -- python examples/frameworks/train_ray.py            # the same, profiled (the cluster inherits it)

On a Ray cluster started apart from the job (``ray start --head``), the workers are profiled by the one line that
wraps the training function, ``dtprof.ray_train(train_func, run_dir=...)`` (here behind ``--run-dir``):

    python examples/frameworks/train_ray.py --address auto --run-dir /shared/runs/exp1
    ray job submit -- python examples/frameworks/train_ray.py --address auto --run-dir /shared/runs/exp1
    dtprof summary /shared/runs/exp1 && dtprof report /shared/runs/exp1      # then: summary.json, report.html

``--fail-once FILE``: rank 1 raises at step ``--fail-step`` unless FILE exists (it creates it first), so Ray
restarts the workers once (``FailureConfig(max_failures=1)``) and the second attempt trains from the start.
Rank 0 saves the final weights to ``--weights`` and prints ``final loss <value>``.
"""
import argparse
import os
import tempfile


def train_func(config):
    import ray.train
    import ray.train.torch
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    ctx = ray.train.get_context()
    n = config["steps"] * config["batch"] * ctx.get_world_size()
    data = TensorDataset(torch.randn(n, config["dim"]), torch.randint(0, 4, (n,)))
    model = torch.nn.Sequential(torch.nn.Linear(config["dim"], config["dim"]), torch.nn.ReLU(),
                                torch.nn.Linear(config["dim"], 4))
    model = ray.train.torch.prepare_model(model)
    loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=config["batch"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(loader):
        if config["fail_once"] and ctx.get_world_rank() == 1 and step == config["fail_step"] \
                and not os.path.exists(config["fail_once"]):
            open(config["fail_once"], "w").close()
            raise RuntimeError(f"injected failure at step {step}")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if ctx.get_world_rank() == 0:
        print(f"final loss {loss.item():.8f}", flush=True)
        if config["weights"]:
            torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, config["weights"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--address", default=None, help="a running Ray cluster (default: start a local one)")
    p.add_argument("--run-dir", default=None, help="profile the workers into this dtprof run directory")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--weights", default=None, help="rank 0 saves the final weights here (torch.save)")
    p.add_argument("--fail-once", default=None, metavar="FILE")
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--storage", default=None, help="Ray Train's storage_path (default: a temporary directory)")
    args = p.parse_args()

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if args.address:
        ray.init(address=args.address)
    else:   # a small local cluster: 2 CPUs, no dashboard
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100_000_000)
    config = {k: getattr(args, k) for k in ("steps", "dim", "batch", "weights", "fail_once", "fail_step")}
    loop = train_func
    if args.run_dir:
        import dtprof

        loop = dtprof.ray_train(train_func, run_dir=args.run_dir)      # the one line that profiles the workers
    trainer = TorchTrainer(loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=args.storage or tempfile.mkdtemp(prefix="ray-train-"),
                                                failure_config=FailureConfig(max_failures=1)))
    trainer.fit()


if __name__ == "__main__":
    main()
