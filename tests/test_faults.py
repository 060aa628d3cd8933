"""Faults: a stage killed at any moment leaves the files it was replacing intact; a non-finite step
is skipped rather than written; every stage works through a large batch in micro-batches."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, cli
from safetensors.torch import load_file, save_file

from grpo.cli import StageError
from grpo.disk import checkpoints, files
from grpo.models import builders, loading
from test_update import rollouts_of, run_update


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_when(argv, condition):
    """Start `python argv` and SIGKILL it as soon as `condition()` holds (polled every millisecond), or
    let it finish first; True if it was killed."""
    proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while proc.poll() is None:
        if condition():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.001)
    return False


def kill_at(argv, delay):
    """Start `python argv`, SIGKILL it after `delay` seconds (or let it finish first); True if it was killed."""
    start = time.perf_counter()
    return kill_when(argv, lambda: time.perf_counter() - start > delay)


def test_update_killed_at_any_moment_leaves_a_whole_checkpoint(models, rollout_dir, tmp_path):
    """--out already holds one update's checkpoint; a second update over it is killed at several
    moments. Every time, --out loads and holds either the old checkpoint or the new one, whole."""
    out = tmp_path / "out"
    adv = tmp_path / "adv.safetensors"
    rows = rollouts_of(rollout_dir)["group_ids"].numel()
    save_file({"advantages": torch.linspace(-1, 1, rows), "group_ids": rollouts_of(rollout_dir)["group_ids"]}, str(adv))
    argv = ["update.py", "--model", models["policy"], "--rollouts", rollout_dir / "rollouts.safetensors",
            "--advantages", adv, "--out", out, "--lr", "1e-3"]
    assert cli(*argv).code == 0
    old = load_file(str(out / "model.safetensors"))
    new_dir = tmp_path / "new"
    assert cli(*argv[:-3], new_dir, "--lr", "2e-3").code == 0
    new = load_file(str(new_dir / "model.safetensors"))
    assert not same_tensors(old, new)
    shutil.copytree(out, tmp_path / "old_copy")
    staging = f".{out.name}.grpo-tmp."                        # the folder a checkpoint is written in first

    def writing():
        return any(p.name.startswith(staging) for p in tmp_path.iterdir())

    def weights_written():
        return any(p.name.startswith(staging) and (p / "model.safetensors").exists() for p in tmp_path.iterdir())

    def swapping():
        return any(p.name.startswith(f".{out.name}.grpo-old.") for p in tmp_path.iterdir()) or not out.exists()

    seen, killed = set(), 0
    # Killed while it imports and computes (at 2 s and 4 s; a run takes longer), as soon as it starts
    # writing, once the weights are written, during the swap of the folders (if a poll catches it),
    # and never.
    for when in (lambda: time.perf_counter() - start > 2.0, lambda: time.perf_counter() - start > 4.0,
                 writing, weights_written, swapping, lambda: False):
        shutil.rmtree(out)
        shutil.copytree(tmp_path / "old_copy", out)
        start = time.perf_counter()
        killed += kill_when([*argv[:-1], "2e-3"], when)
        files.recover_dir(str(out))                           # what the next stage run does first
        now = load_file(str(out / "model.safetensors"))
        assert same_tensors(now, old) or same_tensors(now, new), killed
        seen.add("new" if same_tensors(now, new) else "old")
        assert json.load(open(out / "metrics.json"))["optimizer_steps"] >= 1
        load_file(str(out / "optimizer.safetensors"))
    assert killed >= 3 and seen == {"old", "new"}, (killed, seen)   # kills landed mid-run, and a run completed


def test_sample_killed_leaves_the_previous_rollouts(models, prompts_file, tmp_path):
    argv = ["sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", tmp_path,
            "--group-size", 4, "--num-prompts", 4, "--max-new-tokens", 40, "--seed", 1]
    assert cli(*argv).code == 0
    before = {name: open(tmp_path / name, "rb").read() for name in ("rollouts.safetensors", "samples.jsonl")}
    killed = sum(kill_at([*argv[:-1], seed], delay) for seed, delay in ((2, 2.0), (3, 3.0), (4, 4.0)))
    assert killed >= 2
    after = {name: open(tmp_path / name, "rb").read() for name in before}
    rollouts = load_file(str(tmp_path / "rollouts.safetensors"))
    samples = [json.loads(line) for line in after["samples.jsonl"].splitlines()]
    assert len(samples) == rollouts["group_ids"].numel()     # whole, whichever run wrote them
    assert not any(name.endswith(".tmp") or ".tmp." in name for name in os.listdir(tmp_path))
    assert after == before or after["rollouts.safetensors"] != before["rollouts.safetensors"]


def test_non_finite_step_is_skipped_and_counted(models, rollout_dir):
    rollouts = rollouts_of(rollout_dir)
    huge = torch.full((rollouts["group_ids"].numel(),), 3e38)   # finite, but the loss and gradient overflow
    start = loading.load_model(models["policy"], "cpu").state_dict()
    policy, m = run_update(models["policy"], rollouts, huge, minibatch_size=8, max_bad_steps=5)
    assert m["skipped_steps"] == 2 and m["optimizer_steps"] == 0
    _, stepped = run_update(models["policy"], rollouts, torch.zeros_like(huge), minibatch_size=8)
    assert m.keys() == stepped.keys()                          # the same names, none with a value
    counted = {"skipped_steps", "optimizer_steps", "logprob_diff_max", "logprob_diff_mean", "ref_logprob_diff_max",
               "ref_logprob_diff_mean", "outside_clip_on_policy"}
    assert all(m[k] is None for k in stepped.keys() - counted)
    for name, p in policy.state_dict().items():
        assert torch.equal(p, start[name]), name                 # no NaN written, nothing moved
    with pytest.raises(StageError, match="--max-bad-steps 1"):
        run_update(models["policy"], rollouts, huge, minibatch_size=4, max_bad_steps=1)


def test_update_cli_stops_after_max_bad_steps_and_writes_nothing(models, rollout_dir, tmp_path):
    rollouts = rollouts_of(rollout_dir)
    adv = tmp_path / "adv.safetensors"
    save_file({"advantages": torch.full((rollouts["group_ids"].numel(),), 3e38), "group_ids": rollouts["group_ids"]},
              str(adv))
    out = tmp_path / "out"
    r = cli("update.py", "--model", models["policy"], "--rollouts", rollout_dir / "rollouts.safetensors",
            "--advantages", adv, "--out", out, "--minibatch-size", 4, "--max-bad-steps", 2)
    lines = r.err.strip().splitlines()                       # a warning per skipped step, then the error
    assert r.code != 0 and "Traceback" not in r.err and len(lines) == 4
    assert all("optimizer step skipped" in line for line in lines[:3])
    assert "3 optimizer steps" in lines[3] and "--max-bad-steps 2" in lines[3]
    assert not out.exists()


class BatchSizes:
    """Forward pre-hook recording the batch size of every forward pass of a module."""

    def __init__(self, module):
        self.sizes = []
        module.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        self.sizes.append(ids.shape[0])


def test_every_stage_bounds_its_forward_passes_by_micro_batch_size(models, rollout_dir, prompts_file, tmp_path,
                                                                   monkeypatch):
    """32 rows through each stage with --micro-batch-size 5: no forward pass sees more than 5 rows."""
    loaded = []
    real = loading.load_model

    def recording_load(*a, **k):
        model = real(*a, **k)
        loaded.append(BatchSizes(model))
        return model

    monkeypatch.setattr(loading, "load_model", recording_load)
    out = tmp_path / "s"
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", out, "--group-size", 8,
            "--num-prompts", 4, "--max-new-tokens", 12, "--ref-model", models["ref"], "--micro-batch-size", 5)
    assert r.code == 0, r.err
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = builders.char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    rm = tmp_path / "rm"
    checkpoints.save_checkpoint(LlamaForSequenceClassification(config), tok, str(rm))
    r = cli("score.py", "--rollouts", out / "rollouts.safetensors", "--samples", out / "samples.jsonl",
            "--reward", rm, "--out", tmp_path / "r.safetensors", "--micro-batch-size", 5)
    assert r.code == 0, r.err
    r = cli("advantage.py", "--rewards", tmp_path / "r.safetensors", "--out", tmp_path / "a.safetensors")
    assert r.code == 0, r.err
    r = cli("update.py", "--model", models["policy"], "--rollouts", out / "rollouts.safetensors", "--advantages",
            tmp_path / "a.safetensors", "--out", tmp_path / "u", "--micro-batch-size", 5)
    assert r.code == 0, r.err
    assert len(loaded) == 5                 # policy, reference, reward model; update.py's policy and reference
    for hook in loaded:
        assert hook.sizes and max(hook.sizes) <= 5, hook.sizes
        assert sum(hook.sizes) >= 32                           # every row went through (in several passes)
    # train.py: sampling, the reference, the reward model, held-out evaluation (12 prompts) and the update.
    loaded.clear()
    r = cli("train.py", "--config", "tiny", "--iterations", 1, "--micro-batch-size", 5, "--reward", rm,
            "--beta", 0.01, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.err
    assert len(loaded) >= 3                                    # policy, reference, reward model at least
    for hook in loaded:
        assert hook.sizes and max(hook.sizes) <= 5, hook.sizes
