"""One source for every setting: train.py's flags are the stages' own, each knob a run is given reaches
the stage that takes it (the stage's recorded arguments, or what the optimizer stepped with), and a
run's defaults that differ from a stage's are listed with a reason."""

import json

import pytest
import torch
from conftest import ROOT, cli
from safetensors import safe_open
from safetensors.torch import load_file

import train
from grpo import settings
from grpo.loop import configs

# A value other than the default for every stage flag train.py exposes. The two runs below take
# them: GRPO's knobs in one run, PPO's in the other, with --ignore-eos (which would leave
# --mask-truncated no row) and LoRA's (not with --fsdp).
GRPO_KNOBS = {
    "group_size": 4, "num_prompts": 3, "max_new_tokens": 6, "temperature": 0.9, "micro_batch_size": 5,
    "prefix_sharing": False, "device": "cpu", "trust_remote_code": True, "top_k": 50, "top_p": 0.95, "min_p": 0.01,
    "reward": ["char_class", "tests/length_reward.py:char_count"], "reward_weights": [1.0, 0.5],
    "overlong_buffer": 2, "length_penalty": 0.1, "on_reward_error": "skip",
    "scale": "batch", "eps": 0.001, "length_strata": 2,
    "lr": 0.002, "lr_schedule": "cosine", "warmup_steps": 1, "beta": 0.02, "clip_eps": 0.3, "clip_eps_high": 0.35,
    "loss_agg": "token", "policy_loss": "dual_clip", "dual_clip": 4.0, "kl_estimator": "k2", "entropy_coef": 0.01,
    "mask_truncated": True, "old_logprobs": "recompute", "ref_logprobs": "rollouts", "allow_mismatch": True, "epochs": 2, "minibatch_size": 6,
    "rollout_is": "tis", "rollout_is_cap": 3.0, "rollout_is_level": "sequence",
    "gradient_checkpointing": True, "max_grad_norm": 0.5, "weight_decay": 0.5, "max_bad_steps": 3, "fsdp": True,
}
PPO_KNOBS = {
    "estimator": "gae", "gamma": 0.9, "lam": 0.8, "kl_in_reward": 0.05, "whiten": False, "critic_lr": 0.001, "critic_epochs": 2,
    "vf_coef": 0.5, "value_clip": 0.3, "ignore_eos": True,
    "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.05, "lora_target_modules": ["q_proj", "v_proj"],
}
# Knobs another test gives a run: --engine vllm starts vLLM, which runs in its own process there; an
# environment's episodes need a task and a reward of their own.
LEARNS_A_TOOL = "tests/test_episodes.py::test_the_tiny_configuration_learns_to_call_a_tool_it_cannot_answer_without"
ELSEWHERE = {"engine": "tests/test_vllm.py::test_train_keeps_one_engine_that_follows_the_updates_and_learns",
             "env": LEARNS_A_TOOL, "max_turns": LEARNS_A_TOOL}
# Where each stage's arguments are recorded in a run folder.
RECORDED = {"sample.py": "iter_0001/rollouts.safetensors", "score.py": "iter_0001/rewards.safetensors",
            "advantage.py": "iter_0001/advantages.safetensors", "update.py": "policy/optimizer.safetensors"}


def flags(knobs):
    argv = []
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def metadata(path, key):
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()[key])


def test_every_knob_train_exposes_is_a_stage_flag_with_a_test_value():
    assert set(train.FLAGS) == set(GRPO_KNOBS) | set(PPO_KNOBS) | set(ELSEWHERE)
    for name, (action, scripts) in train.FLAGS.items():
        for script in scripts:                               # one name, one kind in every stage
            stage_action = next(a for a in train.STAGES[script].build_parser()._actions if a.dest == name)
            assert settings.kind(stage_action) == settings.kind(action), (name, script)
    for name, (value, reason) in configs.RUN_DEFAULTS.items():
        assert name in train.FLAGS and len(reason) > 20, name
    for name, (action, scripts) in train.FLAGS.items():      # stages that disagree need the run's default
        defaults = {repr(a.default) for s in scripts for a in train.STAGES[s].build_parser()._actions
                    if a.dest == name}
        assert len(defaults) == 1 or name in configs.RUN_DEFAULTS, name


@pytest.mark.parametrize("algo, knobs", [("grpo", GRPO_KNOBS), ("ppo", PPO_KNOBS)])
def test_every_knob_reaches_the_stage_that_takes_it(algo, knobs, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)                                   # the reward's path is relative to the repository
    run_dir = tmp_path / "run"
    r = cli("train.py", "--config", "tiny", "--algo", algo, "--iterations", 2, "--eval-every", 0,
            "--run-dir", run_dir, *flags(knobs))
    assert r.code == 0, r.err
    for name, value in configs.absolute_paths(knobs).items():          # a run stores its files' absolute paths
        for script in train.FLAGS[name][1]:
            assert metadata(run_dir / RECORDED[script], "args")[name] == value, (name, script)
    groups = metadata(run_dir / "policy" / "optimizer.safetensors", "param_groups")
    if algo == "grpo":                      # what AdamW stepped with, not only what update.py was told
        assert groups[0]["weight_decay"] == 0.5 and 0 < groups[0]["lr"] < 0.002


def test_weight_decay_changes_the_weights(tmp_path):
    """`--weight-decay` once trained bit-identically to 0: train.py built its own AdamW without it."""
    weights = {}
    for decay in (0.0, 0.5):
        run_dir = tmp_path / f"wd{decay}"
        r = cli("train.py", "--config", "tiny", "--iterations", 2, "--eval-every", 0, "--weight-decay", decay,
                "--run-dir", run_dir)
        assert r.code == 0, r.err
        weights[decay] = load_file(run_dir / "policy" / "model.safetensors")
    # AdamW's decoupled decay takes lr·λ·w off each weight per step: 2 steps at tiny's lr 3e-3 and λ 0.5
    # shrink the final norm's weights (about 1) by about 0.3%; the Adam steps themselves are alike.
    w0, w5 = weights[0.0]["model.norm.weight"], weights[0.5]["model.norm.weight"]
    shrink = ((w0 - w5) / w0).median().item()
    assert 0.5 * 2 * 3e-3 * 0.5 < shrink < 1.5 * 2 * 3e-3 * 0.5, shrink


def test_legitimate_extremes_are_accepted_and_meaningless_combinations_refused(models, rollout_dir, tmp_path):
    """--lr 0 (a frozen control run) and --max-grad-norm inf (no clipping) are settings, not mistakes;
    --eval-prompts 0 is one with --eval-every 0, and a mistake with anything else."""
    from safetensors.torch import save_file

    groups = load_file(rollout_dir / "rollouts.safetensors")["group_ids"]
    save_file({"advantages": torch.linspace(-3, 3, len(groups)), "group_ids": groups},
              str(tmp_path / "advantages.safetensors"))
    r = cli("update.py", "--model", models["policy"], "--rollouts", rollout_dir / "rollouts.safetensors",
            "--advantages", tmp_path / "advantages.safetensors", "--out", tmp_path / "frozen", "--lr", 0,
            "--max-grad-norm", "inf")
    assert r.code == 0, r.err
    before, after = load_file(f"{models['policy']}/model.safetensors"), load_file(tmp_path / "frozen" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "frozen" / "metrics.json").read_text())["grad_norm"] > 0
    assert train.parse_args(["--config", "tiny", "--eval-every", "0", "--eval-prompts", "0",
                             "--run-dir", str(tmp_path / "run")])[1].eval_prompts == 0
    r = cli("train.py", "--config", "tiny", "--eval-prompts", 0, "--run-dir", tmp_path / "run")
    assert r.code == 2 and "--eval-prompts 0 with --eval-every 10" in r.err, r.err
    assert not (tmp_path / "run").exists()
