"""`dtprof run` around DeepSpeed's launcher (``deepspeed``) on several hosts (docs/cli-run.md, "DeepSpeed on several
hosts").

Two ways to start one job on the hosts of a hostfile:

- one launcher per node (``srun dtprof run --out DIR -- deepspeed --hostfile H --no_ssh --node_rank N ...``): each
  node's `dtprof run` records its own ranks and joins the run directory on the master's address and port
  (``join_id``);
- from one host: DeepSpeed's runner starts each host's ranks through pdsh (ssh), in an environment made of the
  variables whose names start with its EXPORT_ENVS prefixes (``PYTHON...``: dtprof's ``PYTHONPATH`` reaches them)
  and of the lines of its environment file (``DS_ENV_FILE``, default ``.deepspeed_env``, read in ``~`` and in
  ``.``), never ``DTPROF_NODE_DIR``/``DTPROF_CONFIG``: without them no rank is recorded, in silence. So `dtprof run`
  writes an environment file in its node directory, the user's own lines (read as DeepSpeed reads them) followed by
  dtprof's, and points ``DS_ENV_FILE`` at it. Every host's ranks then record into that node directory, which every
  host must see at the same path (a shared file system), as `--out` must be for any multi-node run. DeepSpeed's
  other multi-host launchers (``--launcher openmpi``, ``mvapich``, ``mpich``, ``impi``) pass the file's values on
  without a shell, where dtprof's quoting does not hold: `dtprof run` says in one line at start that the other
  hosts' ranks will not be recorded and how to launch instead (``slurm`` passes the whole environment with srun's
  ``--export=ALL``).

This module never imports DeepSpeed: it reads the launcher's command line and hostfile as DeepSpeed's runner does
(deepspeed/launcher/runner.py).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from dtprof.machine import option_value

ENV_FILE = "deepspeed_env"                  # dtprof's environment file, in the node directory
DEFAULT_HOSTFILE = "/job/hostfile"          # DeepSpeed's DLTS_HOSTFILE
DEFAULT_PORT = "29500"
THROUGH_PDSH = "pdsh"
WHOLE_ENV = ("slurm",)                      # launchers that pass the whole environment to every rank
# dtprof's settings the ranks read (dtprof/launcher.py job_env); PYTHONPATH reaches them by DeepSpeed's prefixes
PASSED = ("DTPROF_NODE_DIR", "DTPROF_CONFIG", "TORCH_NCCL_ENABLE_TIMING")
# the runner's options that take no value (DeepSpeed 0.19's parse_args; -h/--help ends it)
FLAGS = {"--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check", "--force_multi", "--save_pid",
         "--bind_cores_to_rank", "-q", "--quiet"}


def is_runner(command: list[str]) -> bool:
    """DeepSpeed's launcher (its ``deepspeed`` or ``ds`` entry point)."""
    return bool(command) and Path(command[0]).name in ("deepspeed", "ds")


def _own_args(command: list[str]) -> list[str]:
    """The runner's own arguments: those before the training script (its first non-option argument that is not an
    option's value; DeepSpeed's boolean flags take none)."""
    args, i = command[1:], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("-"):
            return args[:i]
        i += 1 if a in FLAGS or "=" in a else 2
    return args


def option(command: list[str], *names: str) -> str | None:
    """The value of one of the runner's own options (``--x=v`` or ``--x v``)."""
    return option_value(_own_args(command), *names)


def join_id(command: list[str], env: dict) -> str | None:
    """For DeepSpeed's launcher started on each node (``--no_ssh --node_rank N``): its master's address and port (and
    SLURM's job id, where there is one), which every node of the job is given alike; else None."""
    if not is_runner(command) or "--no_ssh" not in _own_args(command):
        return None
    addr = option(command, "--master_addr") or ""
    return f"deepspeed:{env.get('SLURM_JOB_ID', '')}:{addr}:{option(command, '--master_port') or DEFAULT_PORT}"


def _hostfile_hosts(path: Path) -> list[str]:
    """The hosts of a DeepSpeed hostfile (``host slots=N`` lines; ``#`` comments and blank lines skipped), in order."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    hosts = []
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#") and line.split()[0] not in hosts:
            hosts.append(line.split()[0])
    return hosts


def _filtered(hosts: list[str], include: str, exclude: str) -> list[str]:
    """--include / --exclude (``host[:slots]@host...``): the hosts that keep a slot."""
    if include:
        named = [part.split(":")[0] for part in include.split("@") if part]
        return [h for h in hosts if h in named]
    whole = {part for part in exclude.split("@") if part and ":" not in part}
    return [h for h in hosts if h not in whole]


def remote_launch(command: list[str], cwd: Path) -> tuple[str, list[str]] | None:
    """(DeepSpeed's multi-node launcher, the hosts) when ``command`` is DeepSpeed's runner starting ranks on several
    hosts from this one (a hostfile of two or more hosts after --include/--exclude/--num_nodes, or --force_multi, and
    no --no_ssh); else None."""
    if not is_runner(command):
        return None
    own = _own_args(command)
    if "--no_ssh" in own:
        return None
    hostfile = Path(option(command, "--hostfile", "-H") or DEFAULT_HOSTFILE)
    hosts = _filtered(_hostfile_hosts(cwd / hostfile), option(command, "--include", "-i") or "",
                      option(command, "--exclude", "-e") or "")
    num_nodes = option(command, "--num_nodes")
    if num_nodes and num_nodes.lstrip("-").isdigit() and int(num_nodes) > 0:
        hosts = hosts[:int(num_nodes)]
    if len(hosts) < 2 and not (hosts and "--force_multi" in own):
        return None
    return (option(command, "--launcher") or THROUGH_PDSH).lower(), hosts


def user_env_lines(env: dict, cwd: Path) -> list[str]:
    """The lines of the user's own DeepSpeed environment files, as DeepSpeed's runner reads them: the file named by
    ``DS_ENV_FILE`` (default ``.deepspeed_env``) in the home directory, then in the current one (an absolute name is
    that one file)."""
    name = env.get("DS_ENV_FILE", ".deepspeed_env")
    lines, seen = [], set()
    for d in (os.path.expanduser("~"), "."):
        path = (cwd / os.path.join(d, name)).resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        lines += [line if line.endswith("\n") else line + "\n" for line in path.read_text().splitlines(True)]
    return lines


def _shell_quoted(value: str) -> str:
    """``value`` as DeepSpeed's pdsh runner must be given it: it puts a value with any character outside
    ``[\\w@%+=:,./-]`` in double quotes in the shell command it runs on each host (multinode_runner.py
    ``add_export``), where ``\\ " $ ` `` keep a meaning: escaped, the shell gives back ``value`` itself."""
    return re.sub(r'([\\"$`])', r"\\\1", value)


def write_env_file(node_dir: Path, base_env: dict, job_env: dict, cwd: Path) -> Path:
    """dtprof's environment file for DeepSpeed's pdsh launch: the user's lines, then dtprof's settings (the ones
    dtprof set: ``TORCH_NCCL_ENABLE_TIMING`` only when the user had not)."""
    ours = [f"{k}={_shell_quoted(job_env[k])}\n" for k in PASSED if k in job_env and job_env.get(k) != base_env.get(k)]
    path = Path(node_dir) / ENV_FILE
    path.write_text("".join(user_env_lines(base_env, cwd) + ours))
    return path


def start_line(launcher: str, hosts: list[str], run_dir: Path, env_file: Path | None) -> str:
    """What `dtprof run` says at start of a launch from this host onto several."""
    where = f"{len(hosts)} hosts ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})"
    if env_file is not None:
        return (f"dtprof: DeepSpeed starts the ranks on {where} through pdsh; they get dtprof's settings from "
                f"{env_file} (DS_ENV_FILE, after your .deepspeed_env lines), and every host must see {run_dir} at "
                f"that path")
    return (f"dtprof: DeepSpeed's --launcher {launcher} starts the ranks on {where} without dtprof's settings: the "
            f"ranks on other hosts will not be recorded; run `dtprof run --out SAME_DIR -- deepspeed --no_ssh "
            f"--node_rank N ...` on each node instead (or DeepSpeed's default pdsh launcher)")
