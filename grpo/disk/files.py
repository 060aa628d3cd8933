"""Files between stages: schemas, checked loading, atomic writes, JSON and JSON lines.

Every file is written to a temporary name beside its path, fsynced and renamed, so a file that
exists is complete; folders are swapped with two renames that the next writer undoes if a kill
fell between them. The scratch names are the project's own and no user would choose them (hidden,
`.NAME.grpo-tmp.PID`, `.NAME.grpo-old.PID`, with a journal `.NAME.grpo-swap.json` naming the
folder a swap set aside), so no sibling a user made (`X.old`, `X.bak`, `X.tmp`) is ever deleted,
renamed or read as the project's. docs/formats.md describes every key.
"""

import contextlib
import json
import os
import re
import shutil
from contextlib import contextmanager

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from grpo.cli import StageError

# Each schema maps key -> (kind, allowed shapes, required). kind is "int" (int64), "float"
# (float32) or "bool" (bool, or integers that are all 0/1). Shape letters are bound once per
# file, so every [N, ...] key must agree on N.
ROLLOUTS = ("rollouts/1", {
    "prompt_ids": ("int", [("N", "P")], True),
    "prompt_mask": ("bool", [("N", "P")], True),
    "completion_ids": ("int", [("N", "T")], True),
    "completion_mask": ("bool", [("N", "T")], True),
    "group_ids": ("int", [("N",)], True),
    "old_logprobs": ("float", [("N", "T")], True),
    "ref_logprobs": ("float", [("N", "T")], False),
    "truncated": ("bool", [("N",)], True),
    "values": ("float", [("N", "T")], False),
    "sampler_logprobs": ("float", [("N", "T")], False),
    "loss_mask": ("bool", [("N", "T")], False),
})
REWARDS = ("rewards/1", {
    "rewards": ("float", [("N",)], True),
    "group_ids": ("int", [("N",)], True),
    "lengths": ("int", [("N",)], False),
    "skipped": ("bool", [("N",)], False),
})
ADVANTAGES = ("advantages/1", {
    "advantages": ("float", [("N",), ("N", "T")], True),
    "group_ids": ("int", [("N",)], True),
    "returns": ("float", [("N", "T")], False),
})

_DTYPES = {"int": torch.int64, "float": torch.float32, "bool": torch.bool}


def reward_components(path):
    """Each reward function's values [N] in a rewards file (score.py writes them as "reward/NAME"),
    by name; a file without them gives {}."""
    with safe_open(path, framework="pt") as f:
        return {k.removeprefix("reward/"): f.get_tensor(k) for k in f.keys() if k.startswith("reward/")}


def save_tensors(path, tensors, schema, args, **metadata):
    """Write `tensors` with metadata {"schema", "args", and any other entries, as JSON} through
    safetensors' own writer; the file appears complete or not at all."""
    metadata = {"schema": schema, **{k: json.dumps(v, sort_keys=True, default=str)
                                     for k, v in {"args": args, **metadata}.items()}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, tmp, metadata)


def load_tensors(path, spec):
    """Read a stage file and check it against `spec`; return (tensors, args, dims).

    Only the schema's keys come back, masks as bool. A file without a "schema" entry (for example
    one written by hand with safetensors' save_file) is accepted; one with a different schema is not.
    """
    schema, keys = spec
    if not os.path.isfile(path):
        raise StageError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys() if k in keys}
    except Exception as e:  # safetensors raises several types for a damaged file; all mean the same
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StageError(f"{path}: not a readable safetensors file ({reason})") from None
    found = metadata.get("schema")
    if found is not None and found != schema:
        raise StageError(f"{path}: expected a {schema} file, found schema {found!r}")
    try:
        args = json.loads(metadata.get("args", "{}"))
    except json.JSONDecodeError:
        raise StageError(f"{path}: the 'args' metadata is not JSON") from None

    dims = {}
    for key, (kind, shapes, required) in keys.items():
        if key not in tensors:
            if required:
                raise StageError(f"{path}: missing key '{key}' ({kind}, shape {_fmt(shapes)})")
            continue
        t = tensors[key]
        if kind == "bool" and t.dtype != torch.bool and not t.is_floating_point() and not t.is_complex():
            if ((t != 0) & (t != 1)).any():
                raise StageError(f"{path}: '{key}' must hold only 0/1 (or be bool)")
            t = tensors[key] = t.bool()
        if t.dtype != _DTYPES[kind]:
            raise StageError(f"{path}: '{key}' has dtype {str(t.dtype).removeprefix('torch.')}, expected "
                             f"{str(_DTYPES[kind]).removeprefix('torch.')}")
        if not any(_bind(shape, t.shape, dims) for shape in shapes):
            known = ", ".join(f"{k}={v}" for k, v in dims.items()) or "no sizes known yet"
            raise StageError(f"{path}: '{key}' has shape {list(t.shape)}, "
                             f"expected {_fmt(shapes)} with {known}")
        if dims.get("N") == 0:
            raise StageError(f"{path}: '{key}' has no rows (N = 0)")
        if kind == "float" and not torch.isfinite(t).all():
            bad = torch.nonzero(~torch.isfinite(t).reshape(t.shape[0], -1).all(-1)).flatten()
            raise StageError(f"{path}: '{key}' is NaN or infinite in rows {format_rows(bad)}")
    return tensors, args, dims


def group_shape(group_ids, path):
    """(B, G) of a file's group_ids [N], checked: each group's rows contiguous, all groups of one size."""
    n = group_ids.numel()
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = group_ids[1:] != group_ids[:-1]
    run_ids = group_ids[starts]                                   # [B] one id per contiguous run
    if run_ids.unique().numel() != run_ids.numel():
        raise StageError(f"{path}: 'group_ids' are not contiguous (a group's rows must be adjacent)")
    sizes = torch.diff(torch.nonzero(starts).flatten(), append=torch.tensor([n]))
    if (sizes != sizes[0]).any():
        raise StageError(f"{path}: groups have unequal sizes {sorted(set(sizes.tolist()))}; "
                         f"every group needs G rows")
    return run_ids.numel(), int(sizes[0])


def _bind(shape, actual, dims):
    if len(shape) != len(actual):
        return False
    trial = dict(dims)
    for name, size in zip(shape, actual):
        if trial.setdefault(name, size) != size:
            return False
    dims.update(trial)
    return True


def _fmt(shapes):
    return " or ".join("[" + ", ".join(s) + "]" for s in shapes)


def format_rows(idx, limit=10):
    idx = [int(i) for i in idx]
    return ", ".join(map(str, idx[:limit])) + (f" (and {len(idx) - limit} more)" if len(idx) > limit else "")


# ----------------------------------------------------------------------------------------
# Atomic writes

def scratch_name(path, kind):
    """The project's own name beside `path` for a file or folder of `kind` ("tmp" being written, "old"
    set aside by a swap): hidden, marked as the project's, unique to this process."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.grpo-{kind}.{os.getpid()}")


@contextmanager
def atomic_path(path):
    """Yield a temporary name beside `path`; rename it to `path` only if the block succeeds.

    A full disk or a read-only folder is a one-line error, and `path` keeps its previous content.
    """
    tmp = scratch_name(path, "tmp")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except (OSError, SafetensorError) as e:                    # read-only, full disk (safetensors' own)
        raise StageError(f"{path}: cannot write ({getattr(e, 'strerror', None) or e}); "
                         f"the previous file, if any, is unchanged") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def make_dir(path):
    """Create folder `path` (and its parents) if need be; a read-only or full place is a one-line error."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise StageError(f"{path}: cannot create the folder ({e.strerror or e})") from None


def fsync_dir(path):
    """Make a rename in `path` durable (a crash after it cannot bring the old name back)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_journal(path):
    """The journal of a folder swap into `path`, beside it."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.grpo-swap.json")


def replace_dir(src, dst):
    """Move folder `src` to `dst`. An existing `dst` is set aside under scratch_name(dst, "old"), named in
    a journal (swap_journal) before the first rename and removed after the old folder is; recover_dir()
    reads the journal to put it back if a kill lands between the two renames. `dst` is a real folder
    (a symlink is resolved by the caller: grpo/disk/outputs.py)."""
    dst = os.path.abspath(dst)
    if os.path.islink(dst):
        raise StageError(f"{dst}: is a symlink; the project writes through it to its folder, never replaces it")
    recover_dir(dst)                                             # an earlier swap cut short
    journal, old = swap_journal(dst), scratch_name(dst, "old")
    swapping = os.path.exists(dst)
    if swapping:
        write_json(journal, {"grpo_swap": 1, "old": os.path.basename(old)})
        os.rename(dst, old)
    os.rename(src, dst)
    fsync_dir(os.path.dirname(dst))
    if swapping:
        shutil.rmtree(old, ignore_errors=True)
        os.remove(journal)


def cut_swap(path):
    """The folder a replace_dir() into `path` set aside, if its journal is there (else None): the
    project's own scratch, checked to carry its name."""
    journal = swap_journal(path)
    try:
        with open(journal, encoding="utf-8") as f:
            swap = json.load(f)
    except (OSError, ValueError):
        return None
    name = os.path.basename(os.path.abspath(path))
    old = swap.get("old") if isinstance(swap, dict) and swap.get("grpo_swap") == 1 else None
    if not isinstance(old, str) or not re.fullmatch(re.escape(f".{name}.grpo-old.") + r"\d+", old):
        return None
    return os.path.join(os.path.dirname(journal), old)


def recover_dir(path):
    """Finish a replace_dir() into `path` that a kill cut short, from its journal alone: put the old
    folder back where `path` is missing, else remove it (the swap was done). No journal, nothing done."""
    old = cut_swap(path)
    if old is None:
        return
    if not os.path.lexists(path) and os.path.isdir(old):
        try:
            os.rename(old, path)
        except OSError:
            if not os.path.isdir(path):                          # another rank of torchrun got there first
                raise
    else:
        shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.remove(swap_journal(path))


def check_no_cut_swap(path):
    """An input folder is never renamed: where a kill cut a swap into `path` short, say so in one line."""
    old = cut_swap(path) if not os.path.lexists(path) else None
    if old is not None and os.path.isdir(old):
        raise StageError(f"{path}: missing; a checkpoint swap into it was cut short and left the folder in "
                         f"{old}; the command that writes {os.path.basename(path)} puts it back when run again, "
                         f"or rename it back yourself")


# ----------------------------------------------------------------------------------------
# JSON and JSON lines

def write_jsonl(path, records):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_json(path, obj):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")


def read_json(path):
    """A JSON file this project wrote (config, state, metrics); a damaged one is a one-line error."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise StageError(f"{path}: not UTF-8 text (byte {e.start}); JSON files are read as UTF-8") from None
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"{path}: not a readable JSON file ({e})") from None


def read_jsonl(path, with_lines=False):
    """Records of a JSON-lines file; blank lines are skipped, anything else must be a JSON object.
    With `with_lines`, also the line number (from 1) of each record."""
    if not os.path.isfile(path):
        raise StageError(f"{path}: no such file")
    records, lines = [], []
    for lineno, line in enumerate(utf8_lines(path), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise StageError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            kind = type(record).__name__
            raise StageError(f"{path}, line {lineno}: expected a JSON object, got {kind}")
        records.append(record)
        lines.append(lineno)
    if not records:
        raise StageError(f"{path}: the file holds no records")
    return (records, lines) if with_lines else records


def utf8_lines(path):
    """The lines of a text file read as UTF-8; another encoding is a one-line error naming the line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise StageError(f"{path}, line {lineno}: not UTF-8 text (byte {e.start} of the line); "
                                 f"JSON lines are read as UTF-8") from None


def select_records(path, start, num_prompts):
    """The B records from --start (counted from 0, in file order), and the line of each."""
    records, lines = read_jsonl(path, with_lines=True)
    if not 0 <= start < len(records):
        raise StageError(f"{path}: --start {start} is outside its {len(records)} records")
    end = len(records) if num_prompts is None else start + num_prompts
    if end > len(records):
        raise StageError(f"{path}: --num-prompts {num_prompts} from --start {start} needs {end} records, "
                         f"the file has {len(records)}")
    return records[start:end], lines[start:end]
