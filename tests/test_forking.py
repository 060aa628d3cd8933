"""docs/forking.md's recipes: an advantage estimator added to --estimator without its branch in
compute_advantages, its place in configs.GROUP_RELATIVE, or its line in the docs fails here; a policy
loss added by the recipe's two steps alone trains."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file, save_file

import advantage
from grpo.cli import StageError
from grpo.loop import configs

CHOICES = next(a.choices for a in advantage.build_parser()._actions if a.dest == "estimator")
GROUP_FREE = [e for e in CHOICES if e != "gae"]             # gae reads a critic's values: tests/test_ppo.py


def advantages(estimator, rewards, group_size):
    args = advantage.parse_args(["--rewards", "r", "--out", "a", "--estimator", estimator])
    group_ids = torch.arange(len(rewards) // group_size).repeat_interleave(group_size)
    return advantage.compute_advantages(torch.tensor(rewards), group_ids, args)["advantages"]


@pytest.mark.parametrize("estimator", GROUP_FREE)
def test_every_estimator_is_computed_and_registered_by_what_it_needs(estimator):
    A = advantages(estimator, [0.0, 1.0, 3.0, 3.0], 2)           # two groups of 2: one with spread, one flat
    assert A.shape == (4,) and torch.isfinite(A).all() and A.abs().sum() > 0, A
    try:
        advantages(estimator, [0.0, 1.0, 3.0, 5.0], 1)
        refuses_one = False
    except StageError:
        refuses_one = True
    assert refuses_one == (estimator in configs.GROUP_RELATIVE), estimator
    cfg = argparse.Namespace(algo="grpo", estimator=estimator, group_size=1, dynamic_sampling=False,
                             length_strata=1, eval_every=0, eval_prompts=0, critic_warmup=0, rollout_is="none",
                             staleness=0, old_logprobs=None)
    if refuses_one:
        with pytest.raises(StageError, match="G must be at least 2"):
            configs.check_combinations(cfg)
    else:
        configs.check_combinations(cfg)


@pytest.mark.parametrize("estimator", CHOICES)
def test_every_estimator_is_in_the_docs(estimator):
    def page(name):
        return open(os.path.join(ROOT, "docs", name), encoding="utf-8").read()
    row = next(line for line in page("formats.md").splitlines() if line.startswith("| `--estimator` "))
    assert f"{estimator}:" in row, row                            # formats.md's flag table says what it computes
    assert any(f"--estimator {estimator}" in page(name) for name in ("variants.md", "ppo.md")), estimator


# ----------------------------------------------------------------------------------------
# A policy loss: docs/forking.md's recipe followed on a copy of update.py, and nothing else

THROWAWAY = '''
def vanilla_pg(logp, old_logp, A, mask, clip):
    """The unclipped surrogate, for the test of docs/forking.md: ℓ_t = −ρ_t·A."""
    ratio = torch.exp(logp - old_logp)                                         # ρ_t [n, T]
    return -ratio * A, ratio, {"low": torch.zeros_like(mask), "high": torch.zeros_like(mask)}


'''


def test_a_policy_loss_is_one_function_and_one_table_entry(models, rollout_dir, tmp_path):
    """Steps 1 and 2 of docs/forking.md's "A policy loss" on a copy of update.py: the function beside
    ppo_clip and one entry of POLICY_LOSSES. The copy takes --policy-loss vanilla_pg and trains with it:
    on-policy (ρ = 1 to rounding) and with β = 0 its loss is −mean(A), the rows' token means averaged."""
    recipe = open(os.path.join(ROOT, "docs", "forking.md")).read().split("## A policy loss")[1].split("\n## ")[0]
    assert "update.py:POLICY_LOSSES" in recipe and "update.py:ppo_clip" in recipe
    source = open(os.path.join(ROOT, "update.py")).read()
    source = source.replace("\ndef ppo_clip(", THROWAWAY + "def ppo_clip(", 1)
    source = source.replace("POLICY_LOSSES = {", 'POLICY_LOSSES = {"vanilla_pg": (vanilla_pg, "are not clipped"), ', 1)
    fork = tmp_path / "fork"
    fork.mkdir()
    (fork / "update.py").write_text(source)
    os.symlink(os.path.join(ROOT, "grpo"), fork / "grpo")
    rollouts = load_file(rollout_dir / "rollouts.safetensors")
    A = torch.linspace(-1.0, 2.0, rollouts["group_ids"].numel())                        # [N]
    save_file({"advantages": A, "group_ids": rollouts["group_ids"]}, str(tmp_path / "advantages.safetensors"))
    r = subprocess.run([sys.executable, str(fork / "update.py"), "--model", models["policy"], "--rollouts",
                        rollout_dir / "rollouts.safetensors", "--advantages", tmp_path / "advantages.safetensors",
                        "--out", tmp_path / "out", "--beta", "0", "--policy-loss", "vanilla_pg"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["loss"] == pytest.approx(-A.mean().item(), abs=1e-5)
    assert metrics["clip_frac"] == 0 and metrics["optimizer_steps"] == 1
