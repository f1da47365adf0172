"""`dtprof compare`: CI regression gates between runs, and scaling efficiency across world sizes.

The CLI only reads inputs, calls ``dtprof.analyzers.regression.comparison`` (the gates, the verdict and its exit
code) or ``dtprof.analyzers.scaling``, renders through ``dtprof.reports.compare_render`` and exits with the
verdict's code.
Never imports torch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dtprof.cli import InputError


def load_summary(path: str | Path) -> tuple[str, dict]:
    """(display name, summary dict) for a run directory or a summary.json file."""
    p = Path(path)
    if p.is_dir():
        f = p / "summary.json"
        if not f.exists():
            return str(p), _analyze_run_dir(p)
    elif p.exists():
        f = p
    else:
        raise InputError(f"{p}: no such run directory or summary file")
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{f}: cannot read ({e.__class__.__name__}: {e})") from None
    except (ValueError, RecursionError) as e:
        raise InputError(f"{f}: not valid JSON ({str(e)[:200] or 'nested too deeply'})") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), dict):
        raise InputError(f"{f}: not a dtprof summary (no 'steps' section)")
    return str(p), data


def _analyze_run_dir(run_dir: Path) -> dict:
    """Summary of a run directory without summary.json, computed by the analyzers (not written to the run)."""
    from dtprof.options import open_and_analyze
    from dtprof.rundir.conform import RunFormatError

    click.echo(f"dtprof compare: analysing {run_dir} (no summary.json)", err=True)
    try:
        return open_and_analyze(run_dir)[1].summary
    except RunFormatError as e:
        raise InputError(str(e)) from None


def load_gate_file(path: str) -> tuple[list[str], list[str], dict]:
    """Gates from a TOML file: ``gates = [...]``, ``advisory = [...]`` and optional ``confidence``, ``test``."""
    if sys.version_info < (3, 11):
        raise InputError(f"{path}: --gates FILE needs Python 3.11 or newer (tomllib); use --gate EXPR instead")
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path}: not valid TOML ({e})") from None
    data = data.get("compare", data)
    unknown = set(data) - {"gates", "advisory", "confidence", "test"}
    if unknown:
        raise InputError(f"{path}: unknown setting(s) {', '.join(sorted(unknown))} "
                         f"(expected gates, advisory, confidence, test)")
    gates, advisory = data.get("gates", []), data.get("advisory", [])
    if not all(isinstance(g, str) for g in [*gates, *advisory]):
        raise InputError(f"{path}: gates and advisory must be lists of strings")
    return list(gates), list(advisory), {k: data[k] for k in ("confidence", "test") if k in data}


class _CompareCommand(click.Command):
    """Lets ``--head A B C`` take several runs, as the usage line promises (click options take one value each)."""

    def parse_args(self, ctx, args):
        out, in_head = [], False
        for a in args:
            if a == "--head":
                in_head = True
                continue
            if a.startswith("-") and a != "-":
                in_head = False
            elif in_head:
                out.append("--head")
            out.append(a)
        return super().parse_args(ctx, out)


HELP = """Compare runs and fail the build when training got slower.

\b
  dtprof compare BASE... --head HEAD... [--gate EXPR]... [--format text|markdown|json|junit] [-o FILE]
  dtprof compare --scaling RUN...

BASE and HEAD are run directories or their summary.json files; several runs on a side are pooled to model
run-to-run noise. Without --gate/--gates the default gate is 'steps.time_s.p50 < +2%' (decided on the per-step
distributions with a block-bootstrap confidence interval) with advisory rows for MFU, exposed communication,
pipeline bubble and stragglers.

\b
Gate expressions (KEY OP VALUE over summary.json keys):
  steps.time_s.p50 < +5%              head median step time at most 5 % above base
  mfu.value > -2pp                    MFU drops by less than 2 percentage points
  pipeline.bubble_frac < +0.02        bubble grows by less than 0.02 (signed: a change)
  overlap.exposed_comm_frac < 0.30    absolute limit on head (no sign)
  stragglers == 0                     lists count their entries
A gate fails only when its whole confidence interval is past the limit.

\b
Exit codes:
  0  every gate passed
  1  a gate failed (regression)
  2  bad usage or unreadable input
  3  inconclusive: too few measured steps, runs of a different world size, script, model
     parameter count or device (unless --allow-different), or a machine probe (CPU, GPU)
     moved beyond its noise in the direction that could explain the verdict

\b
Example:
  dtprof compare baseline/summary.json --head dtprof-runs/pr-123 --format markdown -o comment.md
"""


@click.command("compare", cls=_CompareCommand, help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("base", nargs=-1, type=click.Path())
@click.option("--head", "head", multiple=True, type=click.Path(), help="Head run (repeat for several).")
@click.option("--gate", "gates", multiple=True, metavar="EXPR", help="A gate expression (repeatable).")
@click.option("--gates", "gates_file", type=click.Path(), metavar="FILE", help="TOML file with a standing set.")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json", "junit"]), default="text",
              show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the report here (default stdout).")
@click.option("--confidence", type=click.FloatRange(0.5, 0.999), default=None,
              help="Confidence of step-time intervals [default: 0.90].")
@click.option("--test", type=click.Choice(["bootstrap", "rank"]), default=None,
              help="Step-time test [default: bootstrap].")
@click.option("--scaling", is_flag=True, help="Scaling efficiency across the given runs (world sizes).")
@click.option("--seed", type=int, default=0, show_default=True, help="Bootstrap seed (results are reproducible).")
@click.option("--allow-different", is_flag=True,
              help="Decide even when the runs differ in world size, script, model parameter count or devices (the "
                   "differences are shown).")
@click.option("--check-prediction", "prediction", metavar="SCENARIO[:RANKS]",
              help="Check the base run's what-if prediction (e.g. straggler_removed:1) against the head run, "
                   "which applied the fix; prints the prediction's error.")
def compare_command(base, head, gates, gates_file, fmt, output, confidence, test, scaling, seed, allow_different,
                    prediction):
    from dtprof.analyzers import regression as rg
    from dtprof.reports import compare_render as cr

    if scaling:
        _scaling(list(base) + list(head), fmt, output)
        return
    if not base or not head:
        raise InputError("give at least one BASE run and one --head run (see --help)")
    advisory: list[str] = []
    settings = {}
    exprs = list(gates)
    if gates_file:
        file_gates, advisory, settings = load_gate_file(gates_file)
        exprs += file_gates
    if not exprs and not gates_file:
        exprs, advisory = list(rg.DEFAULT_GATES), list(rg.DEFAULT_ADVISORY)
    test = test or settings.get("test", "bootstrap")
    confidence = confidence or float(settings.get("confidence", rg.DEFAULT_CONFIDENCE))
    if test not in ("bootstrap", "rank"):
        raise InputError(f"{gates_file}: test must be 'bootstrap' or 'rank'")
    try:
        parsed = [rg.parse_gate(e) for e in exprs] + [rg.parse_gate(e, advisory=True) for e in advisory]
    except rg.GateError as e:
        raise InputError(str(e)) from None

    base_runs = [load_summary(p) for p in base]
    head_runs = [load_summary(p) for p in head]
    b = [s for _, s in base_runs]
    h = [s for _, s in head_runs]
    try:
        d = rg.comparison(parsed, b, h, base_names=[n for n, _ in base_runs], head_names=[n for n, _ in head_runs],
                          test=test, confidence=confidence, seed=seed, allow_different=allow_different)
    except rg.GateError as e:
        raise InputError(str(e)) from None
    d["prediction"] = _check_prediction(prediction, b, h) if prediction else None
    _emit(cr.render(d, {"format": fmt}), output)
    if output and fmt != "text":
        click.echo(f"dtprof compare: {d['outcome']} (exit {d['exit_code']}); wrote {output}", err=True)
    sys.exit(d["exit_code"])


def _emit(text: str, output: str | None) -> None:
    if output:
        try:
            Path(output).write_text(text)
        except OSError as e:
            raise InputError(f"{output}: cannot write ({e.strerror})") from None
    else:
        click.echo(text, nl=False)


def _scaling(paths: list[str], fmt: str, output: str | None) -> None:
    from dtprof.analyzers.scaling import ScalingError, scaling
    from dtprof.reports import compare_render as cr

    if len(paths) < 2:
        raise InputError("--scaling needs at least two runs (of one job at different world sizes)")
    runs = [load_summary(p) for p in paths]
    try:
        d = scaling(runs)
    except ScalingError as e:
        raise InputError(str(e)) from None
    if fmt not in cr.SCALING_RENDERERS:
        raise InputError("--scaling supports --format text, markdown or json")
    _emit(cr.render(d, {"format": fmt, "scaling": True}), output)


def _check_prediction(spec: str, b: list[dict], h: list[dict]) -> dict:
    """--check-prediction: the base runs' what-if entry ``spec`` against the head runs (analyzers/whatif.py)."""
    from dtprof.analyzers.whatif import check_prediction, parse_prediction

    try:
        return check_prediction(b, h, *parse_prediction(spec))
    except ValueError as e:
        raise InputError(str(e)) from None
