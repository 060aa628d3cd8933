"""Output paths: what a command may write over.

Every `--out` (a stage's, train.py's `--run-dir`, `grpo.lora --merge`'s) is a new or empty folder,
or one that this same command wrote: its marker file (MARKER: the command and the files it wrote)
says so, and the folder holds nothing else. Anything else is refused with one line before anything
is read or written, so a typo in `--out` never replaces a run, a model or a user's files. An `--out`
that is a file (score.py's, advantage.py's) is new, or a stage file of that command's own schema,
and never one of the command's inputs.
"""

import contextlib
import json
import os
import shutil

from safetensors import SafetensorError, safe_open

from grpo import files
from grpo.cli import StageError

MARKER = ".grpo-output.json"            # {"command": "update.py", "files": [names]}; files null: the whole folder


def check_dir(path, command, flag="--out"):
    """Refuse `path` unless it is new, empty, or `command`'s own output holding only what it wrote."""
    files.recover_dir(path)                                  # a folder swap cut short by a kill
    if os.path.exists(path) and not os.path.isdir(path):
        raise StageError(f"{flag} {path}: is a file, expected a folder")
    entries = set(os.listdir(path)) if os.path.isdir(path) else set()
    if not entries:
        return
    mark = read_marker(path)
    owner = mark and mark.get("command")
    if owner != command:
        what = f"the output of {owner}" if owner else f"files this project did not write ({shown(entries)})"
        raise StageError(f"{flag} {path}: holds {what}; {command} writes only into a new or empty folder or "
                         f"one it wrote itself, so choose another {flag}")
    foreign = entries - {MARKER} - set(mark["files"] if mark.get("files") is not None else entries)
    if foreign:
        raise StageError(f"{flag} {path}: holds {shown(foreign)} beside what {command} wrote there; move them "
                         f"out or choose another {flag}")


def mark_dir(path, command, names=None):
    """Record that `command` wrote `names` into `path` (with those an earlier run of it wrote there);
    names None: the whole folder is the command's (a run folder)."""
    if names is not None:
        earlier = read_marker(path)
        if earlier and earlier.get("command") == command and earlier.get("files") is not None:
            names = set(names) | set(earlier["files"])
        names = sorted(names)
    files.write_json(os.path.join(path, MARKER), {"command": command, "files": names})


def remove_written(path, made):
    """Remove what a failed command wrote into the folder `path`: the folder itself where the command
    made it (`made`), else its contents (check_dir let the command in only where it was empty), so that
    a folder the user made stays."""
    if not os.path.isdir(path):
        return
    for entry in [path] if made else [os.path.join(path, name) for name in os.listdir(path)]:
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:                                   # in an error's path: never hide the error it cleans up after
            with contextlib.suppress(OSError):
                os.remove(entry)


def read_marker(path):
    """The marker of folder `path` ({"command", "files"}), or None."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) else None


def check_file(path, command, schema, inputs=(), flag="--out"):
    """Refuse the output file `path` unless it is new, or a stage file of `schema` that is not one of
    the command's `inputs` (paths)."""
    if any(p and os.path.abspath(p) == os.path.abspath(path) for p in inputs):
        raise StageError(f"{flag} {path}: is also the command's input; {command} would overwrite it")
    if os.path.isdir(path):
        raise StageError(f"{flag} {path}: is a folder, expected a file name")
    if not os.path.exists(path):
        return
    try:
        with safe_open(path, framework="pt") as f:
            found = (f.metadata() or {}).get("schema")
    except (OSError, SafetensorError):              # not a safetensors file at all: the same answer
        found = None
    if found != schema:
        what = f"a {found} file" if found else "not a stage file of this project"
        raise StageError(f"{flag} {path}: exists and is {what}; {command} replaces only a {schema} file it "
                         f"wrote, so choose another {flag}")


def shown(names, most=3):
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
