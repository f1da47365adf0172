"""The `dtprof` command line. Each verb lives in its own module and is imported only when used, so
`dtprof report|compare|triage` start fast and never import torch.

Exit codes shared by all verbs: 0 success, 2 bad usage or unreadable input (one-line message on stderr).
Verbs document their own further codes in their --help.
"""
from __future__ import annotations

import importlib

import click

from dtprof.allocator import keep_freed_memory


class InputError(click.ClickException):
    """Bad usage or unreadable input: one line on stderr naming the file and the problem, exit code 2. Every verb
    raises this one type for it."""

    exit_code = 2


# verb -> "module:click-command". Keep sorted by how a user meets them.
COMMANDS = {
    "run": "dtprof.launcher:run_command",
    "summary": "dtprof.summary:summary_command",
    "summarize": "dtprof.summarize:summarize_command",
    "report": "dtprof.report:report_command",
    "compare": "dtprof.compare:compare_command",
    "triage": "dtprof.triage:triage_command",
    "import": "dtprof.interop:import_command",
    "export": "dtprof.interop:export_command",
    "calibrate": "dtprof.calibrate:calibrate_command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dtprof")
def main():
    """Profile distributed PyTorch training and explain its performance.

    \b
    dtprof run -- torchrun --nproc_per_node=8 train.py   record a job (no change to train.py)
    dtprof summary RUN_DIR                               per-rank summary, --json for summary.json
    dtprof report RUN_DIR                                offline HTML report
    dtprof compare BASE --head HEAD                      CI regression gate (exit 1 on regression)
    dtprof triage RUN_DIR                                which rank hung or crashed, and why
    """
    # dtprof's own process (the launcher's children, the training job, exec afresh and are not affected)
    keep_freed_memory()


if __name__ == "__main__":
    main()
