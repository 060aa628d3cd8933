"""The bad-input corpus: wrong invocations and hostile folders, each run as a user types it (`cli()`),
each asserting its exit code, a single-line message naming the problem, and that every byte of every
folder outside the command's own new output is as it was (the shared workspace, the models, the
case's own folder). A few cases are legitimate and must succeed without touching a user's name
(code 0). docs/bad-input-and-faults.md lists the classes and their counts; tests/test_bad_inputs.py
holds the damaged stage files, case by case."""

import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
import torch
from conftest import PROMPTS, ROOT, cli, write_jsonl
from safetensors.torch import load_file, save_file

from grpo.disk import files, outputs
from grpo.models import builders

TINY_RUN = ["--config", "tiny", "--iterations", 2, "--eval-every", 0, "--num-prompts", 2, "--group-size", 4,
            "--save-every", 1]
USER_REWARDS = """
def huge(prompts, completions, **k):
    return [10 ** 400] + [1.0] * (len(completions) - 1)
def as_dict(prompts, completions, **k):
    return {i: 1.0 for i in range(len(completions))}
def exits(prompts, completions, **k):
    raise SystemExit(0)
def text(prompts, completions, **k):
    return "1" * len(completions)
def words(prompts, completions, **k):
    return ["one"] * len(completions)
"""


@dataclass
class Workspace:
    root: str
    policy: str
    ref: str
    prompts: str
    it: str                     # sample.py's folder: rollouts.safetensors, samples.jsonl
    rewards: str
    advantages: str
    run: str                    # a finished tiny train.py run, a kept checkpoint at iteration 1
    other: dict = field(default_factory=dict)

    @property
    def rollouts(self):
        return os.path.join(self.it, "rollouts.safetensors")

    @property
    def samples(self):
        return os.path.join(self.it, "samples.jsonl")


@pytest.fixture(scope="module")
def w(models, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corpus"))
    j = lambda *p: os.path.join(root, *p)                                    # noqa: E731
    prompts = write_jsonl(j("prompts.jsonl"), PROMPTS)
    ws = Workspace(root, models["policy"], models["ref"], prompts, j("it"), j("rewards.safetensors"),
                   j("advantages.safetensors"), j("run"))
    for script, *argv in (
            ["sample.py", "--model", ws.policy, "--prompts", prompts, "--out", ws.it, "--group-size", 4,
             "--max-new-tokens", 8, "--temperature", 0.7, "--seed", 3, "--ref-model", ws.ref],
            ["score.py", "--rollouts", ws.rollouts, "--samples", ws.samples, "--reward",
             "tests/length_reward.py:char_count", "--out", ws.rewards],
            ["advantage.py", "--rewards", ws.rewards, "--out", ws.advantages],
            ["train.py", *TINY_RUN, "--run-dir", ws.run]):
        r = cli(script, *argv)
        assert r.code == 0, (script, r.err)
    with open(j("user_rewards.py"), "w") as f:
        f.write(USER_REWARDS)
    # A policy whose weights hold NaN, and one whose tokenizer has one token more.
    shutil.copytree(ws.policy, j("nan_policy"))
    weights = load_file(j("nan_policy", "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, j("nan_policy", "model.safetensors"), {"format": "pt"})
    tokenizer = builders.char_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    builders.make_tiny_llama(j("other_tok"), seed=0, tokenizer=tokenizer)
    other = j("other_it")
    for script, *argv in (
            ["sample.py", "--model", j("other_tok"), "--prompts", prompts, "--out", other, "--group-size", 2,
             "--max-new-tokens", 4, "--num-prompts", 2],
            ["score.py", "--rollouts", f"{other}/rollouts.safetensors", "--samples", f"{other}/samples.jsonl",
             "--reward", "tests/length_reward.py:char_count", "--out", f"{other}/rewards.safetensors"],
            ["advantage.py", "--rewards", f"{other}/rewards.safetensors", "--out", f"{other}/advantages.safetensors"]):
        r = cli(script, *argv)
        assert r.code == 0, (script, r.err)
    ws.other = {"nan_policy": j("nan_policy"), "other_it": other, "user_rewards": j("user_rewards.py")}
    return ws


def snapshot(roots, skip=()):
    """Every file, folder and symlink under `roots` with its bytes (a hash), less the paths of `skip`.
    A run folder's lock file counts by its presence: it holds the PID of the last train.py that held it."""
    state = {}
    for root in roots:
        if os.path.lexists(root) and not os.path.isdir(root):
            state[root] = "file"
            continue
        for d, dirs, names in os.walk(root):
            for n in dirs + names:
                p = os.path.join(d, n)
                if any(p == s or p.startswith(s + os.sep) for s in skip):
                    continue
                if os.path.islink(p):
                    state[p] = "link " + os.readlink(p)
                elif os.path.isdir(p):
                    state[p] = "folder"
                elif n == outputs.LOCK:
                    state[p] = "lock"
                else:
                    state[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return state


# ----------------------------------------------------------------------------------------
# The command lines of the cases: a good one per stage, with a case's changes

def sample(w, out, *more):
    return ["sample.py", "--model", w.policy, "--prompts", w.prompts, "--out", out, "--group-size", 2,
            "--num-prompts", 2, "--max-new-tokens", 4, *more]


def score(w, out, *more):
    return ["score.py", "--rollouts", w.rollouts, "--samples", w.samples, "--reward", "exact_answer", "--out", out,
            *more]


def advantage(w, out, *more):
    return ["advantage.py", "--rewards", w.rewards, "--out", out, *more]


def update(w, out, *more):
    return ["update.py", "--model", w.policy, "--rollouts", w.rollouts, "--advantages", w.advantages, "--out", out,
            *more]


def train(w, out, *more):
    return ["train.py", *TINY_RUN, "--run-dir", out, *more]


def replaced(argv, flag, value):
    """argv with `flag`'s value replaced."""
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


@dataclass
class Case:
    cls: str                    # the class, as docs/bad-input-and-faults.md counts them
    argv: object                # (w, tmp: the case's folder) -> [script, flags...]; the output is tmp/out
    fragments: tuple = ()       # in the one-line message
    code: int = 2               # 0: a legitimate command that must leave every other name alone
    setup: object = None        # (w, tmp) -> None: a hostile folder, made before the snapshot


def user_folder(path, *names):
    os.makedirs(path, exist_ok=True)
    for name in names or ("notes.txt",):
        with open(os.path.join(path, name), "w") as f:
            f.write("mine")


def run(cmd):
    r = cli(*cmd)
    assert r.code == 0, r.err


def copy_run(w, tmp, *remove, damage=None):
    """tmp/R, a copy of the finished run, less `remove` (paths in it), with `damage` (a path: bytes)."""
    shutil.copytree(w.run, os.path.join(tmp, "R"), symlinks=True)
    for path in remove:
        path = os.path.join(tmp, "R", path)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    for path, data in (damage or {}).items():
        with open(os.path.join(tmp, "R", path), "wb") as f:
            f.write(data)


def cut_swap(path):
    """What a kill between replace_dir's two renames leaves: `path` set aside, named by its journal."""
    old = files.scratch_name(path, "old")
    files.write_json(files.swap_journal(path), {"grpo_swap": 1, "old": os.path.basename(old)})
    os.rename(path, old)


def held_lock(run_dir):
    """The run folder held as a running train.py holds it (this process, another open file)."""
    lock = outputs.run_lock(run_dir, resume=True)
    lock.__enter__()
    HELD.append(lock)


HELD = []                       # lock files held by cases, closed after each
T = lambda tmp, *p: os.path.join(tmp, *p)                                        # noqa: E731
NOT_UTF8 = b'{"prompt": "caf\xe9 2+3?", "answer": "5"}\n'


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def edited_samples(w, tmp):
    rows = [json.loads(line) for line in open(w.samples)]
    rows[1]["answer"] = "999"
    write_jsonl(T(tmp, "samples.jsonl"), rows)


def damaged_rollouts(w, tmp, change):
    tensors = load_file(w.rollouts)
    change(tensors)
    save_file(tensors, T(tmp, "rollouts.safetensors"), {"args": json.dumps({"temperature": 0.7})})
    advantages = load_file(w.advantages)
    save_file(advantages, T(tmp, "advantages.safetensors"))


def ids_beyond(t):
    t["completion_ids"] = t["completion_ids"].clone()
    t["completion_ids"][2, 0] = 10_000


def negative_id(t):
    t["prompt_ids"] = t["prompt_ids"].clone()
    t["prompt_ids"][5, -1] = -3


CASES = {
    # --- scratch names: a user's X.old, X.bak, X.tmp are never the project's --------------------------
    "update twice into out beside a user's out.old": Case(
        "scratch names", lambda w, t: update(w, T(t, "out")), code=0,
        setup=lambda w, t: (user_folder(T(t, "out.old")), run(update(w, T(t, "out"))))),
    "sample into s1 beside the backup s1.old": Case(
        "scratch names", lambda w, t: sample(w, T(t, "out")), code=0,
        setup=lambda w, t: (run(sample(w, T(t, "out"))), os.rename(T(t, "out"), T(t, "out.old")))),
    "--model mdl where only the user's mdl.old exists": Case(
        "scratch names", lambda w, t: replaced(sample(w, T(t, "out")), "--model", T(t, "mdl")),
        ("mdl", "no such model folder"), setup=lambda w, t: shutil.copytree(w.policy, T(t, "mdl.old"))),
    "update into out beside out.bak, out.tmp and .out.old": Case(
        "scratch names", lambda w, t: update(w, T(t, "out")), code=0,
        setup=lambda w, t: [user_folder(T(t, name)) for name in ("out.bak", "out.tmp", ".out.old")]),
    "score into r beside a user's r.old and r.tmp": Case(
        "scratch names", lambda w, t: score(w, T(t, "out")), code=0,
        setup=lambda w, t: [write(T(t, name), b"mine") for name in ("out.old", "out.tmp", "out.tmp.1")]),
    "--model whose swap a kill cut short": Case(
        "scratch names", lambda w, t: replaced(sample(w, T(t, "out")), "--model", T(t, "m")), ("m", "cut short"),
        setup=lambda w, t: (run(update(w, T(t, "m"))), cut_swap(T(t, "m")))),
    "a journal naming a user's folder": Case(
        "scratch names", lambda w, t: update(w, T(t, "out")), code=0,
        setup=lambda w, t: (user_folder(T(t, "keep")), files.write_json(files.swap_journal(T(t, "out")),
                                                                        {"grpo_swap": 1, "old": "keep"}))),
    # --- a run's folder is the run's: no stage writes in it ------------------------------------------
    "update --out RUN/policy": Case("run folder", lambda w, t: update(w, f"{w.run}/policy"),
                                    ("--out", "lies in the train.py run")),
    "update --out RUN/checkpoints/iter_0001": Case(
        "run folder", lambda w, t: update(w, f"{w.run}/checkpoints/iter_0001"), ("lies in the train.py run",)),
    "update --out RUN": Case("run folder", lambda w, t: update(w, w.run), ("lies in the train.py run",)),
    "update --out a new folder in RUN": Case("run folder", lambda w, t: update(w, f"{w.run}/mine"),
                                             ("lies in the train.py run",)),
    "sample --out RUN/iter_0000": Case("run folder", lambda w, t: sample(w, f"{w.run}/iter_0000"),
                                       ("lies in the train.py run",)),
    "sample --out a new folder in RUN": Case("run folder", lambda w, t: sample(w, f"{w.run}/iter_0009"),
                                             ("lies in the train.py run",)),
    "score another iteration's rewards in RUN": Case(
        "run folder", lambda w, t: ["score.py", "--rollouts", f"{w.run}/iter_0001/rollouts.safetensors", "--samples",
                                    f"{w.run}/iter_0001/samples.jsonl", "--reward", "char_class", "--out",
                                    f"{w.run}/iter_0000/rewards.safetensors"], ("lies in the train.py run",)),
    "advantage into another iteration of RUN": Case(
        "run folder", lambda w, t: ["advantage.py", "--rewards", f"{w.run}/iter_0001/rewards.safetensors", "--out",
                                    f"{w.run}/iter_0000/advantages.safetensors"], ("lies in the train.py run",)),
    "score into a new file in RUN": Case("run folder", lambda w, t: score(w, f"{w.run}/extra.safetensors"),
                                         ("lies in the train.py run",)),
    "--critic-out in RUN": Case(
        "run folder", lambda w, t: update(w, T(t, "out"), "--critic", w.policy, "--critic-out", f"{w.run}/critic"),
        ("--critic-out", "lies in the train.py run")),
    "lora --merge --out in RUN": Case("run folder", lambda w, t: ["grpo/lora.py", "--merge", w.policy, "--out",
                                                                  f"{w.run}/merged"], ("lies in the train.py run",)),
    "train.py --run-dir inside RUN": Case("run folder", lambda w, t: train(w, f"{w.run}/sub"),
                                          ("--run-dir", "lies in the train.py run")),
    "update --out a symlink into RUN": Case(
        "run folder", lambda w, t: update(w, T(t, "link")), ("lies in the train.py run",),
        setup=lambda w, t: os.symlink(f"{w.run}/policy", T(t, "link"))),
    "--samples of RUN given, --out RUN's": Case(
        "run folder", lambda w, t: ["score.py", "--rollouts", f"{w.run}/iter_0000/rollouts.safetensors", "--samples",
                                    f"{w.run}/iter_0000/samples.jsonl", "--reward", "char_class", "--out",
                                    f"{w.run}/iter_0000/rewards.safetensors"], ("lies in the train.py run",)),
    # --- one writer: the lock ----------------------------------------------------------------------------
    "train.py --resume on a run another train.py holds": Case(
        "one writer", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume", "--iterations", 3],
        ("--run-dir", "another train.py (PID", "is writing this run"),
        setup=lambda w, t: (copy_run(w, t), held_lock(T(t, "R")))),
    "a new run in a folder another train.py holds": Case(
        "one writer", lambda w, t: train(w, T(t, "R")), ("another train.py (PID",),
        setup=lambda w, t: (os.makedirs(T(t, "R")), held_lock(T(t, "R")))),
    # --- resume never deletes what it cannot rebuild ---------------------------------------------------
    "resume without train_state.json or a kept checkpoint": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume"],
        ("train_state.json is missing or damaged", "nothing was changed"),
        setup=lambda w, t: copy_run(w, t, "policy/train_state.json", "checkpoints")),
    "resume with a damaged train_state.json and no kept checkpoint": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume"], ("no save to resume from",),
        setup=lambda w, t: copy_run(w, t, "checkpoints", damage={"policy/train_state.json": b'{"iter'})),
    "resume without policy/ nor kept checkpoints after saves": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume"], ("no save to resume from",),
        setup=lambda w, t: copy_run(w, t, "policy", "checkpoints")),
    "resume with a damaged AdamW state": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume", "--iterations", 3],
        ("optimizer.safetensors", "not a readable optimizer state", "update.py --fresh-optimizer"),
        setup=lambda w, t: copy_run(w, t, damage={"policy/optimizer.safetensors": b"\x00" * 40})),
    "resume a folder that is not a run": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "mine"), "--resume"], ("not a run folder",),
        setup=lambda w, t: user_folder(T(t, "mine"))),
    "resume with a damaged config.json": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "mine"), "--resume"], ("config.json", "not a readable"),
        setup=lambda w, t: (user_folder(T(t, "mine")), write(T(t, "mine", "config.json"), b"{not json"))),
    "resume changing a setting": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume", "--lr", "0.1"],
        ("--resume keeps the run's configuration", "--lr"), setup=lambda w, t: copy_run(w, t)),
    "resume with more saves than --iterations": Case(
        "resume", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume", "--iterations", 1],
        ("more than --iterations 1",), setup=lambda w, t: copy_run(w, t)),
    # --- symlinks ----------------------------------------------------------------------------------------
    "update --out a symlink to a new folder": Case(
        "symlinks", lambda w, t: update(w, T(t, "out")), code=0,
        setup=lambda w, t: (os.makedirs(T(t, "target")), os.symlink(T(t, "target"), T(t, "out")))),
    "update twice through a symlink": Case(
        "symlinks", lambda w, t: update(w, T(t, "out")), code=0,
        setup=lambda w, t: (os.makedirs(T(t, "target")), os.symlink(T(t, "target"), T(t, "out")),
                            run(update(w, T(t, "out"))))),
    "update --out a symlink to nothing": Case(
        "symlinks", lambda w, t: update(w, T(t, "out")), ("--out", "is a symlink to", "does not exist"),
        setup=lambda w, t: os.symlink(T(t, "nowhere"), T(t, "out"))),
    "sample --out a symlink to a user's folder": Case(
        "symlinks", lambda w, t: sample(w, T(t, "out")), ("files this project did not write",),
        setup=lambda w, t: (user_folder(T(t, "mine")), os.symlink(T(t, "mine"), T(t, "out")))),
    "train.py --run-dir a symlink to nothing": Case(
        "symlinks", lambda w, t: train(w, T(t, "out")), ("--run-dir", "does not exist"),
        setup=lambda w, t: os.symlink(T(t, "nowhere"), T(t, "out"))),
    "train.py --run-dir a symlink to a finished run": Case(
        "symlinks", lambda w, t: train(w, T(t, "out")), ("already holds a run",),
        setup=lambda w, t: os.symlink(w.run, T(t, "out"))),
    # --- a command cut short is the same command's to finish -------------------------------------------
    "sample again after a kill between its two files": Case(
        "kills", lambda w, t: sample(w, T(t, "out")), code=0,
        setup=lambda w, t: (run(sample(w, T(t, "out"))), os.remove(T(t, "out", "rollouts.safetensors")))),
    "update again after a kill inside its swap": Case(
        "kills", lambda w, t: update(w, T(t, "out")), code=0,
        setup=lambda w, t: (run(update(w, T(t, "out"))), cut_swap(T(t, "out")))),
    # --- --critic-out apart from the other folders ------------------------------------------------------
    "--critic-out equal to --out": Case(
        "critic-out", lambda w, t: update(w, T(t, "out"), "--critic", w.policy, "--critic-out", T(t, "out")),
        ("--critic-out", "is --out")),
    "--critic-out equal to --critic": Case(
        "critic-out", lambda w, t: update(w, T(t, "out"), "--critic", T(t, "c"), "--critic-out", T(t, "c")),
        ("--critic-out", "is --critic"), setup=lambda w, t: run(update(w, T(t, "c")))),
    "--critic-out equal to --model": Case(
        "critic-out", lambda w, t: replaced(update(w, T(t, "out"), "--critic", w.policy, "--critic-out", T(t, "m")),
                                            "--model", T(t, "m")), ("--critic-out", "is --model"),
        setup=lambda w, t: run(update(w, T(t, "m")))),
    "--critic-out holding --out": Case(
        "critic-out", lambda w, t: update(w, T(t, "c", "out"), "--critic", w.policy, "--critic-out", T(t, "c")),
        ("--critic-out", "holds --out")),
    "--critic-out inside --out": Case(
        "critic-out", lambda w, t: update(w, T(t, "out"), "--critic", w.policy, "--critic-out", T(t, "out", "c")),
        ("--critic-out", "lies in --out")),
    "update --out equal to --model": Case(
        "critic-out", lambda w, t: replaced(update(w, T(t, "m")), "--model", T(t, "m")), ("--out", "is --model"),
        setup=lambda w, t: run(update(w, T(t, "m")))),
    "lora --merge --out a user's folder": Case(
        "hostile folders", lambda w, t: ["grpo/lora.py", "--merge", w.policy, "--out", T(t, "out")],
        ("files this project did not write",), setup=lambda w, t: user_folder(T(t, "out"))),
    # --- what used to be a traceback ----------------------------------------------------------------------
    "completion ids beyond the vocabulary": Case(
        "tracebacks", lambda w, t: replaced(replaced(update(w, T(t, "out"), "--old-logprobs", "recompute"),
                                                     "--rollouts", T(t, "rollouts.safetensors")),
                                            "--advantages", T(t, "advantages.safetensors")),
        ("'completion_ids' holds ids outside the model's vocabulary", "rows 2"),
        setup=lambda w, t: damaged_rollouts(w, t, ids_beyond)),
    "a negative prompt id": Case(
        "tracebacks", lambda w, t: replaced(replaced(update(w, T(t, "out"), "--old-logprobs", "recompute"),
                                                     "--rollouts", T(t, "rollouts.safetensors")),
                                            "--advantages", T(t, "advantages.safetensors")),
        ("'prompt_ids' holds ids outside", "rows 5"), setup=lambda w, t: damaged_rollouts(w, t, negative_id)),
    "a policy whose weights are NaN": Case(
        "tracebacks", lambda w, t: replaced(sample(w, T(t, "out")), "--model", w.other["nan_policy"]),
        ("nan_policy", "holds NaN or infinite values")),
    "a prompts file that is not UTF-8": Case(
        "tracebacks", lambda w, t: replaced(sample(w, T(t, "out")), "--prompts", T(t, "latin1.jsonl")),
        ("latin1.jsonl, line 1", "not UTF-8"), setup=lambda w, t: write(T(t, "latin1.jsonl"), NOT_UTF8)),
    "--samples that is not UTF-8": Case(
        "tracebacks", lambda w, t: replaced(score(w, T(t, "out")), "--samples", T(t, "s.jsonl")),
        ("s.jsonl, line 3", "not UTF-8"),
        setup=lambda w, t: write(T(t, "s.jsonl"), b"".join(line.replace(b"}", b'"\xff"}') if i == 2 else line
                                                         for i, line in enumerate(open(w.samples, "rb"))))),
    "--config-file that is not UTF-8": Case(
        "tracebacks", lambda w, t: ["train.py", "--config-file", T(t, "c.json"), "--run-dir", T(t, "out")],
        ("c.json", "not UTF-8"), setup=lambda w, t: write(T(t, "c.json"), b'{"lr": "\xe9"}')),
    "a run's config.json that is not UTF-8": Case(
        "tracebacks", lambda w, t: ["train.py", "--run-dir", T(t, "R"), "--resume"], ("config.json", "not UTF-8"),
        setup=lambda w, t: copy_run(w, t, damage={"config.json": b'{"config": "\xe9"}'})),
    "a reward of 10**400": Case(
        "tracebacks", lambda w, t: replaced(score(w, T(t, "out")), "--reward", f"{w.other['user_rewards']}:huge"),
        ("'huge'", "beyond float32", "rows 0")),
    # --- what used to pass in silence ---------------------------------------------------------------------
    "rollouts of another tokenizer": Case(
        "silent", lambda w, t: ["update.py", "--model", w.policy, "--rollouts",
                                f"{w.other['other_it']}/rollouts.safetensors", "--advantages",
                                f"{w.other['other_it']}/advantages.safetensors", "--out", T(t, "out"),
                                "--old-logprobs", "recompute", "--ref-model", w.ref], ("was made from another tokenizer",)),
    "--temperature other than the rollouts'": Case(
        "silent", lambda w, t: update(w, T(t, "out"), "--temperature", 1.3),
        ("sampled at --temperature 0.7", "--temperature is 1.3")),
    "--lr 1e10": Case("silent", lambda w, t: update(w, T(t, "out"), "--lr", "1e10"), ("--lr",)),
    "--lr -1": Case("silent", lambda w, t: update(w, T(t, "out"), "--lr", "-1"), ("--lr",)),
    "--critic-lr 0": Case("silent", lambda w, t: update(w, T(t, "out"), "--critic-lr", "0"), ("--critic-lr",)),
    "train.py --lr 2": Case("silent", lambda w, t: train(w, T(t, "out"), "--lr", "2"), ("--lr",)),
    **{f"a reward {what}": Case("silent", lambda w, t, fn=fn: replaced(score(w, T(t, "out")), "--reward",
                                                                      f"{w.other['user_rewards']}:{fn}"),
                                (f"'{fn}'", said))
       for what, fn, said in [("returning a dict", "as_dict", "returned a dict"),
                              ("raising SystemExit(0)", "exits", "raised SystemExit"),
                              ("returning a string", "text", "returned a str"),
                              ("returning words", "words", "non-numbers")]},
    "an answer edited in samples.jsonl": Case(
        "silent", lambda w, t: replaced(score(w, T(t, "out")), "--samples", T(t, "samples.jsonl")),
        ("was made from another samples.jsonl",), setup=edited_samples),
    "rollouts of another policy": Case(
        "silent", lambda w, t: ["update.py", "--model", w.ref, "--rollouts", w.rollouts, "--advantages",
                                w.advantages, "--out", T(t, "out"), "--old-logprobs", "sampler"],
        ("was sampled by another policy",)),
    # --- folders that are not the command's ---------------------------------------------------------------
    "sample --out is a file": Case("hostile folders", lambda w, t: sample(w, T(t, "out")), ("is a file",),
                                   setup=lambda w, t: write(T(t, "out"), b"mine")),
    "sample --out holds a user's files": Case(
        "hostile folders", lambda w, t: sample(w, T(t, "out")), ("files this project did not write",),
        setup=lambda w, t: user_folder(T(t, "out"), "a.txt", "b.txt")),
    "sample --out is update.py's": Case(
        "hostile folders", lambda w, t: sample(w, T(t, "out")), ("the output of update.py",),
        setup=lambda w, t: run(update(w, T(t, "out")))),
    "update --out is sample.py's": Case(
        "hostile folders", lambda w, t: update(w, T(t, "out")), ("the output of sample.py",),
        setup=lambda w, t: run(sample(w, T(t, "out")))),
    "sample --out holds a user's file beside its own": Case(
        "hostile folders", lambda w, t: sample(w, T(t, "out")), ("mine.txt beside what sample.py wrote",),
        setup=lambda w, t: (run(sample(w, T(t, "out"))), user_folder(T(t, "out"), "mine.txt"))),
    "update --out the policy's own folder": Case(
        "hostile folders", lambda w, t: update(w, w.policy), ("files this project did not write",)),
    "score --out is a folder": Case("hostile folders", lambda w, t: score(w, T(t, "out")), ("is a folder",),
                                    setup=lambda w, t: os.makedirs(T(t, "out"))),
    "score --out is its rollouts": Case("hostile folders", lambda w, t: score(w, w.rollouts),
                                        ("is also the command's input",)),
    "score --out is a user's file": Case("hostile folders", lambda w, t: score(w, T(t, "out")),
                                         ("not a stage file",), setup=lambda w, t: write(T(t, "out"), b"notes")),
    "advantage --out is its rewards": Case("hostile folders", lambda w, t: advantage(w, w.rewards),
                                           ("is also the command's input",)),
    "advantage --out is a rollouts file": Case(
        "hostile folders", lambda w, t: advantage(w, T(t, "out")), ("a rollouts/1 file",),
        setup=lambda w, t: shutil.copy(w.rollouts, T(t, "out"))),
    "train.py --run-dir holds a user's files": Case(
        "hostile folders", lambda w, t: train(w, T(t, "out")), ("files this project did not write",),
        setup=lambda w, t: user_folder(T(t, "out"))),
    "train.py --run-dir is a file": Case("hostile folders", lambda w, t: train(w, T(t, "out")), ("is a file",),
                                         setup=lambda w, t: write(T(t, "out"), b"x")),
    "train.py a new run in a finished run": Case("hostile folders", lambda w, t: train(w, w.run),
                                                 ("already holds a run",)),
    "train.py --run-dir is sample.py's": Case(
        "hostile folders", lambda w, t: train(w, T(t, "out")), ("the output of sample.py",),
        setup=lambda w, t: run(sample(w, T(t, "out")))),
    "--model is a file": Case(
        "hostile folders", lambda w, t: replaced(sample(w, T(t, "out")), "--model", T(t, "m")), ("m", "no such"),
        setup=lambda w, t: write(T(t, "m"), b"x")),
    "--model holds only a pickle": Case(
        "hostile folders", lambda w, t: replaced(update(w, T(t, "out")), "--model", T(t, "m")),
        ("cannot load", "never pickle"),
        setup=lambda w, t: (shutil.copytree(w.policy, T(t, "m")), os.remove(T(t, "m", "model.safetensors")),
                            write(T(t, "m", "pytorch_model.bin"), b"\x80\x02}q\x00."))),
    "--model with a damaged config.json": Case(
        "hostile folders", lambda w, t: replaced(sample(w, T(t, "out")), "--model", T(t, "m")), ("m",),
        setup=lambda w, t: (shutil.copytree(w.policy, T(t, "m")), write(T(t, "m", "config.json"), b"{oops"))),
    "--prompts is a folder": Case(
        "hostile folders", lambda w, t: replaced(sample(w, T(t, "out")), "--prompts", T(t, "p")), ("no such file",),
        setup=lambda w, t: os.makedirs(T(t, "p"))),
    "--ref-model of another tokenizer": Case(
        "hostile folders", lambda w, t: sample(w, T(t, "out"), "--ref-model", os.path.dirname(w.other["nan_policy"])
                                               + "/other_tok"), ("the reference's tokenizer is not the policy's",)),
    # --- flags --------------------------------------------------------------------------------------------
    **{f"sample.py {' '.join(map(str, flags))}": Case("flags", lambda w, t, f=flags: sample(w, T(t, "out"), *f), (frag,))
       for flags, frag in [(("--group-size", 0), "--group-size"), (("--num-prompts", 0), "--num-prompts"),
                           (("--temperature", 0), "--temperature"), (("--top-p", 0), "--top-p"),
                           (("--top-p", 1.5), "--top-p"), (("--min-p", -0.1), "--min-p"),
                           (("--max-new-tokens", 0), "--max-new-tokens"), (("--group-size", "abc"), "--group-size"),
                           (("--no-such-flag",), "--no-such-flag"), (("--start", 99), "--start 99"),
                           (("--engine", "other"), "--engine"), (("--top-k", -1), "--top-k")]},
    **{f"score.py {' '.join(map(str, flags))}": Case("flags", lambda w, t, f=flags: score(w, T(t, "out"), *f), (frag,))
       for flags, frag in [(("--reward-weights", 1, 2), "--reward-weights"), (("--reward", "no_such"), "no_such"),
                           (("--overlong-buffer", 100, "--max-new-tokens", 8), "--overlong-buffer"),
                           (("--on-reward-error", "maybe"), "--on-reward-error"), (("--bogus",), "--bogus")]},
    **{f"advantage.py {' '.join(map(str, flags))}": Case("flags", lambda w, t, f=flags: advantage(w, T(t, "out"), *f),
                                                          (frag,))
       for flags, frag in [(("--eps", -1), "--eps"), (("--estimator", "gae"), "--rollouts"),
                           (("--estimator", "bogus"), "--estimator"), (("--gamma", 2), "--gamma"),
                           (("--lam", -1), "--lam"), (("--scale", "bogus"), "--scale")]},
    **{f"update.py {' '.join(map(str, flags))}": Case("flags", lambda w, t, f=flags: update(w, T(t, "out"), *f), (frag,))
       for flags, frag in [(("--beta", -1), "--beta"), (("--clip-eps", 0), "--clip-eps"),
                           (("--clip-eps", 1.5), "--clip-eps"), (("--epochs", 0), "--epochs"),
                           (("--critic", "c"), "--critic-out"), (("--critic-only",), "--critic-only"),
                           (("--lr-schedule", "cosine"), "--total-steps"), (("--dual-clip", 0.5), "--dual-clip"),
                           (("--rollout-is-cap", 0.5), "--rollout-is-cap"), (("--max-grad-norm", 0), "--max-grad-norm"),
                           (("--loss-agg", "bogus"), "--loss-agg"), (("--minibatch-size", -1), "--minibatch-size"),
                           (("--rollout-is", "tis"), "sampler_logprobs"), (("--weight-decay", -1), "--weight-decay")]},
    **{f"train.py {' '.join(map(str, flags))}": Case("flags", lambda w, t, f=flags: train(w, T(t, "out"), *f), (frag,))
       for flags, frag in [(("--config-file", "x.json"), "--config-file"), (("--iterations", 0), "--iterations"),
                           (("--critic-warmup", 1), "--critic-warmup"), (("--algo", "ppo", "--dynamic-sampling"),
                                                                          "--dynamic-sampling"),
                           (("--group-size", 1), "--group-size 1"), (("--length-strata", 3), "--length-strata 3"),
                           (("--eval-prompts", 0, "--eval-every", 5), "--eval-prompts 0"),
                           (("--estimator", "gae"), "--estimator gae"), (("--config", "bogus"), "--config"),
                           (("--rollout-is", "tis"), "--rollout-is tis"), (("--save-every", -1), "--save-every")]},
}


def run_case(case, w, tmp):
    """Run a case as a user would and check it (docstring of the module)."""
    tmp = str(tmp)
    out = T(tmp, "out")
    if case.setup:
        case.setup(w, tmp)
    argv = case.argv(w, tmp)
    fresh = not os.path.lexists(out)
    roots = [w.root, w.policy, w.ref, tmp]
    # The command's own output, and its scratch beside it (a swap a kill cut short is its to finish).
    skip = [out, os.path.realpath(out)] if case.code == 0 or fresh else []
    skip += [os.path.join(tmp, name) for name in os.listdir(tmp) if name.startswith(".out.grpo-")]
    before = snapshot(roots, skip)
    try:
        r = cli(*argv)
    finally:
        while HELD:
            HELD.pop().__exit__(None, None, None)
    assert r.code == case.code, r.err
    if case.code != 0:
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.err, r.err
        for fragment in case.fragments:
            assert str(fragment) in lines[0], (fragment, lines[0])
        if fresh:
            assert not os.path.lexists(out)
    assert snapshot(roots, skip) == before


@pytest.mark.parametrize("name", list(CASES))
def test_corpus(w, tmp_path, name):
    run_case(CASES[name], w, tmp_path)


def test_the_corpus_is_large_and_can_fail(w, tmp_path, monkeypatch):
    """At least 100 cases; and with a check broken (the run-folder check, the scratch names of the
    swap), cases of the corpus's kinds fail, on a copy of the run."""
    assert len(CASES) >= 100
    into_run = Case("run folder", lambda w, t: update(w, T(t, "R", "policy")), ("lies in the train.py run",),
                    setup=lambda w, t: copy_run(w, t))
    with monkeypatch.context() as m:
        m.setattr(outputs, "enclosing_run", lambda *_: None)
        with pytest.raises(AssertionError):
            run_case(into_run, w, tmp_path / "a")
    with monkeypatch.context() as m:                        # the swap of old, which set aside X.old
        m.setattr(files, "scratch_name", lambda path, kind: os.path.abspath(path) + "." + kind)
        with pytest.raises(AssertionError):
            run_case(CASES["update twice into out beside a user's out.old"], w, tmp_path / "b")


# ----------------------------------------------------------------------------------------
# The cases a table cannot hold: a resume's fallback, two processes, a shell

def test_a_resume_without_its_state_file_resumes_from_the_kept_checkpoint(w, tmp_path):
    """policy/train_state.json lost: the run resumes from checkpoints/iter_0001 (and says so), keeps the
    iteration before it byte for byte, and ends with the weights of the run that never lost it."""
    copy_run(w, tmp_path, "policy/train_state.json")
    run_dir = tmp_path / "R"
    kept = snapshot([str(run_dir / "iter_0000")])
    r = cli("train.py", "--run-dir", run_dir, "--resume")
    assert r.code == 0, r.err
    assert "resuming from the kept checkpoint checkpoints/iter_0001" in r.out
    assert snapshot([str(run_dir / "iter_0000")]) == kept
    assert (run_dir / "iter_0001" / "metrics.json").is_file()
    again, first = load_file(run_dir / "policy" / "model.safetensors"), load_file(f"{w.run}/policy/model.safetensors")
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_two_runs_in_one_folder_one_is_refused_and_a_killed_holder_frees_it(tmp_path):
    """Two train.py started together on one folder: one runs, the other is refused in one line and
    touches nothing (the run's config.json is the winner's, its three iterations complete); after
    kill -9 of a holder, the folder resumes."""
    run_dir = tmp_path / "conc"
    argv = [sys.executable, "train.py", "--config", "tiny", "--iterations", "3", "--eval-every", "0",
            "--run-dir", str(run_dir)]
    procs = [subprocess.Popen(argv + extra, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in ([], ["--seed", "7"])]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2).strip().splitlines()
    # Refused by the lock, or, when it started once the winner had marked the folder, as a folder that
    # holds a run: either way one line, and nothing of the winner's touched.
    assert len(refused) == 1 and ("another train.py (PID" in refused[0] or "already holds a run" in refused[0])
    winner = procs[[code for code, _ in results].index(0)]
    seed = json.load(open(run_dir / "config.json"))["config"]["seed"]
    assert seed == (7 if "--seed" in winner.args else 0)
    assert sorted(p.name for p in run_dir.glob("iter_*")) == ["iter_0000", "iter_0001", "iter_0002"]
    # kill -9 while it holds the folder: the kernel frees the lock, and the run resumes
    holder = subprocess.Popen(argv + ["--resume", "--iterations", "30"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    lock = run_dir / outputs.LOCK
    deadline = time.time() + 120
    while lock.read_text().strip() != str(holder.pid) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    r = cli("train.py", "--run-dir", run_dir, "--resume", "--iterations", "4")
    assert r.code == 0, r.err


def test_replay_sh_keeps_a_dollar_in_a_path(tmp_path):
    """replay.sh of a run whose folder name holds `$`: the shell passes that name through unexpanded,
    and $OUT alone expands."""
    run_dir = tmp_path / "run$HOME"
    r = cli("train.py", "--config", "tiny", "--iterations", "2", "--eval-every", "0", "--save-every", "1",
            "--run-dir", run_dir)
    assert r.code == 0, r.err
    script = run_dir / "iter_0001" / "replay.sh"
    shell = f'python() {{ printf "%s\\n" "$@"; }}; OUT=/x/o; . {shlex.quote(str(script))}'
    args = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True).stdout.splitlines()
    assert args[args.index("--model") + 1] == str(run_dir / "checkpoints" / "iter_0001")
    assert "/x/o/rollouts.safetensors" in args and "/x/o" in args

