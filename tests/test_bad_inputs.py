"""docs/bad-input-and-faults.md's table of bad inputs, case by case through each stage's command line: a one-line error
naming the file, key, line or flag, a non-zero exit, no traceback, and no output left behind."""

import json
import os
import shutil

import pytest
import torch
from conftest import PROMPTS, assert_user_error, cli, write_jsonl
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def files(models, rollout_dir, tmp_path_factory):
    """Good files of one iteration, and a folder to write damaged copies into."""
    d = tmp_path_factory.mktemp("bad")
    rollouts = rollout_dir / "rollouts.safetensors"
    samples = rollout_dir / "samples.jsonl"
    rewards, advantages = d / "rewards.safetensors", d / "advantages.safetensors"
    assert cli("score.py", "--rollouts", rollouts, "--samples", samples, "--reward", "exact_answer",
               "--out", rewards).code == 0
    group_ids = load_file(rollouts)["group_ids"]
    save_file({"rewards": torch.arange(16.0), "group_ids": group_ids}, str(rewards))
    assert cli("advantage.py", "--rewards", rewards, "--out", advantages).code == 0
    no_weights = d / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(open(os.path.join(models["policy"], "config.json")).read())
    (d / "user_rewards.py").write_text(
        "def raises(prompts, completions, **k):\n    raise ValueError('cannot parse')\n"
        "def short(prompts, completions, **k):\n    return [1.0] * (len(completions) - 1)\n"
        "def nothing(prompts, completions, **k):\n    return None\n"
        "def holes(prompts, completions, **k):\n    return [None if i == 4 else float('nan') if i == 7 else 1.0\n"
        "            for i in range(len(completions))]\n")
    return {"dir": d, "rollouts": rollouts, "samples": samples, "rewards": rewards, "advantages": advantages,
            "policy": models["policy"], "no_weights": no_weights}


def damaged(files, source, name, change):
    """A copy of safetensors file `source` with `change(tensors)` applied, saved as `name`."""
    tensors = load_file(files[source])
    change(tensors)
    path = files["dir"] / name
    save_file(tensors, str(path), metadata={"args": json.dumps({"temperature": 0.7, "max_new_tokens": 40})})
    return path


def raw(files, name, data):
    path = files["dir"] / name
    path.write_bytes(data)
    return path


def truncated(files, source, name):
    return raw(files, name, open(files[source], "rb").read()[:-50])


def with_nan(key, value=float("nan"), row=3):
    def change(t):
        t[key] = t[key].clone()
        t[key][row] = value
    return change


def regroup(ids):
    def change(t):
        t["group_ids"] = torch.tensor(ids)
    return change


def pop(key):
    return lambda t: t.pop(key)


def retype(key, dtype):
    def change(t):
        t[key] = t[key].to(dtype)
    return change


def reshape(key, fn):
    def change(t):
        t[key] = fn(t[key]).contiguous()
    return change


def prompts(files, name, text):
    return raw(files, name, text.encode())


# (stage, case id) -> (argv built from `files`, fragments the one-line error must contain)
CASES = {
    # sample.py
    ("sample", "missing prompt file"): (lambda f: ["--prompts", f["dir"] / "nope.jsonl"], ["nope.jsonl", "no such file"]),
    ("sample", "empty prompt file"): (lambda f: ["--prompts", prompts(f, "empty.jsonl", "\n\n")], ["empty.jsonl", "no records"]),
    ("sample", "line not JSON"): (lambda f: ["--prompts", prompts(f, "broken.jsonl", '{"prompt": "a"}\n{oops\n')],
                                  ["broken.jsonl", "line 2", "not valid JSON"]),
    ("sample", "record without prompt"): (lambda f: ["--prompts", prompts(f, "neither.jsonl", '{"prompt": "a"}\n{"text": "b"}\n')],
                                          ["neither.jsonl", "line 2", "'prompt'", "'messages'"]),
    ("sample", "prompt too long"): (lambda f: ["--prompts", prompts(f, "long.jsonl", json.dumps({"prompt": "x" * 600}) + "\n")],
                                    ["long.jsonl", "line 1", "at most"]),
    ("sample", "model folder missing"): (lambda f: ["--model", f["dir"] / "nomodel"], ["nomodel", "no such model folder"]),
    ("sample", "folder holds no model"): (lambda f: ["--model", f["no_weights"]], ["no_weights", "cannot load"]),
    ("sample", "bad flag"): (lambda f: ["--group-size", 0], ["--group-size"]),
    # score.py
    ("score", "missing rollouts"): (lambda f: ["--rollouts", f["dir"] / "nope.safetensors"], ["nope.safetensors", "no such file"]),
    ("score", "not safetensors"): (lambda f: ["--rollouts", raw(f, "junk.safetensors", b"hello world" * 10)],
                                   ["junk.safetensors", "not a readable safetensors file"]),
    ("score", "truncated rollouts"): (lambda f: ["--rollouts", truncated(f, "rollouts", "cut.safetensors")],
                                      ["cut.safetensors", "not a readable safetensors file"]),
    ("score", "missing key"): (lambda f: ["--rollouts", damaged(f, "rollouts", "nogroups.safetensors", pop("group_ids"))],
                               ["nogroups.safetensors", "missing key 'group_ids'"]),
    ("score", "wrong dtype"): (lambda f: ["--rollouts", damaged(f, "rollouts", "f32groups.safetensors", retype("group_ids", torch.float32))],
                               ["f32groups.safetensors", "'group_ids'", "float32", "int64"]),
    ("score", "wrong shape"): (lambda f: ["--rollouts", damaged(f, "rollouts", "flatmask.safetensors", reshape("completion_mask", lambda x: x[:, 0]))],
                               ["flatmask.safetensors", "'completion_mask'", "shape"]),
    ("score", "rows differ"): (lambda f: ["--samples", raw(f, "half.jsonl", b"".join(open(f["samples"], "rb").readlines()[:8]))],
                               ["half.jsonl", "8 rows", "16"]),
    ("score", "samples not JSON"): (lambda f: ["--samples", raw(f, "bad.jsonl", open(f["samples"], "rb").read() + b"{no\n")],
                                    ["bad.jsonl", "line 17", "not valid JSON"]),
    ("score", "unknown reward"): (lambda f: ["--reward", "no_such_reward"], ["no_such_reward", "unknown reward"]),
    ("score", "user reward raises"): (lambda f: ["--reward", f"{f['dir']}/user_rewards.py:raises"],
                                      ["'raises'", "raised ValueError: cannot parse", "--on-reward-error skip"]),
    ("score", "user reward wrong length"): (lambda f: ["--reward", f"{f['dir']}/user_rewards.py:short"],
                                            ["'short'", "returned 15 values", "expected a list of 16"]),
    ("score", "user reward returns None"): (lambda f: ["--reward", f"{f['dir']}/user_rewards.py:nothing"],
                                            ["'nothing'", "returned None"]),
    ("score", "user reward NaN rows"): (lambda f: ["--reward", f"{f['dir']}/user_rewards.py:holes"],
                                        ["'holes'", "NaN", "rows 7"]),
    ("score", "reward model folder holds no model"): (lambda f: ["--reward", str(f["no_weights"])], ["no_weights", "cannot load"]),
    # advantage.py
    ("advantage", "missing rewards"): (lambda f: ["--rewards", f["dir"] / "nope.safetensors"], ["nope.safetensors", "no such file"]),
    ("advantage", "not safetensors"): (lambda f: ["--rewards", raw(f, "junk2.safetensors", b"\x00" * 64)],
                                       ["junk2.safetensors", "not a readable safetensors file"]),
    ("advantage", "truncated rewards"): (lambda f: ["--rewards", truncated(f, "rewards", "cut2.safetensors")],
                                         ["cut2.safetensors", "not a readable"]),
    ("advantage", "missing key"): (lambda f: ["--rewards", damaged(f, "rewards", "norewards.safetensors", pop("rewards"))],
                                   ["norewards.safetensors", "missing key 'rewards'"]),
    ("advantage", "wrong dtype"): (lambda f: ["--rewards", damaged(f, "rewards", "f64.safetensors", retype("rewards", torch.float64))],
                                   ["f64.safetensors", "'rewards'", "float64", "float32"]),
    ("advantage", "wrong shape"): (lambda f: ["--rewards", damaged(f, "rewards", "col.safetensors", reshape("rewards", lambda x: x[:, None]))],
                                   ["col.safetensors", "'rewards'", "shape [16, 1]"]),
    ("advantage", "groups not contiguous"): (lambda f: ["--rewards", damaged(f, "rewards", "split.safetensors", regroup([0, 1] * 8))],
                                             ["split.safetensors", "not contiguous"]),
    ("advantage", "groups of unequal size"): (lambda f: ["--rewards", damaged(f, "rewards", "uneven.safetensors", regroup([0] * 6 + [1] * 10))],
                                              ["uneven.safetensors", "unequal sizes"]),
    ("advantage", "NaN reward"): (lambda f: ["--rewards", damaged(f, "rewards", "nan.safetensors", with_nan("rewards"))],
                                  ["nan.safetensors", "'rewards'", "NaN or infinite", "rows 3"]),
    ("advantage", "infinite reward"): (lambda f: ["--rewards", damaged(f, "rewards", "inf.safetensors", with_nan("rewards", float("inf"), 9))],
                                       ["inf.safetensors", "rows 9"]),
    ("advantage", "G = 1"): (lambda f: ["--rewards", damaged(f, "rewards", "g1.safetensors", regroup(list(range(16))))],
                             ["g1.safetensors", "G = 1"]),
    # update.py
    ("update", "missing rollouts"): (lambda f: ["--rollouts", f["dir"] / "nope.safetensors"], ["nope.safetensors", "no such file"]),
    ("update", "truncated advantages"): (lambda f: ["--advantages", truncated(f, "advantages", "cut3.safetensors")],
                                         ["cut3.safetensors", "not a readable"]),
    ("update", "missing key"): (lambda f: ["--rollouts", damaged(f, "rollouts", "noold.safetensors", pop("old_logprobs"))],
                                ["noold.safetensors", "missing key 'old_logprobs'"]),
    ("update", "wrong dtype"): (lambda f: ["--rollouts", damaged(f, "rollouts", "i32.safetensors", retype("completion_ids", torch.int32))],
                                ["i32.safetensors", "'completion_ids'", "int32"]),
    ("update", "wrong shape"): (lambda f: ["--rollouts", damaged(f, "rollouts", "wide.safetensors",
                                                                 reshape("old_logprobs", lambda x: torch.cat([x, x[:, :1]], 1)))],
                                ["wide.safetensors", "'old_logprobs'", "shape"]),
    ("update", "rows differ"): (lambda f: ["--advantages", damaged(f, "advantages", "short.safetensors",
                                                                   lambda t: t.update(advantages=t["advantages"][:12], group_ids=t["group_ids"][:12]))],
                                ["short.safetensors", "12 rows", "16"]),
    ("update", "NaN advantage"): (lambda f: ["--advantages", damaged(f, "advantages", "nanadv.safetensors", with_nan("advantages"))],
                                  ["nanadv.safetensors", "'advantages'", "NaN or infinite"]),
    ("update", "NaN log-prob"): (lambda f: ["--rollouts", damaged(f, "rollouts", "nanlogp.safetensors", with_nan("old_logprobs", row=5))],
                                 ["nanlogp.safetensors", "'old_logprobs'", "rows 5"]),
    ("update", "infinite ref log-prob"): (lambda f: ["--rollouts", damaged(f, "rollouts", "infref.safetensors", with_nan("ref_logprobs", float("-inf"), 2))],
                                          ["infref.safetensors", "'ref_logprobs'", "rows 2"]),
    ("update", "no ref_logprobs with β ≠ 0"): (lambda f: ["--rollouts", damaged(f, "rollouts", "noref.safetensors", pop("ref_logprobs"))],
                                               ["noref.safetensors", "ref_logprobs", "--beta"]),
    ("update", "model folder missing"): (lambda f: ["--model", f["dir"] / "nomodel2"], ["nomodel2", "no such model folder"]),
}


def stage_argv(stage, files, out):
    """The stage's good command line; a case's flags replace the ones they name."""
    return {
        "sample": {"--model": files["policy"], "--prompts": write_jsonl(files["dir"] / "good.jsonl", PROMPTS),
                   "--out": out, "--group-size": 2, "--max-new-tokens": 8},
        "score": {"--rollouts": files["rollouts"], "--samples": files["samples"], "--reward": "exact_answer", "--out": out},
        "advantage": {"--rewards": files["rewards"], "--out": out},
        "update": {"--model": files["policy"], "--rollouts": files["rollouts"], "--advantages": files["advantages"],
                   "--out": out},
    }[stage]


@pytest.mark.parametrize("stage, case", list(CASES), ids=[f"{s}: {c}" for s, c in CASES])
def test_bad_input(files, tmp_path, stage, case):
    build, fragments = CASES[(stage, case)]
    out = tmp_path / "out"
    flags = stage_argv(stage, files, out)
    change = build(files)
    flags.update(zip(change[::2], change[1::2]))
    argv = [x for kv in flags.items() for x in kv]
    assert_user_error(cli(f"{stage}.py", *argv), *map(str, fragments))
    assert os.listdir(tmp_path) == []                         # no output file or folder, no temporary


def test_train_bad_inputs_leave_no_run_folder(tmp_path, files):
    run = tmp_path / "run"
    assert_user_error(cli("train.py", "--model", tmp_path / "nomodel", "--run-dir", run), "nomodel", "no such model folder")
    assert_user_error(cli("train.py", "--config", "tiny", "--reward", "no_such_reward", "--run-dir", run), "no_such_reward")
    assert_user_error(cli("train.py", "--config", "tiny", "--group-size", "0", "--run-dir", run), "--group-size")
    assert_user_error(cli("train.py", "--config", "tiny", "--no-such-flag", "--run-dir", run), "--no-such-flag")
    assert not run.exists()
    cli("train.py", "--config", "tiny", "--iterations", "1", "--run-dir", run)
    assert_user_error(cli("train.py", "--config", "tiny", "--run-dir", run), "already holds a run")
    shutil.rmtree(run)
    run.mkdir()
    (run / "config.json").write_text("{not json")
    assert_user_error(cli("train.py", "--run-dir", run, "--resume"), "config.json", "not a readable JSON file")
