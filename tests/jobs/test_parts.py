"""The rank-side part contract (collectors/parts.py) on a real training loop: each callback arrives on the step
it belongs to, and a part that raises is switched off alone while the recording and the training go on."""
import subprocess
import sys
import textwrap

from dtprof.reader import open_run

JOB = textwrap.dedent("""
    import sys, torch
    import dtprof
    from dtprof.collectors import parts

    class Probe(parts.RankPart):
        name = "probe"
        def on_backward(self, tensors):
            self.ctx.event("info", f"backward {self.ctx.step} {tensors.numel()} {tensors.grad_fn is not None}")
        def on_optimizer_step(self, optimizer):
            self.ctx.event("info", f"optimizer {self.ctx.step} {optimizer.param_groups[0]['lr']}")
        def on_step_end(self, step, t_ns, detailed):
            self.ctx.event("info", f"step_end {step} {self.ctx.step} {detailed}")

    class Faulty(parts.RankPart):
        name = "faulty"
        def on_step_end(self, step, t_ns, detailed):
            if step == 2:
                raise RuntimeError("faulty part at step 2")
            self.ctx.event("info", f"faulty {step}")

    parts.PART_FACTORIES[:] = [lambda o: Probe(), lambda o: Faulty()]
    dtprof.init(sys.argv[1], rank=0)
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.125)
    for i in range(5):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("final", m.weight.sum().item())
""")


def _run_job(tmp_path):
    """Run tmp_path/job.py (it records itself into tmp_path/run) and open its run."""
    p = subprocess.run([sys.executable, "job.py", str(tmp_path / "run")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return open_run(tmp_path / "run")


def test_parts_hear_each_step_and_a_faulty_part_is_dropped_alone(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    run = _run_job(tmp_path)
    assert run.steps.step.tolist() == [0, 1, 2, 3, 4]      # the recording went on after the part's fault
    messages = run.events.message.tolist()
    probe = [m for m in messages if m.split()[0] in ("backward", "optimizer", "step_end")]
    expected = []
    for s in range(5):   # the loss's backward, then the optimizer step, then the step's end, all of step s
        expected += [f"backward {s} 1 True", f"optimizer {s} 0.125", f"step_end {s} {s + 1} True"]
    assert probe == expected
    assert [m for m in messages if m.startswith("faulty")] == ["faulty 0", "faulty 1"]
    errors = run.events[run.events.level == "error"].message.tolist()
    assert errors == ["dtprof part faulty.on_step_end switched off after a fault: RuntimeError: faulty part at step 2"]


GROUPED_JOB = textwrap.dedent("""
    import sys, torch
    import dtprof
    from dtprof.collectors import parts

    class Grouped(parts.RankPart):
        # an engine that steps the torch optimizer once per parameter group (DeepSpeed ZeRO): all but the last
        name = "grouped"
        def install(self, ctx):
            self.ctx = ctx
            ctx.event("info", f"made at step {ctx.step}")
        def optimizer_step_pending(self, optimizer):
            return optimizer.param_groups[0]["lr"] == 0.5
        def on_optimizer_group(self, optimizer):
            self.ctx.event("info", f"group {self.ctx.step}")
        def on_optimizer_step(self, optimizer):
            self.ctx.event("info", f"optimizer {self.ctx.step}")

    def make(options):
        return Grouped()
    make.when_imported = "enginelib"      # made once the job imports it
    parts.PART_FACTORIES[:] = [make]
    dtprof.init(sys.argv[1], rank=0)
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.125)
    def train(steps, groups):
        for i in range(steps):
            m(torch.randn(4, 8)).pow(2).mean().backward()
            for lr in groups:
                opt.param_groups[0]["lr"] = lr
                opt.step()
            opt.zero_grad()
    import importlib.util
    importlib.util.find_spec("enginelib")   # a look-up that imports nothing (transformers' is_*_available)
    train(2, [0.5, 0.125])        # before the import: no part, each torch step a step
    import enginelib
    train(3, [0.5, 0.5, 0.125])   # after: three groups, one step
""")


def test_a_part_made_when_its_library_is_imported_joins_the_groups_of_one_optimizer_step(tmp_path):
    (tmp_path / "job.py").write_text(GROUPED_JOB)
    (tmp_path / "enginelib.py").write_text("")
    run = _run_job(tmp_path)
    # two torch steps a step before the import (4 steps), three torch steps one step after it (3 steps)
    assert run.steps.step.tolist() == list(range(7))
    messages = [m for m in run.events.message.tolist() if m.split()[0] in ("made", "group", "optimizer")]
    assert messages == ["made at step 4"] + [m for s in (4, 5, 6) for m in (f"group {s}", f"group {s}",
                                                                            f"optimizer {s}")]
    assert (run.events.level != "error").all(), run.events


SAMPLED_JOB = textwrap.dedent("""
    import sys, torch
    import dtprof
    from dtprof.collectors import parts

    class Probe(parts.RankPart):
        def on_optimizer_step(self, optimizer):
            self.ctx.event("info", f"{self.name} optimizer {self.ctx.step} {self.ctx.detail}")
        def on_step_end(self, step, t_ns, detailed):
            self.ctx.event("info", f"{self.name} step_end {step} {detailed}")

    class Every(Probe):
        name = "every"

    class Detailed(Probe):
        name = "detailed"
        every_step = False

    parts.PART_FACTORIES[:] = [lambda o: Every(), lambda o: Detailed()]
    dtprof.init(sys.argv[1], rank=0, sample_every=8)    # from step 32: 4 detailed steps in every 8
    m = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.125)
    for i in range(48):
        m(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
""")


def test_a_part_that_needs_no_boundary_steps_hears_the_detailed_ones_only(tmp_path):
    (tmp_path / "job.py").write_text(SAMPLED_JOB)
    run = _run_job(tmp_path)
    assert run.steps.step.tolist() == list(range(48))
    # the steps recorded in full detail: those with a forward span (the run's own record of the sampling)
    detailed = sorted(set(run.spans[run.spans.kind == "forward"].step.tolist()))
    assert 0 < len([s for s in detailed if s >= 32]) < 16        # some steps after 32 were boundary-only
    messages = run.events.message.tolist()

    def heard(part, what):
        return [int(m.split()[2]) for m in messages if m.startswith(f"{part} {what} ")]

    assert heard("every", "optimizer") == heard("every", "step_end") == list(range(48))
    assert heard("detailed", "optimizer") == heard("detailed", "step_end") == detailed
    # each heard its steps with the detail they were recorded in
    for s in range(48):
        assert f"every step_end {s} {s in detailed}" in messages
