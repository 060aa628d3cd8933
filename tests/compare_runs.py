"""Two run folders compared file by file, for a change that must change no number (a refactoring):

    .venv/bin/python tests/compare_runs.py RUN_A RUN_B [--ignore KEY ...]

Every tensor of every safetensors file equal to the bit (dtype, shape and bytes); every JSON and
JSON-lines file equal once timings (perf/..., seconds) are left out and each folder's own path is
read as RUN; any other file byte for byte. A safetensors file's metadata is compared key by key,
and settings named by --ignore (a flag renamed, say) are left out of it, of config.json and of the
commands. TensorBoard's files and the run's lock are skipped. Prints one line per difference and
exits 1 if there is any.
"""

import argparse
import json
import os
import sys

import torch
from safetensors import safe_open

SKIPPED = ("tb", ".grpo-lock")


def comparable(value, run_dirs, ignore):
    """A JSON value without timings or `ignore`d keys, each run folder's path read as RUN."""
    if isinstance(value, dict):
        return {k: comparable(v, run_dirs, ignore) for k, v in value.items()
                if not (k.startswith("perf/") or k == "seconds" or k in ignore)}
    if isinstance(value, list):
        return [comparable(v, run_dirs, ignore) for v in value]
    if isinstance(value, str):
        for run_dir in run_dirs:
            value = value.replace(run_dir, "RUN")
    return value


def differing_keys(a, b):
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) if isinstance(a, dict) and isinstance(b, dict) else []


def tensor_differences(path_a, path_b, rel, run_dirs, ignore):
    out = []
    with safe_open(path_a, "pt") as fa, safe_open(path_b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return [f"{rel}: keys {sorted(set(fa.keys()) ^ set(fb.keys()))} in one only"]
        for key in sorted(fa.keys()):
            a, b = fa.get_tensor(key), fb.get_tensor(key)
            same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(
                a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
            if not same:
                out.append(f"{rel}: tensor {key} differs")
        meta_a, meta_b = fa.metadata() or {}, fb.metadata() or {}
    for key in sorted(set(meta_a) | set(meta_b)):
        a, b = (comparable(json_or_text(m.get(key)), run_dirs, ignore) for m in (meta_a, meta_b))
        if a != b:
            out.append(f"{rel}: metadata {key} differs {differing_keys(a, b) or ''}".rstrip())
    return out


def without_flags(script, run_dirs, ignore):
    """A replay.sh's words, each run folder's path read as RUN, without the `ignore`d flags and their values."""
    words, kept = comparable(script, run_dirs, ()).split(), []
    flags = {"--" + k.replace("_", "-") for k in ignore}
    skip_value = False
    for word in words:
        if word in flags:
            skip_value = True
        elif skip_value and not word.startswith("--"):
            skip_value = False
        else:
            skip_value = False
            kept.append(word)
    return kept


def json_or_text(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def read_json_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def differences(run_a, run_b, ignore=()):
    """One line per file or value that differs between the two run folders."""
    run_dirs, ignore, out = (os.path.abspath(run_a), os.path.abspath(run_b)), set(ignore), []
    names = set()
    for run in (run_a, run_b):
        for root, dirs, files in os.walk(run):
            dirs[:] = [d for d in dirs if d not in SKIPPED]
            names |= {os.path.relpath(os.path.join(root, f), run) for f in files if f not in SKIPPED}
    for rel in sorted(names):
        a, b = os.path.join(run_a, rel), os.path.join(run_b, rel)
        if not (os.path.isfile(a) and os.path.isfile(b)):
            out.append(f"{rel}: in one folder only")
        elif rel.endswith(".safetensors"):
            out += tensor_differences(a, b, rel, run_dirs, ignore)
        elif rel.endswith((".json", ".jsonl")):
            read = read_json_lines if rel.endswith(".jsonl") else lambda p: json.load(open(p, encoding="utf-8"))
            va, vb = (comparable(read(p), run_dirs, ignore) for p in (a, b))
            if va != vb:
                out.append(f"{rel}: differs {differing_keys(va, vb) or ''}".rstrip())
        elif rel.endswith(".sh"):
            if without_flags(open(a).read(), run_dirs, ignore) != without_flags(open(b).read(), run_dirs, ignore):
                out.append(f"{rel}: commands differ")
        elif open(a, "rb").read() != open(b, "rb").read():
            out.append(f"{rel}: bytes differ")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--ignore", nargs="*", default=[], help="settings left out of metadata, config.json and commands")
    args = p.parse_args(argv)
    found = differences(args.run_a, args.run_b, args.ignore)
    print("\n".join(found) if found else f"{args.run_a} and {args.run_b}: the same numbers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
