"""Statistics within each prompt's group of G completions, the numbers the group-relative advantage
is made of, shared by advantage.py, the run's diagnostics and dynamic sampling.

no_signal_groups is the one definition of a group with no signal (all its valid rewards equal, by
all_equal_groups, or fewer than 2 rows that score.py did not skip): advantage.py gives such groups
exactly 0, and diagnostics.reward_spread counts them. Shapes [B, G]: B groups of G rows.
"""

import math

import torch


# Rewards this close (in float32 ulps of the group's largest |r|) are one value: float32 residue
# (0.1 + 0.2 vs 0.3) is not a spread, while 1e6 and 1e6 + 1 still differ.
ZERO_SPREAD_RTOL = 4 * torch.finfo(torch.float32).eps


def all_equal_groups(r, valid=None):
    """True for groups whose rewards are all equal up to float rounding, counting only the `valid`
    rows [B, G] when given (a group with none is all equal). r [B, G] -> [B]"""
    if valid is None:
        valid = torch.ones_like(r, dtype=torch.bool)
    spread = r.masked_fill(~valid, -math.inf).max(-1).values - r.masked_fill(~valid, math.inf).min(-1).values
    return spread <= ZERO_SPREAD_RTOL * r.abs().masked_fill(~valid, 0.0).max(-1).values     # [B]


def group_mean_std(r, valid):
    """Each group's mean [B, 1] and Bessel-corrected std [B, 1] over its valid rows. r, valid [B, G]"""
    n = valid.sum(-1, keepdim=True)                                         # [B, 1]
    mean = torch.where(valid, r, 0.0).sum(-1, keepdim=True) / n.clamp(min=1)
    var = torch.where(valid, (r - mean) ** 2, 0.0).sum(-1, keepdim=True) / (n - 1).clamp(min=1)
    return mean, var.sqrt()


def no_signal_groups(r, valid):
    """Groups whose advantages are exactly 0: all valid rewards equal, or fewer than 2 valid rows (rows
    score.py skipped are not valid). r, valid [B, G] -> [B]"""
    return all_equal_groups(r, valid) | (valid.sum(-1) < 2)
