"""`dtprof triage` makes its verdict once: the analysis triages with the incident files the command read and the
numerics health the analysis found, and the command prints that result (issue 46 point 2)."""
import json

from click.testing import CliRunner

from dtprof import cli
from dtprof.analyzers import health as health_mod
from dtprof.analyzers import triage as triage_mod
from dtprof.reader import Run
from synth import SynthSpec, build_run


def test_triage_verb_triages_once_and_reads_the_incident_once(tmp_path, monkeypatch):
    run_dir = build_run(tmp_path / "run", SynthSpec(world_size=4, slow_rank=2, slow_factor=1.5))
    calls = {"triage": 0, "incident": 0, "health": 0}
    real_triage, real_incident, real_health = triage_mod.triage, Run.incident, health_mod.of_run

    def counting_triage(*a, **kw):
        calls["triage"] += 1
        return real_triage(*a, **kw)

    def counting_incident(self, *a, **kw):
        calls["incident"] += 1
        return real_incident(self, *a, **kw)

    def counting_health(*a, **kw):
        calls["health"] += 1
        return real_health(*a, **kw)

    monkeypatch.setattr(triage_mod, "triage", counting_triage)
    monkeypatch.setattr(health_mod, "of_run", counting_health)
    monkeypatch.setattr(Run, "incident", counting_incident)
    res = CliRunner().invoke(cli.main, ["triage", str(run_dir), "--json"])
    out = json.loads(res.output)
    assert calls == {"triage": 1, "incident": 1, "health": 1}
    # the verdict printed is the analysis' own, with its stragglers and evidence
    assert out["verdict"] == "straggler" and out["culprit_ranks"] == [2] and res.exit_code == 1
    assert out["evidence"]


def test_exception_lines_of_every_rank_in_one_pass_are_each_ranks_last():
    """The job's output read once for every rank (one pattern, not one compiled per rank): rank 1's last exception
    line, never rank 12's, and no line for a rank that printed none."""
    logs = ("[rank1]: ValueError: first\n[rank12]: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "[rank1]:   File \"train.py\", line 3\n[rank1]: torch.OutOfMemoryError: CUDA out of memory.\n"
            "[rank3]: just a warning\n")
    lines = triage_mod._exception_lines(logs)
    assert lines == {1: "torch.OutOfMemoryError: CUDA out of memory.",
                     12: "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert triage_mod._exception_line(logs, 1) == lines[1]
    assert triage_mod._exception_line(logs, 3) is None
