"""advantage.py: hand-computed vectors, invariants, and the conventions of docs/formats.md."""

import math
import os

import pytest
import torch
from conftest import assert_user_error, cli
from safetensors.torch import load_file, save_file

import advantage
from grpo.disk import files

# Three groups of G = 4: one with spread, one all-equal, one skewed.
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


def write_rewards(path, rewards=REWARDS, group_ids=GROUPS, **extra):
    tensors = {"rewards": torch.tensor(rewards, dtype=torch.float32),
               "group_ids": torch.tensor(group_ids, dtype=torch.int64), **extra}
    save_file(tensors, str(path), metadata={"schema": "rewards/1", "args": "{}"})
    return str(path)


def test_grpo_hand_vector(tmp_path):
    # Group 0: mean 0.5, Bessel std sqrt(4·0.25/3) = sqrt(1/3). Group 2: mean 0.75,
    # Bessel var (3·0.5625 + 5.0625)/3 = 2.25, std 1.5. Group 1 is all-equal: exactly 0.
    eps = 1e-4
    a0 = 0.5 / (math.sqrt(1 / 3) + eps)
    expected = [a0, -a0, -a0, a0, 0, 0, 0, 0, -0.75 / 1.5001, -0.75 / 1.5001, -0.75 / 1.5001, 2.25 / 1.5001]
    r = cli("advantage.py", "--rewards", write_rewards(tmp_path / "r.safetensors"),
            "--out", tmp_path / "a.safetensors", "--estimator", "grpo", "--eps", eps)
    assert r.code == 0, r.err
    assert "frac_zero_std 0.333" in r.out
    out = load_file(tmp_path / "a.safetensors")
    assert out["advantages"].dtype == torch.float32 and out["advantages"].shape == (12,)
    torch.testing.assert_close(out["advantages"], torch.tensor(expected), rtol=0, atol=1e-6)
    assert torch.equal(out["group_ids"], torch.tensor(GROUPS))
    assert out["zero_std"].tolist() == [False, True, False]
    torch.testing.assert_close(out["group_mean"], torch.tensor([0.5, 2.0, 0.75]))
    torch.testing.assert_close(out["group_std"], torch.tensor([math.sqrt(1 / 3), 0.0, 1.5]))


def test_dr_grpo_and_rloo_hand_vectors(tmp_path):
    rewards, groups = torch.tensor(REWARDS), torch.tensor(GROUPS)
    dr = advantage.dr_grpo_advantages(rewards, groups)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.75, -0.75, -0.75, 2.25]))
    # RLOO, group 2: a zero's baseline is (0 + 0 + 3)/3 = 1; the three's baseline is 0.
    rloo = advantage.rloo_advantages(rewards, groups)
    torch.testing.assert_close(rloo, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, -1, -1, -1, 3.0]))
    r = cli("advantage.py", "--rewards", write_rewards(tmp_path / "r.safetensors"),
            "--out", tmp_path / "a.safetensors", "--estimator", "rloo")
    assert r.code == 0, r.err
    torch.testing.assert_close(load_file(tmp_path / "a.safetensors")["advantages"], rloo)


def test_all_equal_group_is_exactly_zero_despite_float_residue():
    x = torch.tensor(0.3, dtype=torch.float32)
    next_up = torch.nextafter(x, torch.tensor(1.0))                  # differs from 0.3 in the last bit
    rewards = torch.stack([x, next_up, x, x, torch.tensor(0.0), torch.tensor(1.0), x, x])
    groups = torch.tensor([0] * 4 + [1] * 4)
    A = advantage.grpo_advantages(rewards, groups, eps=0.0)
    assert torch.equal(A[:4], torch.zeros(4))                         # exactly 0, not ±0.87
    assert advantage.group_stats(rewards, groups)["zero_std"].tolist() == [True, False]
    # Large rewards that differ by one are not "equal": the tolerance is a few ulps, not 1e-6 relative.
    big = advantage.grpo_advantages(torch.tensor([1e6, 1e6 + 1, 1e6, 1e6 + 1]), torch.tensor([0, 0, 0, 0]))
    assert big.abs().min() > 0.8
    assert A[4:].abs().sum() > 1


def test_invariants_zero_mean_permutation_affine():
    torch.manual_seed(0)
    B, G = 6, 5
    rewards = torch.randn(B * G)
    groups = torch.arange(B).repeat_interleave(G)
    A = advantage.grpo_advantages(rewards, groups, eps=1e-4)
    # Each group's advantages sum to zero; the batch's normalisation never mixes groups.
    torch.testing.assert_close(A.reshape(B, G).sum(-1), torch.zeros(B), atol=1e-5, rtol=0)
    # Permuting rows inside each group permutes the advantages the same way.
    perm = torch.cat([torch.randperm(G) + b * G for b in range(B)])
    A_perm = advantage.grpo_advantages(rewards[perm], groups, eps=1e-4)
    torch.testing.assert_close(A_perm, A[perm])
    # Moving one group's rewards leaves the other groups' advantages alone.
    shifted = rewards.clone()
    shifted[:G] += 100.0
    A_shift = advantage.grpo_advantages(shifted, groups, eps=1e-4)
    torch.testing.assert_close(A_shift, A, atol=1e-5, rtol=0)
    # z-scores are invariant to r -> a·r + b (a > 0); with ε = 0 exactly, with ε within ε's effect.
    A0 = advantage.grpo_advantages(rewards, groups, eps=0.0)
    A_aff = advantage.grpo_advantages(3.0 * rewards - 7.0, groups, eps=0.0)
    torch.testing.assert_close(A_aff, A0, atol=1e-5, rtol=0)


def test_group_size_one_is_an_error(tmp_path):
    out = tmp_path / "a.safetensors"
    r = cli("advantage.py", "--rewards", write_rewards(tmp_path / "r.safetensors", [1.0, 2.0], [0, 1]), "--out", out)
    assert_user_error(r, "r.safetensors", "G = 1")
    assert not out.exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_names_the_rows(tmp_path, bad):
    rewards = list(REWARDS)
    rewards[5] = bad
    out = tmp_path / "a.safetensors"
    r = cli("advantage.py", "--rewards", write_rewards(tmp_path / "r.safetensors", rewards), "--out", out)
    assert_user_error(r, "r.safetensors", "rewards", "rows 5")
    assert not out.exists()


def test_bad_files(tmp_path):
    out = tmp_path / "a.safetensors"
    missing = cli("advantage.py", "--rewards", tmp_path / "nope.safetensors", "--out", out)
    assert_user_error(missing, "nope.safetensors", "no such file")

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file")
    assert_user_error(cli("advantage.py", "--rewards", garbage, "--out", out), "garbage.safetensors", "not a readable")

    good = write_rewards(tmp_path / "good.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(open(good, "rb").read()[:-10])
    assert_user_error(cli("advantage.py", "--rewards", truncated, "--out", out), "truncated.safetensors")

    save_file({"rewards": torch.zeros(4)}, str(tmp_path / "nogroups.safetensors"))
    assert_user_error(cli("advantage.py", "--rewards", tmp_path / "nogroups.safetensors", "--out", out),
                      "missing key 'group_ids'")

    save_file({"rewards": torch.zeros(4, dtype=torch.float64), "group_ids": torch.zeros(4, dtype=torch.int64)},
              str(tmp_path / "f64.safetensors"))
    assert_user_error(cli("advantage.py", "--rewards", tmp_path / "f64.safetensors", "--out", out),
                      "'rewards' has dtype float64, expected float32")

    save_file({"rewards": torch.zeros(4), "group_ids": torch.zeros(3, dtype=torch.int64)},
              str(tmp_path / "shape.safetensors"))
    assert_user_error(cli("advantage.py", "--rewards", tmp_path / "shape.safetensors", "--out", out),
                      "'group_ids' has shape [3]")

    split = write_rewards(tmp_path / "split.safetensors", [0.0, 1.0, 0.0, 1.0], [0, 1, 0, 1])
    assert_user_error(cli("advantage.py", "--rewards", split, "--out", out), "not contiguous")

    uneven = write_rewards(tmp_path / "uneven.safetensors", [0.0, 1.0, 0.0, 1.0, 2.0], [0, 0, 1, 1, 1])
    assert_user_error(cli("advantage.py", "--rewards", uneven, "--out", out), "unequal sizes")
    assert not out.exists()
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_bad_flags_and_empty_input(tmp_path):
    rewards = write_rewards(tmp_path / "r.safetensors")
    out = tmp_path / "a.safetensors"
    for eps in ("-0.5", "nan", "inf"):
        assert_user_error(cli("advantage.py", "--rewards", rewards, "--out", out, "--eps", eps), "--eps")
    assert_user_error(cli("advantage.py", "--rewards", rewards, "--out", out, "--estimator", "ppo"), "--estimator")
    assert_user_error(cli("advantage.py", "--rewards", rewards), "--out")
    empty = write_rewards(tmp_path / "empty.safetensors", [], [])
    assert_user_error(cli("advantage.py", "--rewards", empty, "--out", out), "empty.safetensors", "no rows")
    assert not out.exists()
    # An --out folder that does not exist yet is created.
    nested = tmp_path / "new" / "dir" / "a.safetensors"
    assert cli("advantage.py", "--rewards", rewards, "--out", nested).code == 0 and nested.exists()


def test_file_metadata_holds_schema_and_args(tmp_path):
    out = tmp_path / "a.safetensors"
    assert cli("advantage.py", "--rewards", write_rewards(tmp_path / "r.safetensors"), "--out", out).code == 0
    _, args, dims = files.load_tensors(str(out), files.ADVANTAGES)
    assert args["estimator"] == "grpo" and args["eps"] == 1e-4
    assert dims["N"] == 12


# Rows score.py skipped (no reward applied to them) carry reward 0 in the file and `skipped` true.
SKIP_REWARDS = [1.0, 0.0, 0.0, 3.0, 0.0, 7.0, 7.0, 7.0, 2.0, 4.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0]
SKIPPED = [False, False, True, False, True, False, False, False, False, False, True, True,
           False, True, True, True]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_skipped_rows_get_zero_and_stay_out_of_the_group_statistics(tmp_path, estimator):
    """Group 0 has the valid rewards 1, 0, 3 (mean 4/3, Bessel std sqrt(7/3)); group 1's valid rows are
    all 7 (no signal); group 2 has 2, 4 (mean 3, std sqrt 2); group 3 has one valid row (no signal)."""
    path = write_rewards(tmp_path / "r.safetensors", SKIP_REWARDS, [g for g in range(4) for _ in range(4)],
                         skipped=torch.tensor(SKIPPED))
    assert cli("advantage.py", "--rewards", path, "--out", tmp_path / "a.safetensors",
               "--estimator", estimator).code == 0
    got = load_file(tmp_path / "a.safetensors")
    eps = 1e-4
    s0, s2 = math.sqrt(7 / 3), math.sqrt(2)
    expected = {
        "grpo": [(1 - 4 / 3) / (s0 + eps), (0 - 4 / 3) / (s0 + eps), 0, (3 - 4 / 3) / (s0 + eps), 0, 0, 0, 0,
                 -1 / (s2 + eps), 1 / (s2 + eps), 0, 0, 0, 0, 0, 0],
        "dr_grpo": [1 - 4 / 3, -4 / 3, 0, 3 - 4 / 3, 0, 0, 0, 0, -1, 1, 0, 0, 0, 0, 0, 0],
        # leave-one-out over the valid rows: row 0's baseline is (0 + 3)/2
        "rloo": [1 - 1.5, 0 - 2.0, 0, 3 - 0.5, 0, 0, 0, 0, -2, 2, 0, 0, 0, 0, 0, 0],
    }[estimator]
    torch.testing.assert_close(got["advantages"], torch.tensor(expected), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["group_mean"], torch.tensor([4 / 3, 7, 3, 9]))
    torch.testing.assert_close(got["group_std"], torch.tensor([s0, 0, s2, 0]))
    assert got["zero_std"].tolist() == [False, True, False, True]


def test_skipped_rows_stay_out_of_batch_statistics():
    rewards, skipped = torch.tensor([1.0, 100.0, 3.0, 5.0]), torch.tensor([False, True, False, False])
    A = advantage.batch_advantages(rewards, eps=0.0, skipped=skipped)
    torch.testing.assert_close(A, torch.tensor([-1.0, 0.0, 0.0, 1.0]))     # mean 3, std 2 over 1, 3, 5
    A = advantage.grpo_advantages(torch.tensor([1.0, 100.0, 3.0, 5.0, 0.0, 4.0, 0.0, 0.0]),
                                  torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), eps=0.0, scale="batch",
                                  skipped=torch.tensor([False, True, False, False, False, False, True, True]))
    # --scale batch: the valid rewards 1, 3, 5, 0, 4 have mean 2.6 and Bessel std sqrt(17.2 / 4)
    torch.testing.assert_close(A, torch.tensor([-2.0, 0, 0, 2, -2, 2, 0, 0]) / math.sqrt(4.3))


def test_skipped_rows_take_no_part_in_gae():
    mask = torch.ones(2, 3, dtype=torch.bool)
    values = torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.3, 0.4]])
    A, R = advantage.gae_advantages(torch.tensor([1.0, 0.0]), values, mask, 1.0, 1.0, whiten=False,
                                    skipped=torch.tensor([False, True]))
    torch.testing.assert_close(A, torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(R, torch.tensor([[1.0, 1.0, 1.0], [0.2, 0.3, 0.4]]))     # R = V there
