"""Evaluation by sampling (train.py --eval-samples n, python -m grpo.loop.evaluation): pass@k by Chen et
al.'s unbiased estimator against brute-force enumeration, maj@n on hand-made groups, and a run's
logged numbers equal to those recomputed from the answers it wrote."""

import argparse
import itertools
import json
import math

import pytest
import torch

import score
from conftest import cli
from grpo.loop import evaluation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n):
    for c in range(n + 1):
        passes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(passes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_maj_at_n_and_pass_at_k_on_hand_made_groups():
    groups = [0] * 4 + [1] * 4 + [2] * 4
    completions = ["it is 5", "5", "7", "5",            # majority 5, which passes
                   "3", "4", "4", "3",                  # a tie: 3 was drawn first, and fails
                   "1,000", "1000", "x", "y"]           # 1000 twice (the comma dropped), failing
    values = [1, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0, float("nan")]
    m = evaluation.sampled_metrics(groups, completions, values)
    assert m["maj@4"] == pytest.approx(1 / 3)
    # pass@1: 3/4, 2/4, 0/3 (the NaN row left out); pass@4 with n = 3 for the last group is 0
    assert m["pass@1"] == pytest.approx((0.75 + 0.5 + 0.0) / 3)
    assert m["pass@2"] == pytest.approx((1.0 + (1 - 1 / 6) + 0.0) / 3)
    assert m["pass@4"] == pytest.approx((1.0 + 1.0 + 0.0) / 3)
    assert set(m) == {"pass@1", "pass@2", "pass@4", "maj@4"}
    assert evaluation.sampled_metrics([0, 0], ["a", "b"], [float("nan")] * 2) == {}


def test_the_command_reads_a_stage_runs_files(tmp_path):
    samples = [{"group": g, "prompt": "p", "completion": c} for g, c in [(0, "12"), (0, "12"), (0, "13"),
                                                                         (1, "8"), (1, "9"), (1, "9")]]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    exact = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    score.write_rewards(str(tmp_path / "rewards.safetensors"), exact, group_ids, {"exact_answer": exact.clone()},
                        argparse.Namespace())
    r = cli("grpo/loop/evaluation.py", tmp_path)
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["eval/pass@1/exact_answer"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert out["eval/pass@2/exact_answer"] == pytest.approx((1.0 + 2 / 3) / 2)
    assert out["eval/pass@3/exact_answer"] == pytest.approx(1.0)
    assert out["eval/maj@3/exact_answer"] == pytest.approx(0.5)            # 12 passes, 9 does not


def test_a_runs_sampled_evaluation_is_what_its_answers_give(tmp_path):
    run_dir = tmp_path / "run"
    r = cli("train.py", "--config", "tiny", "--iterations", 2, "--eval-every", 2, "--eval-samples", 4,
            "--run-dir", run_dir)
    assert r.code == 0, r.err
    metrics = json.loads((run_dir / "iter_0000" / "metrics.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "eval" / "iter_0000_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * metrics["eval/num_prompts"]
    names = rows[0]["rewards"].keys()
    components = {k: torch.tensor([math.nan if row["rewards"][k] is None else row["rewards"][k] for row in rows])
                  for k in names}
    again = evaluation.sampled_eval([row["group"] for row in rows], [row["completion"] for row in rows], components)
    assert again and all(metrics[k] == pytest.approx(v) for k, v in again.items())
    assert {f"eval/pass@{k}/char_class" for k in (1, 2, 4)} | {"eval/maj@4/char_class"} == set(again)
