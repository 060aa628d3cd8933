"""Nothing deleted that the project did not write, and no stage file used with another's.

- Every command with an --out (sample.py, score.py, advantage.py, update.py --out and --critic-out,
  train.py --run-dir, grpo.lora --merge --out) given a train.py run folder, a folder of the user's
  files, or its own input, stops with one line and leaves it as it was; its own earlier output it
  replaces.
- Each stage file names what it was made from, and a stage refuses inputs that do not belong
  together (samples or rewards of other rollouts, advantages of other rewards, rollouts of another
  policy, a reference or critic with another tokenizer), naming both files; --allow-mismatch goes on.
- Failures that were tracebacks are one line: --device, a LoRA target that names nothing, a
  read-only or full output folder, Ctrl-C (exit 130), a --max-new-tokens that leaves no room.
- The surprises, decided: prompt and messages both, an evaluation file that is the training file,
  exact_answer without an answer, an update whose advantages are all 0, paths in config.json, small
  KL values, where a resume starts, each reward's held-out mean.
"""

import json
import os
import re
import shutil

import pytest
import torch
from conftest import PROMPTS, assert_user_error, cli, write_jsonl
from safetensors.torch import load_file, save_file

from grpo.cli import StageError
from grpo.disk import outputs
from grpo.loop import runs
from grpo.models import builders
from grpo.rewards import tasks

TINY_RUN = ["--config", "tiny", "--iterations", 2, "--eval-every", 0, "--num-prompts", 2, "--group-size", 4]


def snapshot(folder):
    """Every file under `folder` with its bytes, to show that nothing changed."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(folder) for f in names}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished tiny train.py run (LoRA-free, full fine-tune)."""
    d = tmp_path_factory.mktemp("guarded") / "run"
    r = cli("train.py", *TINY_RUN, "--run-dir", d)
    assert r.code == 0, r.err
    return d


@pytest.fixture(scope="module")
def chain(models, prompts_file, tmp_path_factory):
    """sample → score → advantage by hand, twice (two seeds): two chains of files of the same shapes."""
    out = {}
    for seed in (0, 1):
        d = tmp_path_factory.mktemp(f"chain{seed}")
        assert cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", d / "it",
                   "--group-size", 4, "--max-new-tokens", 8, "--seed", seed, "--ref-model", models["policy"]).code == 0
        assert cli("score.py", "--rollouts", d / "it" / "rollouts.safetensors", "--samples", d / "it" / "samples.jsonl",
                   "--reward", "tests/length_reward.py:char_count", "--out", d / "rewards.safetensors").code == 0
        assert cli("advantage.py", "--rewards", d / "rewards.safetensors", "--out", d / "advantages.safetensors").code == 0
        out[seed] = d
    return out


def user_folder(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "notes.txt").write_text("my notes")
    (d / "analysis.py").write_text("print(1)")
    return d


# ----------------------------------------------------------------------------------------
# Output folders

def test_update_never_replaces_a_run_a_users_folder_or_its_own_model(models, chain, run_dir, tmp_path):
    d = chain[0]
    common = ["--model", models["policy"], "--rollouts", d / "it" / "rollouts.safetensors",
              "--advantages", d / "advantages.safetensors"]
    mine = user_folder(tmp_path)
    for target, fragment in [(run_dir, "lies in the train.py run"), (mine, "files this project did not write"),
                             (models["policy"], "files this project did not write")]:
        before = snapshot(target)
        assert_user_error(cli("update.py", *common, "--out", target), f"--out {target}", fragment)
        assert snapshot(target) == before
    r = cli("update.py", *common, "--out", tmp_path / "ckpt")
    assert r.code == 0, r.err
    assert outputs.read_marker(tmp_path / "ckpt")["command"] == "update.py"
    assert cli("update.py", *common, "--out", tmp_path / "ckpt").code == 0            # its own output again
    (tmp_path / "ckpt" / "mine.txt").write_text("x")
    assert_user_error(cli("update.py", *common, "--out", tmp_path / "ckpt"), "mine.txt beside what update.py wrote")
    assert_user_error(cli("update.py", *common, "--out", tmp_path / "c2", "--critic", "c", "--critic-out", mine),
                      f"--critic-out {mine}")


def test_sample_score_and_advantage_never_write_over_what_is_not_theirs(models, prompts_file, chain, run_dir,
                                                                         tmp_path):
    mine = user_folder(tmp_path)
    for target in (run_dir, mine, run_dir / "iter_0000", os.path.dirname(prompts_file)):
        before = snapshot(target)
        assert_user_error(cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", target,
                              "--group-size", 2), f"--out {target}")
        assert snapshot(target) == before
    d = chain[0]
    rollouts, samples, rewards = d / "it" / "rollouts.safetensors", d / "it" / "samples.jsonl", d / "rewards.safetensors"
    before = snapshot(d)
    for out, fragment in [(rollouts, "is also the command's input"), (mine / "notes.txt", "not a stage file"),
                          (d / "advantages.safetensors", "a advantages/1 file"), (run_dir, "is a folder")]:
        assert_user_error(cli("score.py", "--rollouts", rollouts, "--samples", samples, "--reward", "char_class",
                              "--out", out), fragment)
    for out, fragment in [(rewards, "is also the command's input"), (rollouts, "a rollouts/1 file")]:
        assert_user_error(cli("advantage.py", "--rewards", rewards, "--out", out), fragment)
    assert snapshot(d) == before
    assert cli("advantage.py", "--rewards", rewards, "--out", d / "advantages.safetensors").code == 0   # its own


def test_train_and_merge_never_write_over_what_is_not_theirs(run_dir, tmp_path):
    from grpo.lora import main as merge_main

    mine = user_folder(tmp_path)
    before = snapshot(mine)
    assert_user_error(cli("train.py", *TINY_RUN, "--run-dir", mine), f"--run-dir {mine}", "did not write")
    assert_user_error(cli("train.py", *TINY_RUN, "--run-dir", mine, "--resume"), "no config.json")
    assert snapshot(mine) == before
    assert_user_error(cli("train.py", *TINY_RUN, "--run-dir", run_dir), "already holds a run")
    adapters = tmp_path / "lora"
    assert cli("train.py", *TINY_RUN, "--iterations", 1, "--lora-r", 2, "--run-dir", adapters).code == 0
    for target in (mine, adapters / "policy", run_dir):
        before = snapshot(target)
        with pytest.raises(StageError, match=f"--out {target}"):
            merge_main(["--merge", str(adapters / "policy"), "--out", str(target)])
        assert snapshot(target) == before
    merge_main(["--merge", str(adapters / "policy"), "--out", str(tmp_path / "merged")])
    merge_main(["--merge", str(adapters / "policy"), "--out", str(tmp_path / "merged")])       # its own again
    assert outputs.read_marker(tmp_path / "merged")["command"] == "grpo.lora --merge"


# ----------------------------------------------------------------------------------------
# Provenance

def test_score_refuses_samples_of_other_rollouts(chain, tmp_path):
    a, b = chain[0] / "it", chain[1] / "it"
    r = cli("score.py", "--rollouts", a / "rollouts.safetensors", "--samples", b / "samples.jsonl",
            "--reward", "char_class", "--out", tmp_path / "r.safetensors")
    assert_user_error(r, str(a / "rollouts.safetensors"), str(b / "samples.jsonl"), "--allow-mismatch")
    assert not (tmp_path / "r.safetensors").exists()
    assert cli("score.py", "--rollouts", a / "rollouts.safetensors", "--samples", b / "samples.jsonl", "--reward",
               "tests/length_reward.py:char_count", "--out", tmp_path / "r.safetensors", "--allow-mismatch").code == 0


def test_advantages_and_rewards_must_be_of_the_rollouts(models, chain, tmp_path):
    a, b = chain[0], chain[1]
    r = cli("update.py", "--model", models["policy"], "--rollouts", a / "it" / "rollouts.safetensors",
            "--advantages", b / "advantages.safetensors", "--out", tmp_path / "u")
    assert_user_error(r, str(b / "advantages.safetensors"), str(a / "it" / "rollouts.safetensors"))
    assert not (tmp_path / "u").exists()
    assert cli("update.py", "--model", models["policy"], "--rollouts", a / "it" / "rollouts.safetensors",
               "--advantages", b / "advantages.safetensors", "--out", tmp_path / "u", "--allow-mismatch").code == 0


def test_gae_reads_the_rollouts_its_rewards_were_scored_on(chain, tmp_path):
    a, b = chain[0], chain[1]
    r = cli("advantage.py", "--rewards", a / "rewards.safetensors", "--out", tmp_path / "adv.safetensors",
            "--estimator", "gae", "--rollouts", b / "it" / "rollouts.safetensors")
    assert_user_error(r, str(a / "rewards.safetensors"), str(b / "it" / "rollouts.safetensors"), "--allow-mismatch")
    assert not (tmp_path / "adv.safetensors").exists()


def test_rollouts_of_another_policy_need_recompute_and_another_tokenizer_is_refused(models, chain, tmp_path):
    d = chain[0]
    common = ["--rollouts", d / "it" / "rollouts.safetensors", "--advantages", d / "advantages.safetensors"]
    r = cli("update.py", "--model", models["ref"], *common, "--out", tmp_path / "a")
    assert_user_error(r, "sampled by another policy", "--old-logprobs recompute")
    assert cli("update.py", "--model", models["ref"], *common, "--out", tmp_path / "b", "--old-logprobs",
               "recompute").code == 0
    other = builders.make_tiny_llama(str(tmp_path / "other_vocab"), seed=0)
    tokenizer = json.loads(open(os.path.join(other, "tokenizer.json")).read())
    tokenizer["model"]["vocab"]["§"] = max(tokenizer["model"]["vocab"].values()) + 1
    open(os.path.join(other, "tokenizer.json"), "w").write(json.dumps(tokenizer))
    r = cli("update.py", "--model", models["policy"], *common, "--out", tmp_path / "c", "--ref-model", other)
    assert_user_error(r, other, "reference's tokenizer is not the policy's")


# ----------------------------------------------------------------------------------------
# One line, not a traceback

def test_devices_lora_targets_and_lengths_are_one_line(models, prompts_file, chain, tmp_path):
    base = ["--model", models["policy"], "--prompts", prompts_file, "--out", tmp_path / "s", "--group-size", 2]
    assert_user_error(cli("sample.py", *base, "--device", "gpu"), "--device", "not a device")
    if not torch.cuda.is_available():
        assert_user_error(cli("sample.py", *base, "--device", "cuda"), "no CUDA device")
    assert_user_error(cli("sample.py", *base, "--lora-r", 2, "--lora-target-modules", "q_proj", "v_prj"),
                      "--lora-target-modules v_prj", "q_proj")
    assert_user_error(cli("sample.py", *base, "--max-new-tokens", 10**6), "leaves no room for a prompt")
    it = chain[0] / "it"
    assert_user_error(cli("score.py", "--rollouts", it / "rollouts.safetensors", "--samples", it / "samples.jsonl",
                          "--reward", "tests/length_reward.py", "--out", tmp_path / "r.safetensors"),
                      "tests/length_reward.py:FUNCTION")
    assert not (tmp_path / "s").exists()


def test_a_read_only_folder_is_one_line(models, prompts_file, tmp_path, monkeypatch):
    """The tests run as root, whom a read-only mode does not stop: the folder refuses as the kernel would."""
    locked, makedirs = tmp_path / "locked", os.makedirs

    def refusing(path, *args, **kwargs):
        if str(path).startswith(str(locked)):
            raise PermissionError(13, "Permission denied", str(path))
        return makedirs(path, *args, **kwargs)
    monkeypatch.setattr(os, "makedirs", refusing)
    assert_user_error(cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out",
                          locked / "s", "--group-size", 2), str(locked / "s"), "Permission denied")
    assert_user_error(cli("train.py", *TINY_RUN, "--run-dir", locked / "run"), str(locked / "run"),
                      "Permission denied")


def test_a_full_disk_and_ctrl_c_are_one_line(models, prompts_file, tmp_path, monkeypatch):
    import safetensors

    from grpo.disk import files
    from grpo.rewards import prompting

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: No space left on device (os error 28)")
    monkeypatch.setattr(files, "save_file", full)
    base = ["--model", models["policy"], "--prompts", prompts_file, "--group-size", 2, "--max-new-tokens", 4]
    assert_user_error(cli("sample.py", *base, "--out", tmp_path / "s"), "No space left on device")
    assert not (tmp_path / "s" / "rollouts.safetensors").exists()
    monkeypatch.undo()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(prompting, "render_prompts", interrupted)       # Ctrl-C while sampling
    r = cli("sample.py", *base, "--out", tmp_path / "t")
    assert r.code == 130 and len(r.err.strip().splitlines()) == 1 and "interrupted" in r.err, r.err
    assert not (tmp_path / "t" / "rollouts.safetensors").exists()


# ----------------------------------------------------------------------------------------
# Surprises, decided

def test_surprises_are_said(models, tmp_path, capsys):
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "ignored", "messages": [{"role": "user", "content": "2+2?"}],
                                                   "answer": "4"}] * 3)
    r = cli("sample.py", "--model", models["policy"], "--prompts", both, "--out", tmp_path / "s", "--group-size", 2,
            "--max-new-tokens", 4)
    assert r.code == 0 and "have both 'prompt' and 'messages'; the model sees 'messages'" in r.err, r.err
    assert tasks.exact_answer(None, ["4", "4"], [None, ""]) == [None, None]          # does not apply, as math
    assert tasks.exact_answer(None, ["it is 4", "5"], ["4", "4"]) == [1.0, 0.0]
    train_file = write_jsonl(tmp_path / "train.jsonl", PROMPTS * 3)
    runs.run_records("arithmetic", 0, train_file, train_file, 0)
    assert "the held-out score measures prompts the policy trains on" in capsys.readouterr().err
    groups = load_file(tmp_path / "s" / "rollouts.safetensors")["group_ids"]
    save_file({"advantages": torch.zeros(len(groups)), "group_ids": groups}, str(tmp_path / "zero.safetensors"))
    r = cli("update.py", "--model", models["policy"], "--rollouts", tmp_path / "s" / "rollouts.safetensors",
            "--advantages", tmp_path / "zero.safetensors", "--out", tmp_path / "u", "--beta", 0)
    assert r.code == 0 and "every advantage in" in r.err, r.err


def test_runs_store_absolute_paths_say_where_they_resume_and_log_each_rewards_held_out_mean(tmp_path, monkeypatch):
    prompts = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{c}:", "char_class": c}
                                                     for c in ("digits", "lower", "upper")] * 6)
    shutil.copy(os.path.join(os.path.dirname(__file__), "length_reward.py"), tmp_path / "my_reward.py")
    monkeypatch.chdir(tmp_path)
    flags = ["--config", "tiny", "--prompts", "train.jsonl", "--eval-prompts", 4, "--eval-every", 1,
             "--reward", "char_class", "--reward", "my_reward.py:char_count", "--reward-weights", 1, 0.01,
             "--num-prompts", 2, "--group-size", 4, "--save-every", 1]
    assert cli("train.py", *flags, "--iterations", 1, "--run-dir", "run").code == 0
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert cfg["prompts"] == str(tmp_path / "train.jsonl") and cfg["reward"][1] == f"{tmp_path}/my_reward.py:char_count"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = cli("train.py", "--run-dir", tmp_path / "run", "--resume", "--iterations", 2)
    assert r.code == 0, r.err
    assert "resuming" in r.out and "after 1 iterations" in r.out, r.out
    m = json.loads((tmp_path / "run" / "iter_0001" / "metrics.json").read_text())
    assert {"eval/reward/char_class", "eval/reward/char_count"} <= set(m), sorted(m)
    shown = re.search(r"iter +1 .* kl (\S+)", r.out).group(1)                    # 3 significant digits
    assert float(shown) == pytest.approx(m["losses/kl"], rel=5e-3) and m["losses/kl"] > 0, (shown, m["losses/kl"])
