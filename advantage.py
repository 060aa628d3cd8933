"""Stage 3 of GRPO: turn rewards into advantages, relative to each prompt's own group.

GRPO drops PPO's learned critic V(s). The baseline for completion o_i is the mean reward of the
other samples for the same prompt, and the scale is their spread (DeepSeekMath, eq. 4):

    A_i = (r_i − mean(r_group)) / (std(r_group) + ε)        every token of o_i gets A_i

Reads   --rewards FILE  rewards.safetensors: rewards [N] f32, group_ids [N] i64 (lengths [N] i64)
Writes  --out FILE      advantages.safetensors (schema advantages/1; docs/formats.md)
            advantages [N] f32   one value per completion
            group_ids [N] i64    copied through
            group_mean [B] f32, group_std [B] f32, zero_std [B] bool   diagnostics per group
                                 (per stratum, [B·S], with --length-strata S)

Example:
    python advantage.py --rewards it0/rewards.safetensors --out it0/advantages.safetensors \\
        --estimator grpo --eps 1e-4

Conventions (docs/formats.md):
- Groups are the contiguous runs of equal group_ids, all of one size G; rewards are viewed as
  [B, G] and normalised along G only, never over the batch.
- std is Bessel-corrected (divides by G − 1, torch.std's default), so G = 1 is an error.
- A group whose rewards are all equal carries no signal and gets exactly 0, decided explicitly
  by groups.no_signal_groups: a spread max − min of at most 4 float32 ulps of max|r|, so
  float32 residue (0.1 + 0.2 vs 0.3) does not turn into ±0.7 advantages, while rewards 1e6 and
  1e6 + 1 still differ. The fraction of such groups is printed (frac_zero_std).
- Arithmetic is in float64; the file holds float32.

The variants papers compare are --estimator dr_grpo, rloo and batch (--help; docs/variants.md).

PPO's baseline is the other way: --estimator gae --rollouts FILE reads the critic's V_t from the
rollouts' `values` and writes per-token advantages [N, T] and returns [N, T] (GAE, Schulman et al.
2016; see gae_advantages). Groups play no part in it, so G = 1 is allowed.
"""

import argparse

import torch

from grpo import settings
from grpo.cli import ArgumentParser, StageError, run_cli
from grpo.disk import files, outputs, provenance, stage_inputs
from grpo.groups import group_mean_std, no_signal_groups
from grpo.settings import at_least, between


# ----------------------------------------------------------------------------------------
# The algorithm: advantages within each prompt's group, its variants, and PPO's GAE

def group_rewards(rewards, group_ids, path="group_ids", skipped=None):
    """View rewards [N] as [B, G], one row per prompt's group; returns (r [B, G], valid [B, G]), valid
    false on the rows score.py skipped (no reward applied to them)."""
    B, G = files.group_shape(group_ids, path)
    if G < 2:
        raise StageError(f"{path}: every group has G = 1 completion; a group-relative advantage needs "
                         f"G ≥ 2 (sample with --group-size 2 or more)")
    valid = torch.ones(B, G, dtype=torch.bool) if skipped is None else ~skipped.bool().reshape(B, G)
    return rewards.double().reshape(B, G), valid


def grpo_advantages(rewards, group_ids, eps=1e-4, scale="group", skipped=None):
    """A_i = (r_i − mean) / (std + ε) within each group; exactly 0 for all-equal groups. [N] -> [N]
    `scale`: std is the group's (DeepSeekMath), the whole batch's ("batch"), or 1 with no ε ("none").
    Skipped rows get 0 and count in no mean or std (so do dr_grpo, rloo and batch below)."""
    r, valid = group_rewards(rewards, group_ids, skipped=skipped)            # [B, G]
    mean, std = group_mean_std(r, valid)                                    # [B, 1]
    if scale == "group":
        denominator = std + eps                                             # [B, 1] Bessel-corrected
    elif scale == "batch":
        denominator = r[valid].std() + eps                                  # [] over all valid rewards
    else:
        denominator = 1.0
    A = torch.where(no_signal_groups(r, valid)[:, None] | ~valid, 0.0, (r - mean) / denominator)   # [B, G]
    return A.flatten().float()


def dr_grpo_advantages(rewards, group_ids, skipped=None):
    """A_i = r_i − mean (Dr. GRPO: no std division, so easy and hard prompts weigh alike). [N] -> [N]"""
    r, valid = group_rewards(rewards, group_ids, skipped=skipped)            # [B, G]
    mean, _ = group_mean_std(r, valid)                                      # [B, 1]
    A = torch.where(no_signal_groups(r, valid)[:, None] | ~valid, 0.0, r - mean)   # [B, G]
    return A.flatten().float()


def rloo_advantages(rewards, group_ids, skipped=None):
    """A_i = r_i − (Σ_{j≠i} r_j) / (G − 1), the leave-one-out baseline (RLOO). [N] -> [N]"""
    r, valid = group_rewards(rewards, group_ids, skipped=skipped)            # [B, G]
    n = valid.sum(-1, keepdim=True)                                         # [B, 1] G without skipped rows
    baseline = (torch.where(valid, r, 0.0).sum(-1, keepdim=True) - r) / (n - 1).clamp(min=1)   # [B, G]
    A = torch.where(no_signal_groups(r, valid)[:, None] | ~valid, 0.0, r - baseline)   # [B, G]
    return A.flatten().float()


def batch_advantages(rewards, eps=1e-4, skipped=None):
    """A_i = (r_i − mean(r)) / (std(r) + ε) over all N rows. An ablation: a prompt that is easy for
    every sample now pushes all of them up, and hard prompts push theirs down, whatever their merit."""
    r = rewards.double()                                                    # [N]
    valid = torch.ones_like(r, dtype=torch.bool) if skipped is None else ~skipped.bool()   # [N]
    if no_signal_groups(r[None], valid[None])[0]:
        return torch.zeros_like(rewards)
    return torch.where(valid, (r - r[valid].mean()) / (r[valid].std() + eps), 0.0).float()


# Whitening divides by sqrt(var + this), as TRL's masked_whiten does: std 1 to float precision, and an
# all-equal batch of advantages comes out as zeros rather than NaN.
WHITEN_EPS = 1e-8


def gae_advantages(rewards, values, mask, gamma, lam, kl_per_token=None, whiten=True, skipped=None):
    """Generalised advantage estimation (Schulman et al. 2016) over each completion's tokens.

    rewards [N] (r_i, given to the last real token), values [N, T] (V_t), mask [N, T] (the policy's
    tokens: a prefix of true per row, or an episode's policy turns with the environment's between),
    kl_per_token [N, T] (β_r·(log π_old − log π_ref), taken from every token's reward).
        r_t = −kl_t, plus r_i at the last real token
        δ_t = r_t + γ·V_{t+1} − V_t         with V = 0 after the last real token
        A_t = Σ_l (γλ)^l δ_{t+l} = δ_t + γλ·A_{t+1}
        R_t = A_t + V_t                      the critic's target, before whitening
    where t + 1 is the policy's next token: the environment's tokens are skipped (the policy did not
    choose them), so an episode's advantages are those of its policy tokens laid end to end.
    Returns (A [N, T], R [N, T]), float32, 0 where the mask is false; with `whiten`, A is shifted and
    scaled over all real tokens of the batch to mean 0 and std 1 (Bessel), R is not. Skipped rows
    ([N] bool, no reward applied) get A = 0 and R = V, and take no part in the whitening.
    """
    N, T = mask.shape
    last = T - 1 - mask.flip(-1).int().argmax(-1)                           # [N] the last policy token
    V = torch.where(mask, values.double(), 0.0)                             # [N, T]
    r = torch.zeros(N, T, dtype=torch.float64)                              # [N, T] token rewards
    r[torch.arange(N), last] = rewards.double()
    if kl_per_token is not None:
        r = r - torch.where(mask, kl_per_token.double(), 0.0)
    A = torch.zeros(N, T, dtype=torch.float64)                              # [N, T]
    next_A = next_V = torch.zeros(N, dtype=torch.float64)                   # A_{t+1}, V_{t+1}     [N]
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_V - V[:, t]                          # δ_t                  [N]
        A[:, t] = torch.where(mask[:, t], delta + gamma * lam * next_A, 0.0)
        next_A = torch.where(mask[:, t], A[:, t], next_A)                   # an environment token passes
        next_V = torch.where(mask[:, t], V[:, t], next_V)                   # A and V on unchanged
    if skipped is not None:
        mask = mask & ~skipped.bool()[:, None]                              # [N, T] rows with a reward
        A = torch.where(mask, A, 0.0)
    R = A + V                                                               # [N, T]: V on skipped rows
    if whiten:
        real = A[mask]                                                      # [tokens]
        centred = A - real.mean()
        A = centred / torch.sqrt(real.var() + WHITEN_EPS) if real.numel() > 1 else centred
        A = torch.where(mask, A, 0.0)
    return A.float(), R.float()


def length_strata(group_ids, lengths, strata, path="rewards"):
    """Regroup each prompt's G rows into `strata` groups of G/S rows of similar length.

    Returns (order [N], strata_ids [N]): rows `order` of the batch, in which each stratum is
    contiguous, and the stratum id of each of them (prompt b's strata are b·S .. b·S + S − 1).
    """
    B, G = files.group_shape(group_ids, path)
    if G % strata or G // strata < 2:
        raise StageError(f"--length-strata {strata}: each group's G = {G} rows must split into strata of "
                         f"equal size of at least 2 (S must divide G and be at most G/2)")
    by_length = torch.argsort(lengths.reshape(B, G), dim=-1, stable=True)           # [B, G] shortest first
    order = (by_length + torch.arange(B)[:, None] * G).flatten()                    # [N]
    strata_ids = torch.arange(B * strata).repeat_interleave(G // strata)             # [N]
    return order, strata_ids


# ----------------------------------------------------------------------------------------
# The estimator chosen by the flags

def group_stats(rewards, group_ids, skipped=None):
    """Per-group diagnostics over the rows not skipped: group_mean [B], group_std [B] (Bessel), zero_std
    [B] bool (no signal: all-equal rewards, or fewer than 2 rows)."""
    r, valid = group_rewards(rewards, group_ids, skipped=skipped)            # [B, G]
    mean, std = group_mean_std(r, valid)                                    # [B, 1]
    return {"group_mean": mean[:, 0].float(), "group_std": std[:, 0].float(),
            "zero_std": no_signal_groups(r, valid)}


def compute_advantages(rewards, group_ids, args, lengths=None, rollouts=None, skipped=None):
    """The advantages file's tensors for args.estimator (within length strata with --length-strata);
    gae reads the critic's values, the mask and the log-probs from `rollouts`. Rows `skipped` [N] (no
    reward applied) get advantage 0 and take no part in any mean or std."""
    if args.estimator == "gae":
        kl = None
        if args.kl_in_reward != 0:
            kl = args.kl_in_reward * (rollouts["old_logprobs"] - rollouts["ref_logprobs"])    # [N, T]
        policy = rollouts.get("loss_mask", rollouts["completion_mask"])      # an episode: the policy's turns
        A, R = gae_advantages(rewards, rollouts["values"], policy, args.gamma, args.lam, kl, args.whiten, skipped)
        return {"advantages": A, "returns": R, "group_ids": group_ids}
    if args.length_strata > 1:
        order, strata_ids = length_strata(group_ids, lengths, args.length_strata)
        whole_groups = argparse.Namespace(**{**vars(args), "length_strata": 1})
        inner = compute_advantages(rewards[order], strata_ids, whole_groups,
                                   skipped=None if skipped is None else skipped[order])
        A = torch.empty_like(inner["advantages"])
        A[order] = inner["advantages"]                                  # back to the file's row order
        return {**inner, "advantages": A, "group_ids": group_ids}
    if args.estimator == "grpo":
        A = grpo_advantages(rewards, group_ids, args.eps, args.scale, skipped)
    elif args.estimator == "dr_grpo":
        A = dr_grpo_advantages(rewards, group_ids, skipped)
    elif args.estimator == "rloo":
        A = rloo_advantages(rewards, group_ids, skipped)
    elif args.estimator == "batch":
        A = batch_advantages(rewards, args.eps, skipped)
        if files.group_shape(group_ids, "group_ids")[1] < 2:                     # no groups to describe
            return {"advantages": A, "group_ids": group_ids}
    return {"advantages": A, "group_ids": group_ids, **group_stats(rewards, group_ids, skipped)}


# ----------------------------------------------------------------------------------------
# The command line

def build_parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rewards", required=True, help="rewards.safetensors from score.py")
    p.add_argument("--out", required=True, help="output advantages.safetensors")
    p.add_argument("--estimator", default="grpo", choices=["grpo", "dr_grpo", "rloo", "batch", "gae"],
                   help="grpo: A = (r − mean)/(std + ε) per group (DeepSeekMath, default)\n"
                        "dr_grpo: A = r − mean, no std (Dr. GRPO, Liu et al. 2025)\n"
                        "rloo: A_i = r_i − mean of the other G−1 rewards (RLOO, Ahmadian et al. 2024)\n"
                        "batch: ABLATION ONLY, one z-score over the whole batch, ignoring groups (mean\n"
                        "  and std of all N; TRL's scale_rewards='batch' keeps the group mean: that is\n"
                        "  --scale batch); the source article calls this the most serious error a GRPO\n"
                        "  implementation can make\n"
                        "gae: PPO's per-token A_t from the critic's V_t (needs --rollouts with 'values')")
    p.add_argument("--scale", default="group", choices=["group", "batch", "none"],
                   help="what grpo divides r − group mean by (TRL's scale_rewards): the group's std\n"
                        "(default), the whole batch's std, or nothing (then grpo is dr_grpo)")
    p.add_argument("--eps", type=float, default=1e-4, help="ε in std + ε, grpo and batch (default 1e-4)")
    p.add_argument("--length-strata", type=int, default=1, metavar="S",
                   help="S: split each prompt's G completions by length into S strata of G/S\n"
                        "(shortest first) and compute the estimator within each, so that a completion\n"
                        "competes only with others of similar length (the source article's remedy for\n"
                        "length bias; needs 'lengths' in the rewards file; default 1: the whole group)")
    p.add_argument("--rollouts", default=None, help="gae: rollouts.safetensors (values, masks, log-probs)")
    p.add_argument("--gamma", type=float, default=1.0, help="γ: gae's discount per token (default 1)")
    p.add_argument("--lam", type=float, default=0.95, help="λ: gae's bias-variance trade-off (default 0.95)")
    p.add_argument("--kl-in-reward", type=float, default=0.0, metavar="β_r",
                   help="gae: every token's reward gets −β_r·(log π_old − log π_ref), the k1\n"
                        "estimator (in the reward it is the KL's own estimate; default 0: the KL stays in\n"
                        "the loss)")
    p.add_argument("--whiten", action=argparse.BooleanOptionalAction, default=None,
                   help="gae: normalise A over the batch's real tokens to mean 0, std 1 (default on)")
    provenance.add_flag(p)
    return p


# What each setting may be, checked before anything is read or written (train.py's runs too).
RULES = {"eps": at_least(0), "length_strata": at_least(1), "gamma": between(0, 1), "lam": between(0, 1),
         "kl_in_reward": at_least(0)}


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    settings.check(args, RULES)
    if args.scale != "group" and args.estimator != "grpo":
        raise StageError(f"--scale {args.scale} applies to --estimator grpo, not {args.estimator}")
    gae_only = {"--rollouts": args.rollouts is not None, "--whiten": args.whiten is not None,
                "--kl-in-reward": args.kl_in_reward != 0}
    if args.estimator != "gae":
        given = [flag for flag, is_given in gae_only.items() if is_given]
        if given:
            raise StageError(f"{', '.join(given)} applies to --estimator gae, not {args.estimator}")
        return args
    if args.rollouts is None:
        raise StageError("--estimator gae needs --rollouts FILE: the critic's values and the masks")
    if args.length_strata > 1:
        raise StageError("--length-strata splits groups, and --estimator gae uses none")
    args.whiten = args.whiten is not False
    return args


def main(argv=None):
    args = parse_args(argv)
    outputs.check_file(args.out, "advantage.py", files.ADVANTAGES[0], (args.rewards, args.rollouts))
    data, _, _ = files.load_tensors(args.rewards, files.REWARDS)
    made_from = provenance.rewards_of_rollouts(args.rewards, args.rollouts, args.allow_mismatch)
    rollouts = None
    if args.estimator == "gae":                                           # groups play no part
        rollouts = stage_inputs.gae_rollouts(args.rollouts, args.rewards, data, args.kl_in_reward)
    elif args.estimator == "batch":                                       # groups are only described:
        files.group_shape(data["group_ids"], args.rewards)                # G = 1 is allowed
    else:
        group_rewards(data["rewards"], data["group_ids"], args.rewards)
    if args.length_strata > 1 and "lengths" not in data:
        raise StageError(f"{args.rewards}: --length-strata needs the 'lengths' key, which score.py writes")
    tensors = compute_advantages(data["rewards"], data["group_ids"], args, data.get("lengths"), rollouts,
                                 data.get("skipped"))
    files.save_tensors(args.out, tensors, files.ADVANTAGES[0], vars(args), made_from=made_from)
    if rollouts is not None:
        mask = rollouts.get("loss_mask", rollouts["completion_mask"])             # the policy's tokens [N, T]
        print(f"gae advantages for {mask.sum().item()} tokens of {mask.shape[0]} completions "
              f"(γ {args.gamma}, λ {args.lam}{', whitened' if args.whiten else ''}): mean return at the first "
              f"token {tensors['returns'][:, 0].mean().item():.4f}; wrote {args.out}")
        return
    zero = tensors.get("zero_std", torch.zeros(0, dtype=torch.bool))                    # [B]
    print(f"{args.estimator} advantages for {data['rewards'].numel()} completions in {zero.numel()} groups: "
          f"frac_zero_std {zero.float().mean().item() if zero.numel() else 0:.3f} ({int(zero.sum())} groups "
          f"with all-equal rewards{' get 0' if args.estimator != 'batch' else ''}); wrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
