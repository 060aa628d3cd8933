"""Command lines: one-line errors for a user's mistakes, the argument parser, warnings."""

import argparse
import os
import sys

import torch

from grpo import distributed


class StageError(Exception):
    """A mistake in the user's input: printed as one line, no traceback, exit code 2."""


def run_cli(main):
    """Run a stage's `main()` as a command: a StageError becomes `prog: error: message`."""
    prog = os.path.basename(sys.argv[0])
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)   # a run's log file shows each line as it happens
    try:
        main()
    except StageError as e:
        rank, world = distributed.rank_and_world()
        where = "" if world == 1 else f" (rank {rank} of {world})"
        print(f"{prog}: error{where}: {e}", file=sys.stderr)
        sys.exit(2)      # under torchrun, the launcher then stops the other ranks
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()      # leave together: gloo can abort a rank whose peer is still busy
        torch.distributed.destroy_process_group()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (`prog: error: ...`, exit 2) and help that keeps line breaks."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawTextHelpFormatter, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_runtime_flags(parser):
    """--device and --trust-remote-code, which every stage that loads a model takes."""
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda when available)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let model folders run their own Python code (default: never)")


def warn(message):
    """A warning on stderr, printed once (by rank 0 under torchrun), above any progress bar."""
    if distributed.is_main():
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)


_WARNED = set()


def warn_once(message):
    """warn(), but a message this process has printed already is not printed again."""
    if message not in _WARNED:
        _WARNED.add(message)
        warn(message)
