"""``python -m mpigpu``: which commands mpigpu has, and how to run them.

mpigpu's commands are modules (``python -m mpigpu.average``, ...), as the README shows them; this
lists them. ``python -m mpigpu <command> [args]`` runs one the same way, so a word typed after
``mpigpu`` either runs a command or says which words exist. Imports only the version: no MPI starts.
"""

from __future__ import annotations

import os
import runpy
import sys

from mpigpu._version import __version__

__all__ = ["COMMANDS", "main"]

# word -> (module, what it does), in the order a newcomer meets them
COMMANDS: dict[str, tuple[str, str]] = {
    "average": ("mpigpu.average", "average a gradient over the ranks, verify every element, time it"),
    "info": ("mpigpu.info", "what mpigpu found: MPI, CUDA-awareness, each rank's GPU, backends"),
    "bench": ("mpigpu.bench", "time allreduce and the other collectives, per size and backend"),
    "run": ("mpigpu.run", "run your script so that one rank's failure ends the whole job"),
    "bench.training": ("mpigpu.bench.training", "gradient averaging as training does it: fusion, training steps"),
    "bench.soak": ("mpigpu.bench.soak", "thousands of random allreduce calls, each verified"),
    "bench.synthetic": ("mpigpu.bench.synthetic", "Horovod's synthetic benchmark's measurement, on torch DDP"),
    "timeline": ("mpigpu.timeline", "merge the ranks' MPIGPU_TIMELINE files into one trace; plot a step"),
    "cleanup": ("mpigpu.cleanup", "remove the /dev/shm files of MPICH jobs that were killed (-9, OOM)"),
}


def _python() -> str:
    return os.path.basename(sys.executable) or "python"


def usage() -> str:
    """The help text: every command, as it is typed."""
    python = _python()
    width = max(len(module) for module, _ in COMMANDS.values()) + len(python) + 5
    lines = [
        f"usage: {python} -m mpigpu <command> [args]    (the same as {python} -m mpigpu.<command> [args])",
        f"       {python} -m mpigpu [--help | --version]",
        "",
        "mpigpu averages gradients across GPUs with MPI. Its commands, each with --help:",
    ]
    lines += [f"  {f'{python} -m {module}':<{width}} {what}" for module, what in COMMANDS.values()]
    lines += [
        "",
        "Under a launcher: mpiexec -n 4 python -m mpigpu.average --size 1M",
        "Console scripts too: mpigpu-info (= mpigpu.info), mpigpu-bench (= mpigpu.bench), "
        "mpigpu-timeline (= mpigpu.timeline).",
        "As a library: import mpigpu; mpigpu.allreduce(grad)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the help (no arguments, ``-h``, ``--help``), the version, or run ``<command>``; 2 for an
    unknown word, with the words that exist."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] == "--version":
        print(f"mpigpu {__version__}")
        return 0
    word = args[0].removeprefix("mpigpu.")
    if word not in COMMANDS:
        words = ", ".join(COMMANDS)
        sys.stderr.write(
            f"{_python()} -m mpigpu: error: unknown command {args[0]!r}: use one of {words} (or --help to list them)\n"
        )
        return 2
    module = COMMANDS[word][0]
    sys.argv = [f"{_python()} -m {module}", *args[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # a command ends with sys.exit(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
