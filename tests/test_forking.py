"""docs/forking.md's registry: an advantage estimator added to --estimator without its branch in
compute_advantages, its place in runs.GROUP_RELATIVE, or its line in the docs fails here."""

import argparse
import os

import pytest
import torch
from conftest import ROOT

import advantage
from grpo import runs
from grpo.cli import StageError

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
    assert refuses_one == (estimator in runs.GROUP_RELATIVE), estimator
    cfg = argparse.Namespace(algo="grpo", estimator=estimator, group_size=1, dynamic_sampling=False,
                             length_strata=1, eval_every=0, eval_prompts=0, critic_warmup=0, rollout_is="none")
    if refuses_one:
        with pytest.raises(StageError, match="G must be at least 2"):
            runs.check_combinations(cfg)
    else:
        runs.check_combinations(cfg)


@pytest.mark.parametrize("estimator", CHOICES)
def test_every_estimator_is_in_the_docs(estimator):
    def page(name):
        return open(os.path.join(ROOT, "docs", name), encoding="utf-8").read()
    row = next(line for line in page("formats.md").splitlines() if line.startswith("| `--estimator` "))
    assert f"{estimator}:" in row, row                            # formats.md's flag table says what it computes
    assert any(f"--estimator {estimator}" in page(name) for name in ("variants.md", "ppo.md")), estimator
