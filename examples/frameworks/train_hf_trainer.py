"""A Hugging Face Trainer job: a tiny GPT-2 built from its config, trained on random tokens, on CPU (gloo).

    torchrun --nproc_per_node=2 examples/frameworks/train_hf_trainer.py --steps 6
    torchrun --nproc_per_node=2 examples/frameworks/train_hf_trainer.py --steps 6 --accumulate 2
    torchrun --nproc_per_node=2 examples/frameworks/train_hf_trainer.py --steps 6 --eval-every 2   # evaluates too
    dtprof run -- torchrun --nproc_per_node=2 examples/frameworks/train_hf_trainer.py   # profiled, unchanged
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 examples/frameworks/train_hf_trainer.py --deepspeed 2   # ZeRO-2
    # on a GPU: GPT-2 124M, bf16, 8 x 1024 tokens, the loss logged every 50 steps, each step's end printed
    torchrun --nproc_per_node=1 examples/frameworks/train_hf_trainer.py --gpt2-124m --steps 150 --print-time [--compile]

Nothing is downloaded: the model comes from ``GPT2Config`` (2 layers, a 256-token vocabulary; ``--gpt2-124m``: the
default config, GPT-2 small) and the data is a list of random token sequences. Rank 0 prints ``final loss <value>``
and, with ``--eval-every``, ``evaluation after step <n>`` after each evaluation. With ``--own-clock`` every rank
prints the job's own clock of its communication per optimizer step (``clock <rank> {"steps": [[duration,
communication], ...]}``, comm_clock.py) and ``weights <rank> <sha256>`` of its final parameters.
"""
import argparse
import hashlib
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import comm_clock  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402


def tiny_gpt2_config(seq: int) -> GPT2Config:
    return GPT2Config(vocab_size=256, n_positions=seq, n_embd=64, n_layer=2, n_head=2)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(stage: int | None) -> dict | None:
    """DeepSpeed's config for the Trainer: its "auto" values are filled from the TrainingArguments."""
    if stage is None:
        return None
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9}


class PrintStepTimes(TrainerCallback):
    """The job's own clock: ``step N t CLOCK`` at each optimizer step's end (the wall time the host reached it)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"step {state.global_step} t {time.monotonic():.6f}", flush=True)


class OwnClock(TrainerCallback):
    """Per optimizer step (from one step's end to the next, the first from the training's start): its duration and
    the training thread's time inside torch.distributed calls and waits (comm_clock.py)."""

    def __init__(self):
        self.steps, self.last = [], None

    def _now(self):
        return time.perf_counter(), comm_clock.comm_s()

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        now = self._now()
        self.steps.append([now[0] - self.last[0], now[1] - self.last[1]])
        self.last = now


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class PrintLogs(TrainerCallback):
    """The Trainer's own log of each logged step: ``LOG {"step": N, "loss": ..., "grad_norm": ...}`` (rank 0)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            import json
            print("LOG " + json.dumps({"step": state.global_step, **logs}), flush=True)


class PrintEvaluations(TrainerCallback):
    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"evaluation after step {state.global_step}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--batch", type=int, default=4, help="per-device batch")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--eval-batches", type=int, default=4, help="evaluation batches per device")
    p.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument("--deepspeed", type=int, default=None, metavar="STAGE",
                   help="TrainingArguments(deepspeed=...) with this ZeRO stage (on CPU: DS_ACCELERATOR=cpu)")
    p.add_argument("--gpt2-124m", action="store_true",
                   help="GPT-2 small on the GPU: the default GPT2Config, bf16, sequences of 1024, batch 8, the loss "
                        "logged every 50 steps (the other size options are ignored)")
    p.add_argument("--print-logs", action="store_true", help="rank 0 prints the Trainer's log of each step")
    p.add_argument("--print-time", action="store_true", help="rank 0 prints 'step N t CLOCK' at each step's end")
    p.add_argument("--out", default=None, help="Trainer output_dir (default: a temporary directory)")
    p.add_argument("--own-clock", action="store_true",
                   help="every rank prints its own clock of communication per step and its final weights' hash")
    args = p.parse_args()
    if args.own_clock:   # before DeepSpeed is imported (by TrainingArguments(deepspeed=...))
        comm_clock.install()
        own_clock = OwnClock()
    torch.manual_seed(0)
    gpu = args.gpt2_124m and torch.cuda.is_available()
    if args.gpt2_124m:
        args.seq, args.batch = 1024, 8
        config = GPT2Config(n_positions=args.seq)
    else:
        config = tiny_gpt2_config(args.seq)
    model = GPT2LMHeadModel(config)
    world = int(os.environ.get("WORLD_SIZE", 1))
    data = RandomTokens(args.steps * args.accumulate * args.batch * world, args.seq, config.vocab_size)
    import tempfile

    accelerator_config = None
    if args.deepspeed is not None and not gpu:
        # On a machine without a GPU, Accelerate's state (which the Trainer makes) finds no device backend and counts
        # one process of rank 0 on every rank while DeepSpeed runs on all of them: the data are not sharded, every
        # rank logs as the main one, and DeepSpeed rejects the batch size ("4 != 4 * 1 * 2"). The Trainer passes
        # no backend for DeepSpeed, so the state is made here with gloo named, and the Trainer told to use it.
        from accelerate import PartialState
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        accelerator_config = {"use_configured_state": True}

    training_args = TrainingArguments(
        output_dir=args.out or tempfile.mkdtemp(prefix="hf-trainer-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulate, learning_rate=1e-3,
        logging_steps=50 if args.gpt2_124m else 1, save_strategy="no", report_to=[],
        use_cpu=not gpu and args.deepspeed is None, deepspeed=ds_config(args.deepspeed),
        accelerator_config=accelerator_config,
        ddp_backend="nccl" if gpu else "gloo", bf16=gpu, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, torch_compile=args.compile,
        **(dict(eval_strategy="steps", eval_steps=args.eval_every, per_device_eval_batch_size=args.batch)
           if args.eval_every else {}))
    evaluation = (RandomTokens(args.eval_batches * args.batch * world, args.seq, config.vocab_size, seed=1)
                  if args.eval_every else None)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, eval_dataset=evaluation,
                      callbacks=[PrintEvaluations()] + ([PrintStepTimes()] if args.print_time else [])
                      + ([PrintLogs()] if args.print_logs else []) + ([own_clock] if args.own_clock else []))
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"final loss {result.training_loss:.8f}", flush=True)
    if args.own_clock:   # under ZeRO-1/2 every rank holds the whole model after the step's all-gather
        rank = trainer.args.process_index
        print(f"clock {rank} " + json.dumps({"steps": own_clock.steps}), flush=True)
        print(f"weights {rank} {weights_hash(trainer.model)}", flush=True)
    if args.compile:
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from compile_stats import print_dynamo_line

        print_dynamo_line(trainer.args.process_index)
    # the Trainer leaves its process group up; exiting with gloo's threads alive can abort the process
    # ("terminate called without an active exception", pytorch issue #190489)
    if torch.distributed.is_initialized():
        # and freeing DDP's reducer (when main returns) joins gloo's workers while holding the GIL: a worker still
        # destroying the last finished all-gather needs the GIL to free its tensor, and both wait forever (seen
        # in about 1 bare run in 8). A barrier waits for every pending work; the sleep (GIL released) lets the
        # workers finish destroying them first.
        torch.distributed.barrier()
        time.sleep(0.2)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
