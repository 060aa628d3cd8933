"""Nothing moves without a signal: an iteration whose advantages are all 0 leaves every weight as it was,
to the bit, and logs KL exactly 0, however the update is cut into steps and passes (docs/numerics.md).

log π_ref is computed in each micro-batch by the call that computes log π_θ, so at θ = θ_ref the two are
equal to the bit; when they were computed in different shapes they differed by ~1e-5, and AdamW turned
that into lr-sized steps away from the reference."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, cli
from safetensors.torch import load_file

TINY = ["--config", "tiny", "--iterations", 1, "--eval-every", 0, "--num-prompts", 4, "--group-size", 4,
        "--lr", 5e-2, "--beta", 0.04]
CONSTANT = ["--reward", "tests/rewards_for_tests.py:constant"]


def weights(folder):
    """Every tensor of a checkpoint folder (a model's, or a LoRA adapter's)."""
    name = "adapter_model.safetensors" if os.path.isfile(folder / "adapter_model.safetensors") else "model.safetensors"
    return load_file(folder / name)


def iteration_0(run_dir):
    return json.loads((run_dir / "iter_0000" / "metrics.json").read_text())


def assert_nothing_moved(run_dir, before):
    m = iteration_0(run_dir)
    assert m["charts/frac_zero_std"] == 1.0                       # the premise: no group has any spread
    assert m["losses/kl"] == 0.0 and m["diag/ref_logprob_diff_max"] == 0.0, m
    assert m["losses/grad_norm"] == 0.0 and m["losses/optimizer_steps"] >= 1, m
    after = weights(run_dir / "policy")
    assert after.keys() == before.keys()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert not moved, moved[:5]


SETTINGS = {
    "minibatches of 4, 2 epochs": ["--minibatch-size", 4, "--epochs", 2],
    "micro-batches of 3": ["--micro-batch-size", 3],
    "minibatches of 8, micro-batches of 3, 3 epochs": ["--minibatch-size", 8, "--micro-batch-size", 3, "--epochs", 3],
    "no prefix sharing, minibatches of 4": ["--no-prefix-sharing", "--minibatch-size", 4],
    "gradient checkpointing, minibatches of 4": ["--gradient-checkpointing", "--minibatch-size", 4],
    "π_old recomputed, minibatches of 4": ["--old-logprobs", "recompute", "--minibatch-size", 4, "--epochs", 2],
}


@pytest.mark.parametrize("flags", SETTINGS.values(), ids=SETTINGS.keys())
def test_a_batch_without_signal_moves_no_weight(tmp_path, flags):
    run_dir = tmp_path / "run"
    r = cli("train.py", *TINY, *CONSTANT, *flags, "--run-dir", run_dir)
    assert r.code == 0, r.err
    assert_nothing_moved(run_dir, weights(run_dir / "base_model"))


def test_fresh_lora_adapters_stay_as_they_were_made(tmp_path):
    from argparse import Namespace

    from grpo import lora

    run_dir = tmp_path / "run"
    r = cli("train.py", *TINY, *CONSTANT, "--lora-r", 4, "--lora-dropout", 0.1, "--minibatch-size", 4,
            "--micro-batch-size", 3, "--epochs", 2, "--run-dir", run_dir)
    assert r.code == 0, r.err
    fresh = lora.load_policy(str(run_dir / "base_model"), "cpu", Namespace(
        trust_remote_code=False, lora_r=4, lora_alpha=None, lora_dropout=0.1, lora_target_modules=None))
    made = {k.replace(".default", ""): v for k, v in fresh.state_dict().items() if "lora_" in k}
    assert_nothing_moved(run_dir, made)


def test_ppo_without_signal_moves_neither_policy_nor_critic(tmp_path):
    run_dir = tmp_path / "run"
    r = cli("train.py", *TINY, "--algo", "ppo", "--reward", "tests/rewards_for_tests.py:nothing",
            "--minibatch-size", 4, "--epochs", 2, "--run-dir", run_dir)
    assert r.code == 0, r.err
    assert_nothing_moved(run_dir, weights(run_dir / "base_model"))
    critic_before, critic_after = weights(run_dir / "critic_init"), weights(run_dir / "policy" / "critic")
    assert all(torch.equal(critic_before[k], critic_after[k]) for k in critic_before)


def test_two_processes_under_torchrun_move_nothing(tmp_path):
    run_dir = tmp_path / "run"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    flags = [*TINY, *CONSTANT, "--minibatch-size", 8, "--micro-batch-size", 3, "--epochs", 2, "--run-dir", run_dir]
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "train.py", *map(str, flags)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_nothing_moved(run_dir, weights(run_dir / "base_model"))


def test_update_py_alone_takes_the_rollouts_reference_and_the_files_log_probs_would_drift(models, prompts_file,
                                                                                           tmp_path):
    """By hand: sample.py against a reference that is the policy itself, advantages all 0. update.py
    recomputes log π_ref from the reference the rollouts name, and nothing moves; with the file's own
    ref_logprobs (computed with prefix sharing, the update without it) the rounding difference
    (~5e-7 here) is enough for AdamW to move every weight: the counterfactual that shows the test above
    can fail."""
    from safetensors.torch import save_file

    policy = models["policy"]
    assert cli("sample.py", "--model", policy, "--prompts", prompts_file, "--out", tmp_path, "--group-size", 4,
               "--max-new-tokens", 12, "--ref-model", policy).code == 0
    groups = load_file(tmp_path / "rollouts.safetensors")["group_ids"]
    save_file({"advantages": torch.zeros(len(groups)), "group_ids": groups}, str(tmp_path / "zero.safetensors"))
    before = weights(type(tmp_path)(policy))
    moved = {}
    for mode in ("recompute", "rollouts"):
        r = cli("update.py", "--model", policy, "--rollouts", tmp_path / "rollouts.safetensors", "--advantages",
                tmp_path / "zero.safetensors", "--out", tmp_path / mode, "--lr", 1e-3, "--minibatch-size", 4,
                "--no-prefix-sharing", "--ref-logprobs", mode)
        assert r.code == 0, r.err
        m = json.loads((tmp_path / mode / "metrics.json").read_text())
        after = weights(tmp_path / mode)
        moved[mode] = (m["kl"], m["ref_logprob_diff_max"], sum(not torch.equal(before[k], after[k]) for k in before))
    assert moved["recompute"] == (0.0, 0.0, 0), moved
    kl, diff, tensors = moved["rollouts"]
    assert kl > 0 and 0 < diff < 1e-4 and tensors > len(before) // 2, moved
