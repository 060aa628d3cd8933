"""Command lines: one-line errors for a user's mistakes, the argument parser, warnings, and the
process settings a stage runs with."""

import argparse
import ctypes
import ctypes.util
import os
import sys

import torch

from grpo.models import distributed


class StageError(Exception):
    """A mistake in the user's input: printed as one line, no traceback, exit code 2."""


def run_cli(main):
    """Run a stage's `main()` as a command: a StageError becomes `prog: error: message`."""
    prog = os.path.basename(sys.argv[0])
    keep_freed_memory()
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)   # a run's log file shows each line as it happens
    try:
        main()
    except (StageError, OSError) as e:    # OSError: a read-only folder, a full disk, a file gone meanwhile
        if isinstance(e, OSError):
            e = f"{e.filename}: {e.strerror or e}" if e.filename else (e.strerror or str(e))
        rank, world = distributed.rank_and_world()
        where = "" if world == 1 else f" (rank {rank} of {world})"
        print(f"{prog}: error{where}: {e}", file=sys.stderr)
        sys.exit(2)      # under torchrun, the launcher then stops the other ranks
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every file already written is complete (none is left half-written)",
              file=sys.stderr)
        sys.exit(130)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()      # leave together: gloo can abort a rank whose peer is still busy
        torch.distributed.destroy_process_group()


def keep_freed_memory():
    """Have glibc's malloc keep the memory this process frees for its next allocations (no mmap of
    large blocks, no trim of the heap below 2 GB free) instead of returning it to the kernel. Every
    iteration allocates and frees the same few GB (activations, logits, gradients); returned, each
    page is faulted in and zeroed again on its next use (what that cost the default job is in
    docs/performance.md). The same reuse torch's
    caching allocator gives a GPU. A thread other than the main one still maps blocks larger than
    its 64 MB heaps (the checkpoint saver's). Returns False, changing nothing, off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except (OSError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):                # macOS, musl: their own policy
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4                                  # glibc's malloc.h
    done = [libc.mallopt(M_MMAP_MAX, 0), libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)]
    return all(done)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (`prog: error: ...`, exit 2) and help that keeps line breaks."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawTextHelpFormatter, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_runtime_flags(parser):
    """--device and --trust-remote-code, which every stage that loads a model takes."""
    parser.add_argument("--device", default="auto", type=device_name,
                        help="cuda, cuda:N, cpu or auto (default: cuda when available)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let model folders run their own Python code (default: never)")


def device_name(name):
    """--device's value, checked: auto, or a device torch knows that this machine has."""
    if name == "auto":
        return name
    try:
        device = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name}: there is no CUDA device here; use cpu or auto")
    return name


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
