"""Random faults into real small jobs under `dtprof run`, each against the same fault without dtprof (issue 50).

    .venv/bin/python benchmarks/chaos.py --faults 100 --seed 1 [--kinds rank_kill,agent_kill] [--jobs ddp,fsdp2]
        [--slice 0:20] [--json rows.json] [--keep DIR]
    .venv/bin/python benchmarks/chaos.py --tally rows-*.json        # one table from the rows of several slices

Each fault is drawn (seeded) from CATALOGUE with a job it applies to (JOBS), a culprit rank and a step: a 3-rank
job of benchmarks/chaos_job.py (DDP, FSDP2, a torch.distributed.pipelining pipeline or Lightning), or for a node
lost a two-node torchrun on this machine (two agents, one rank each, each under its own `dtprof run` into one run
directory). `--slice A:B` runs faults A to B-1 of the drawn list, so that a long campaign runs in parts whose rows
`--tally` joins into the table of the whole. The job injects the fault itself at the end of that step, so
the run without dtprof meets the same fault at the same point. For each fault:

- **unharmed**: the job's fate under dtprof equals its fate without: the same exit code (a hang: both stopped,
  `dtprof run --hang-timeout` exiting 124, the bare job still running HUNG_AFTER_S after the fault landed), and
  where the job
  finishes, the same final weights (SHA-256 of rank 0's state dict);
- **rows lost**: while the job runs, the rows of each rank's `steps` table that are already readable on disk are
  counted every 0.2 s; after the fault, the run must still read at least as many for every rank;
- **leftovers**: no process of the job (its environment names the node directory) nor `dtprof run` is left once
  it has returned (after a killed `dtprof run`, once the job itself ended);
- **named**: `dtprof triage --json` gives the verdict and culprit ranks CATALOGUE expects (for dtprof's own
  faults: no false verdict, and `dtprof run` names its fault; for an out-of-memory error and a NaN, also the
  step). Named right, wrong (another verdict or culprit) or missed (nothing found: "healthy", or dtprof's own
  fault left unsaid).

Prints one row per fault, then one table by kind. Needs root for the run-directory faults (a small tmpfs filled;
a loop-mounted ext4 turned read-only by an error); without it those are skipped.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "benchmarks" / "chaos_job.py"
BIN = Path(sys.executable).parent
HANG_TIMEOUT_S = 15
LIMIT_S = 120          # the longest a job may take (a clean Lightning one takes about 50 s on the busy VM)
PG_TIMEOUT_S = 10      # the process group's timeout in a collective-timeout fault (its culprit sleeps 1.5x that)
# a bare job of a kind that hangs still running this long after its culprit injected the fault (the job's "injected"
# file) is hung, so that a hang costs no full LIMIT_S: past a collective timeout's end (PG_TIMEOUT_S, then
# torchrun's teardown); a frozen rank's peers wait in a collective with a 300 s timeout
HUNG_AFTER_S = {"coll_timeout": 2 * PG_TIMEOUT_S + 15, "rank_stop": 20}
NPROC = 3

# kind: (expected verdict, the culprit is the injecting rank?, words the message must hold (alternatives split by
# "|"), the job survives it)
CATALOGUE = {
    "rank_kill": ("crash", True, "SIGKILL", False),
    "rank_stop": ("hang", True, "SIGSTOP", False),
    "rank_raise": ("crash", True, "chaos: injected failure", False),
    "rank_exit": ("crash", True, "exit", False),
    "agent_kill": ("crash", False, "torchrun's agent", False),
    "dtprof_kill": ("interrupted", False, "launcher was killed", True),
    "node_lost": ("crash", False, "torchrun's agent", False),
    "coll_timeout": ("hang", True, "", False),
    "mismatch": ("mismatch", True, "broadcast", True),
    "dir_readonly": ("interrupted", False, "unwritable", True),
    "dir_full": ("healthy", False, "", True),
    "hb_raise": ("healthy", False, "", True),
    "hb_stall": ("healthy", False, "", True),
    "flusher_raise": ("healthy", False, "", True),
    "flusher_stall": ("healthy", False, "", True),
    "oom": ("oom", True, "could not allocate 64.0 TiB|could not allocate 65536.0 GiB", False),
    "oom_cuda": ("oom", True, "could not allocate 2.0 GiB", False),
    "nan": ("numerics", True, "", True),
}
# the jobs each kind is drawn into: the two-agent job is DDP's; a collective timeout and a mismatched broadcast are
# the job's own collectives (DDP's); a NaN fed to one pipeline stage is every later stage's loss
ALL_JOBS = ("ddp", "fsdp2", "pipeline", "lightning")
JOBS = {k: ("ddp",) if k in ("node_lost", "coll_timeout", "mismatch") else
        ("ddp", "fsdp2", "lightning") if k == "nan" else ALL_JOBS for k in CATALOGUE}
STEP_NAMED = ("oom", "oom_cuda", "nan")   # kinds whose verdict names the fault's step
# what `dtprof run` must say on its stderr for a fault inside dtprof or its run directory (the cause named)
OWN_FAULT_WORDS = {"dir_readonly": ("read-only", "Read-only"), "dir_full": ("disk full", "No space"),
                   "hb_raise": ("heartbeat",), "hb_stall": ("heartbeat",), "flusher_raise": ("flusher",),
                   "flusher_stall": ("flusher",)}


@dataclass
class Fault:
    kind: str
    rank: int
    step: int
    steps: int
    job: str = "ddp"
    nproc: int = NPROC   # ranks of the one-node job (the test subset runs 2: each rank's start-up is most of a fault)
    row: dict = field(default_factory=dict)


def draw(n: int, seed: int, kinds: list[str], jobs: list[str] | None = None) -> list[Fault]:
    """n faults: each kind once first (in the order given), then kinds at random; each into a job drawn from those
    it applies to."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        nranks = 2 if kind == "node_lost" else NPROC
        rank = 0 if kind in ("dir_readonly", "dir_full", "dtprof_kill") else rng.randrange(1, nranks)
        steps = rng.randrange(14, 22)
        step = rng.randrange(4, steps - 6)
        fit = [j for j in JOBS[kind] if jobs is None or j in jobs] or [JOBS[kind][0]]
        out.append(Fault(kind, rank, step, steps, rng.choice(fit)))
    return out


# ---- processes -------------------------------------------------------------------------------------------------

def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds CHAOS_TAG=tag: every process of one fault's jobs."""
    entry = f"CHAOS_TAG={tag}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0") and _state(int(name)) not in (None, "Z", "X"):
                    out.append(int(name))
        except OSError:
            pass
    return out


def kill_tagged(tag: str) -> None:
    for _ in range(3):
        pids = tagged(tag)
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.5)


def torchrun(fault: Fault, node: int | None, port: int) -> list[str]:
    if node is None:
        return [str(BIN / "torchrun"), f"--nproc_per_node={fault.nproc}", "--standalone", "--monitor-interval=0.2",
                str(JOB)]
    # the rendezvous store on the node whose agent is killed (node 1, rank 1's), never left to a race: with it the
    # surviving agent fails at once (exit 1); without it, it waits in torchrun's exit barrier for 300 s
    return [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=chaos{port}",
            f"--rdzv-conf=is_host={int(node == fault.rank)}", "--monitor-interval=0.2", str(JOB)]


def job_env(fault: Fault, tag: str, out: Path, mount: Path | None, fs_error: str | None = None) -> dict:
    env = dict(os.environ, CHAOS_FAULT=fault.kind, CHAOS_JOB=fault.job,
               CHAOS_RANK=str(fault.rank), CHAOS_STEP=str(fault.step), CHAOS_STEPS=str(fault.steps),
               CHAOS_OUT=str(out), CHAOS_TAG=tag, OMP_NUM_THREADS="1",
               CHAOS_PG_TIMEOUT=str(PG_TIMEOUT_S) if fault.kind == "coll_timeout" else "300")
    if mount is not None:
        env["CHAOS_MOUNT"] = str(mount)
    if fs_error is not None:
        env["CHAOS_FS_ERROR"] = fs_error
    return env


def launch(fault: Fault, tag: str, out: Path, run_dir: Path | None, mount: Path | None,
           fs_error: str | None = None) -> list[subprocess.Popen]:
    """The job's launchers: bare torchrun (run_dir None) or `dtprof run`; two for a two-node job."""
    port = _free_port()
    nodes = [0, 1] if fault.kind == "node_lost" else [None]
    procs = []
    for node in nodes:
        cmd = torchrun(fault, node, port)
        if run_dir is not None:
            # a collective timeout is gloo's to report: the watchdog waits longer than the process group does
            hang = 2 * PG_TIMEOUT_S + HANG_TIMEOUT_S if fault.kind == "coll_timeout" else HANG_TIMEOUT_S
            # --peak-tflops: no MFU calibration after the job (seconds of a torch start-up, nothing the faults touch)
            cmd = [str(BIN / "dtprof"), "run", "--out", str(run_dir), "--no-report", "--no-nvml", "--peak-tflops", "1",
                   "--hang-timeout", str(hang), "--", *cmd]
        procs.append(subprocess.Popen(cmd, env=job_env(fault, tag, out, mount, fs_error), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True))
    return procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- rows on disk ----------------------------------------------------------------------------------------------

def readable_rows(run_dir: Path) -> dict[int, int]:
    """Rows of each rank's steps table a reader can decode from disk now (complete lines of the gzip stream so far;
    a flush ends in a complete deflate block, so a running rank's file reads up to its last flush)."""
    out: dict[int, int] = {}
    for p in run_dir.glob("node-*/rank-*/steps*.jsonl.gz"):
        try:
            rank = int(p.parent.name.split("-")[1])
            data = zlib.decompressobj(31).decompress(p.read_bytes())
        except (OSError, ValueError, zlib.error):
            continue
        out[rank] = out.get(rank, 0) + max(0, data.count(b"\n") - 1)   # less the header line
    return out


def rows_after(run_dir: Path) -> dict[int, int]:
    """Steps rows per rank as `dtprof` reads the finished run (its tables, compacted or not)."""
    from dtprof.reader import open_run

    steps = open_run(run_dir).steps
    return {int(r): int(n) for r, n in steps.groupby("rank").size().items()} if len(steps) else {}


def triage_json(run_dir: Path) -> dict:
    """`dtprof triage RUN --json`, in this process (a fresh process spends seconds importing what this one has)."""
    from click.testing import CliRunner

    from dtprof.triage import triage_command

    res = CliRunner().invoke(triage_command, [str(run_dir), "--json"])
    try:
        return json.loads(res.stdout)
    except ValueError:
        return {"verdict": "error", "culprit_ranks": [], "message": (res.output or repr(res.exception))[-300:]}


# ---- one fault -------------------------------------------------------------------------------------------------

def finish(procs: list[subprocess.Popen], limit_s: float, watch=None, injected: Path | None = None,
           hung_after_s: float = 0.0) -> tuple[list[int | None], str]:
    """Wait for the launchers (None: still running at the limit, or ``hung_after_s`` after the fault was injected
    when ``injected`` names the job's marker file); returns their exit codes and stderr."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if watch:
            watch()
        if injected is not None and injected.exists():
            deadline = min(deadline, time.monotonic() - (time.time() - injected.stat().st_mtime) + hung_after_s)
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    err = ""
    for p in procs:
        if p.poll() is None:
            continue
        err += p.stderr.read().decode(errors="replace") if p.stderr else ""
    return [None if c is None else (128 - c if c < 0 else c) for c in codes], err


def fate(codes: list[int | None], out: Path) -> str:
    """The exit codes, and where ranks finished, a digest of every finishing rank's final weights."""
    if any(c is None for c in codes) or 124 in codes:
        return "hung"
    weights = sorted(out.glob("weights-*.sha256"))
    digest = hashlib.sha256("".join(f"{w.name}{w.read_text()}" for w in weights).encode()).hexdigest()[:8]
    return ",".join(map(str, codes)) + (f" w={digest}" if weights else "")


# The bare job's fate is measured once per key and kept (--cache): a fault that needs dtprof (a no-op without it)
# leaves the clean job's fate, by (job, steps); a fault the job does not survive ends it with an exit code of the
# kind, job and culprit, not of the step, by (job, kind, rank), and for a killed agent, whose ranks train on to
# their end, by its step count too; a fault the job survives (a NaN, a mismatched broadcast) changes its weights
# by its step: measured every time.
NEEDS_DTPROF = (*OWN_FAULT_WORDS, "dtprof_kill")
BARE: dict[str, str] = {}


def bare_key(fault: Fault) -> str | None:
    ranks = "" if fault.nproc == NPROC else f" x{fault.nproc}"
    if fault.kind in NEEDS_DTPROF:
        return f"clean {fault.job} {fault.steps}{ranks}"
    if CATALOGUE[fault.kind][3]:
        return None
    # torchrun's agent killed: its ranks train on to their end, and their weights depend on the step count
    steps = f" {fault.steps}" if fault.kind == "agent_kill" else ""
    return f"{fault.kind} {fault.job} {fault.rank}{steps}{ranks}"


def run_fault(fault: Fault, work: Path, quiet: bool) -> dict:
    tag = f"{os.getpid()}-{work.name}"
    mount = None
    fs_error = None
    if fault.kind in ("dir_readonly", "dir_full"):
        # full: a small tmpfs the job fills. Read-only: a loop-mounted ext4 that turns read-only on an error, which
        # the job triggers (/sys/fs/ext4/<dev>/trigger_fs_error): a busy file system refuses `mount -o remount,ro`
        mount = work / "disk"
        mount.mkdir()
        if fault.kind == "dir_full":
            cmds = [["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)]]
        else:
            img = work / "disk.img"
            cmds = [["truncate", "-s", "64M", str(img)], ["mkfs.ext4", "-q", "-F", str(img)],
                    ["mount", "-o", "loop,errors=remount-ro", str(img), str(mount)]]
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True)
            if r.returncode != 0:
                return {"kind": fault.kind, "skipped": f"{' '.join(cmd[:2])} failed (needs root and loop devices)"}
        if fault.kind == "dir_readonly":
            dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(mount)], capture_output=True, text=True)
            fs_error = f"/sys/fs/ext4/{Path(dev.stdout.strip()).name}/trigger_fs_error"
    try:
        # without dtprof
        key = bare_key(fault)
        bare = BARE.get(key) if key else None
        t0 = time.monotonic()
        if bare is None:
            bare_out = work / "bare"
            bare_out.mkdir()
            procs = launch(fault, tag + "b", bare_out, None, None)
            hangs = fault.kind in HUNG_AFTER_S
            bare_codes, _ = finish(procs, LIMIT_S, injected=bare_out / "injected" if hangs else None,
                                   hung_after_s=HUNG_AFTER_S.get(fault.kind, 0.0))
            kill_tagged(tag + "b")
            bare = fate(bare_codes, bare_out)
            if key:
                BARE[key] = bare
        # under dtprof
        out = work / "dtprof"
        out.mkdir()
        run_dir = (mount or work) / "run"
        seen: dict[int, int] = {}

        def watch():
            for r, n in readable_rows(run_dir).items():
                seen[r] = max(seen.get(r, 0), n)
        t1 = time.monotonic()
        procs = launch(fault, tag + "d", out, run_dir, mount, fs_error)
        codes, err = finish(procs, LIMIT_S + 60, watch)
        if fault.kind == "dtprof_kill":   # the job trains on without its launcher: wait for its end
            deadline = time.monotonic() + LIMIT_S
            while tagged(tag + "d") and time.monotonic() < deadline:
                watch()
                time.sleep(0.5)
            watch()   # what the ranks flushed at their end, which no launcher compacted
            codes = [0] if (out / "weights-0.sha256").exists() else codes
        # left running after `dtprof run` returned (a launcher still running at the limit is the job's own hang,
        # counted in its fate, as the bare job's)
        leftovers = tagged(tag + "d") if all(c is not None for c in codes) else []
        kill_tagged(tag + "d")
        under = fate(codes, out)
        try:
            after = rows_after(run_dir)
            lost = sum(max(0, n - after.get(r, 0)) for r, n in seen.items())
            read_error = ""
        except Exception as e:   # an unreadable run loses every row it had
            lost, read_error = sum(seen.values()), f"{type(e).__name__}: {e}"[:200]
        t2 = time.monotonic()
        verdict = triage_json(run_dir)
        row = {"kind": fault.kind, "job": fault.job, "rank": fault.rank, "step": fault.step, "steps": fault.steps,
               "bare": bare, "dtprof": under,
               "unharmed": bare == under, "rows_seen": sum(seen.values()), "rows_lost": lost,
               "read_error": read_error, "leftovers": len(leftovers),
               "dtprof_said": any(w in err for w in OWN_FAULT_WORDS.get(fault.kind, ())),
               "verdict": verdict.get("verdict"), "culprits": verdict.get("culprit_ranks"),
               "verdict_step": verdict.get("step"), "message": verdict.get("message", "")[:400],
               "took": {"bare_s": round(t1 - t0, 1), "dtprof_s": round(t2 - t1, 1),
                        "triage_s": round(time.monotonic() - t2, 1)}}
        return judge(row)
    finally:
        kill_tagged(tag + "b")
        kill_tagged(tag + "d")
        if mount is not None:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def judge(row: dict) -> dict:
    """``named`` (triage's verdict, culprit, cause words, and for STEP_NAMED the step; for a fault of dtprof's own,
    `dtprof run` said it) and ``missed`` (not named, and triage found nothing), from the row's own fields."""
    exp_verdict, culprit_is_rank, words, _ = CATALOGUE[row["kind"]]
    named = (row["verdict"] == exp_verdict and row["culprits"] == ([row["rank"]] if culprit_is_rank else [])
             and any(w in (row["message"] or "") for w in words.split("|")))
    if row["kind"] in STEP_NAMED:
        named = named and row["verdict_step"] == row["step"]
    if row["kind"] in OWN_FAULT_WORDS:
        named = named and row.get("dtprof_said", row.get("named"))
    return {**row, "named": bool(named), "missed": not named and row["verdict"] == "healthy"}


def table(rows: list[dict]) -> str:
    """By kind (and all): faults, jobs they ran in, job unharmed %, rows lost, leftovers, triage named right /
    wrong / missed."""
    kinds = sorted({r["kind"] for r in rows})
    lines = [f"{'fault':<14} {'n':>3} {'jobs':<30} {'unharmed':>9} {'rows lost':>10} {'leftovers':>10} "
             f"{'right':>6} {'wrong':>6} {'missed':>7}"]
    for k in kinds + ["all"]:
        rs = [r for r in rows if (k == "all" or r["kind"] == k) and "skipped" not in r]
        if not rs:
            continue
        n = len(rs)
        jobs = ",".join(f"{j} {sum(r.get('job', 'ddp') == j for r in rs)}" for j in ALL_JOBS
                        if any(r.get("job", "ddp") == j for r in rs)) if k != "all" else ""
        right = sum(r["named"] for r in rs)
        missed = sum(bool(r.get("missed")) for r in rs)
        lines.append(f"{k:<14} {n:>3} {jobs:<30} {sum(r['unharmed'] for r in rs) / n:>9.0%} "
                     f"{sum(r['rows_lost'] for r in rs):>10} {sum(r['leftovers'] for r in rs):>10} "
                     f"{right:>6} {n - right - missed:>6} {missed:>7}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=len(CATALOGUE))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(CATALOGUE), help="comma-separated kinds to draw from")
    p.add_argument("--jobs", default=",".join(ALL_JOBS), help="comma-separated jobs to draw into")
    p.add_argument("--slice", default="", help="A:B: run faults A to B-1 of the drawn list only")
    p.add_argument("--keep", type=Path, help="keep each fault's runs under this folder")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--cache", type=Path, help="keep the bare jobs' fates here across runs (see bare_key)")
    p.add_argument("--tally", type=Path, nargs="+", help="print the table of these --json files' rows, run nothing")
    a = p.parse_args(argv)
    if a.tally:
        try:
            rows = [judge(r) if "skipped" not in r else r for f in a.tally for r in json.loads(f.read_text())]
        except (OSError, ValueError) as e:
            print(f"chaos.py: cannot read the rows: {e}", file=sys.stderr)
            return 2
        print(table(rows))
        return 0
    kinds = [k for k in a.kinds.split(",") if k]
    jobs = [j for j in a.jobs.split(",") if j]
    unknown = (set(kinds) - set(CATALOGUE)) | (set(jobs) - set(ALL_JOBS))
    if unknown:
        print(f"chaos.py: unknown fault kind(s) or job(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    lo, _, hi = a.slice.partition(":")
    faults = list(enumerate(draw(a.faults, a.seed, kinds, jobs)))[int(lo or 0):int(hi or a.faults)]
    root = a.keep or Path(tempfile.mkdtemp(prefix="dtprof-chaos-"))
    if a.cache and a.cache.exists():
        BARE.update(json.loads(a.cache.read_text()))
    rows = []
    for i, fault in faults:
        work = root / f"{i:03d}-{fault.job}-{fault.kind}"
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        row = run_fault(fault, work, quiet=False)
        row["took_s"] = round(time.monotonic() - t0, 1)
        row["index"] = i
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
        if a.cache:
            a.cache.write_text(json.dumps(BARE, indent=1))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
