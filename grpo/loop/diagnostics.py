"""The ways a GRPO run goes wrong, as numbers a run logs every iteration.

Each function takes the tensors an iteration already has and returns plain floats, so that
train.py logs them (iteration_metrics names them for TensorBoard and iter_XXXX/metrics.json) and
a test can feed them a hand-made batch. docs/runs-and-metrics.md says what each means and what to do.

- reward_spread:            is there any signal? within-group reward std, fraction of groups with none
- length_stats:             does the reward prefer length? within-group correlation of length and reward
- diversity:                has the policy found one surface trick? distinct-n, repeated 4-grams, first lines
- collapse_flags:           a jump in any diversity number against the previous iteration
- logprob_mismatch:         do sampler and trainer agree? |log π_θ − log π_old| before any step
- explained_variance:       does PPO's critic predict the returns? 1 − Var(R − V)/Var(R)

reward_spread counts the groups with no signal by grpo/groups.py's one definition of them.
Shapes: N = B·G rows, G per group, T completion length.
"""

from collections import Counter

import torch

from grpo.groups import group_mean_std, no_signal_groups
from grpo.rewards import prompting

# A batch where more than this share of groups has all-equal rewards trains on almost nothing.
NO_SIGNAL_WARN = 0.5
# On-policy, log π_θ and log π_old differ only by float rounding (about 1e-6 in float32 on a CPU,
# 1e-2 in bf16 on a GPU); beyond these the sampler and the trainer compute different things.
MISMATCH_WARN_MEAN, MISMATCH_WARN_MAX = 0.02, 0.5
# On-policy every ratio is 1; above this share of tokens outside the clip band, the rounding between
# sampler and trainer alone clips that share (what a clip does depends on --policy-loss).
CLIP_BAND_WARN = 0.01
# A jump in one iteration that means the completions are collapsing onto one pattern.
DIVERSITY_KEYS = ("distinct_1", "distinct_2", "repeat_4gram", "first_line_share")
COLLAPSE_DISTINCT_DROP = 0.3      # distinct-1 or distinct-2 falls by this share of its previous value
COLLAPSE_RISE = 0.25              # repeat_4gram or first_line_share rises by this much (absolute)


def reward_spread(rewards, group_size, skipped=None):
    """Within-group reward std (Bessel) of each group, over the rows not skipped, summarised.
    rewards [N] -> dict of floats."""
    r = rewards.double().reshape(-1, group_size)                            # [B, G]
    valid = torch.ones_like(r, dtype=torch.bool) if skipped is None else ~skipped.reshape(r.shape)
    zero = no_signal_groups(r, valid)                                       # [B]
    std = group_mean_std(r, valid)[1][:, 0]                                 # [B]
    q = torch.quantile(std, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=std.dtype)).tolist()
    return {"frac_zero_std": zero.double().mean().item(), "std_min": q[0], "std_q25": q[1],
            "std_median": q[2], "std_q75": q[3], "std_max": q[4], "std_mean": std.mean().item(),
            "groups": r.shape[0]}


def iteration_metrics(rollouts, rewards, components, skipped, completions, group_size):
    """The charts/, diag/ and diversity/ numbers of one iteration's batch (docs/runs-and-metrics.md)."""
    lengths = rollouts["completion_mask"].sum(-1)                           # [N]
    spread = reward_spread(rewards, group_size, skipped)
    lengths_vs_reward = length_stats(lengths, rewards, group_size, skipped)
    kept = rewards[~skipped]                                                # [n] rows with a reward
    return {
        "charts/reward_mean": kept.mean().item(),
        "charts/reward_std": kept.std().item() if kept.numel() > 1 else 0.0,
        **{f"charts/reward/{k}": v.nanmean().item() for k, v in components.items()},
        "charts/frac_zero_std": spread["frac_zero_std"],
        "charts/completion_len": lengths.float().mean().item(),
        "charts/truncated_frac": rollouts["truncated"].float().mean().item(),
        "charts/skipped_rewards": int(skipped.sum()),
        "diag/reward_std_mean": spread["std_mean"], "diag/reward_std_median": spread["std_median"],
        **{f"diag/{k}": v for k, v in lengths_vs_reward.items()},
        **{f"diversity/{k}": v for k, v in diversity(
            rollouts["completion_ids"], rollouts["completion_mask"], completions).items()},
    }


# update.py's metrics.json keys that train.py logs outside losses/: the on-policy check (diag/) and how
# well PPO's critic explains the returns (charts/).
ON_POLICY_KEYS = ("logprob_diff_max", "logprob_diff_mean", "ref_logprob_diff_max", "ref_logprob_diff_mean",
                  "outside_clip_on_policy", "skipped_steps", "critic_skipped_steps", "rollout_is_diff_mean",
                  "rollout_is_diff_max", "rollout_is_kl", "rollout_is_beyond_cap", "rollout_is_weight_mean",
                  "rollout_is_weight_max", "rollout_is_weight_beyond_cap")
CHART_KEYS = ("explained_variance",)


def update_metrics(losses):
    """update.py's metrics.json as train.py logs it: diag/KEY for the on-policy check and the skipped
    steps, charts/explained_variance, losses/KEY for everything else."""
    return {(f"diag/{k}" if k in ON_POLICY_KEYS else f"charts/{k}" if k in CHART_KEYS else f"losses/{k}"): v
            for k, v in losses.items()}


def spread_report(spread, group_size, estimator="grpo"):
    """A few lines for the terminal: the distribution of within-group std, and advice when it is flat.
    The batch estimator compares each completion with the whole batch: a flat group is no loss there."""
    batch = estimator == "batch"
    meaning = ("(the batch estimator compares across the batch, so they carry signal all the same)" if batch
               else "(advantage 0, no signal)")
    lines = [f"reward spread over {spread['groups']} groups of G={group_size}: within-group std "
             f"min {spread['std_min']:.3f} / q25 {spread['std_q25']:.3f} / "
             f"median {spread['std_median']:.3f} / q75 {spread['std_q75']:.3f} / "
             f"max {spread['std_max']:.3f}; "
             f"{spread['frac_zero_std']:.0%} of groups have all-equal rewards or fewer than 2 rows with a "
             f"reward {meaning}"]
    if spread["frac_zero_std"] > NO_SIGNAL_WARN and not batch:
        lines.append("WARNING: most groups carry no signal. GRPO learns only from groups whose rewards "
                     "differ: raise G (--group-size), make the task easier or the reward denser (partial "
                     "credit, a format reward), or check that the reward function sees what you think "
                     "(score.py on samples.jsonl).")
    return lines


def length_stats(lengths, rewards, group_size, skipped=None):
    """Mean and std of completion lengths, and the within-group Pearson correlation of length and
    reward: both centred on their group's mean, then correlated over all rows, so a prompt that is
    both long and easy does not count; skipped rows take no part in it. 0 when no group varies in
    both. [N], [N] -> dict"""
    x = lengths.double().reshape(-1, group_size)                            # [B, G]
    y = rewards.double().reshape(-1, group_size)                            # [B, G]
    valid = torch.ones_like(x, dtype=torch.bool) if skipped is None else ~skipped.reshape(x.shape)
    x = torch.where(valid, x - group_mean_std(x, valid)[0], 0.0)           # centred within each group
    y = torch.where(valid, y - group_mean_std(y, valid)[0], 0.0)
    denom = (x.pow(2).sum() * y.pow(2).sum()).sqrt()
    corr = (x * y).sum() / denom if denom > 0 else torch.tensor(0.0)
    return {"length_reward_corr": corr.item(), "len_mean": lengths.double().mean().item(),
            "len_std": lengths.double().std().item() if lengths.numel() > 1 else 0.0}


def diversity(completion_ids, completion_mask, completions):
    """distinct-1/2 (unique n-grams / all n-grams over the batch's tokens), repeat_4gram (share of a
    completion's 4-grams already seen earlier in it, over all 4-grams) and first_line_share (share of
    completions whose first line is the batch's most common one). ids/mask [N, T], completions [N] str."""
    rows = [ids[m].tolist() for ids, m in zip(completion_ids, completion_mask)]
    out = {}
    for n in (1, 2):
        grams = [tuple(r[i:i + n]) for r in rows for i in range(len(r) - n + 1)]
        out[f"distinct_{n}"] = len(set(grams)) / len(grams) if grams else 0.0
    repeats = total = 0
    for r in rows:
        seen = set()
        for i in range(len(r) - 3):
            gram = tuple(r[i:i + 4])
            repeats += gram in seen
            seen.add(gram)
            total += 1
    out["repeat_4gram"] = repeats / total if total else 0.0
    first_lines = Counter(c.strip().split("\n", 1)[0].strip() for c in completions)
    out["first_line_share"] = first_lines.most_common(1)[0][1] / len(completions) if completions else 0.0
    return out


def collapse_flags(metrics, previous):
    """diversity/KEY_drop or diversity/KEY_rise = 1.0 for each diversity number of an iteration's
    metrics (iteration_metrics' names) that jumped since the previous iteration's, and
    diversity/collapse = 1.0 if any did."""
    if previous is None:
        return {"diversity/collapse": 0.0}
    now, before = ({k: m[f"diversity/{k}"] for k in DIVERSITY_KEYS} for m in (metrics, previous))
    flags = {}
    for key in ("distinct_1", "distinct_2"):
        flags[f"diversity/{key}_drop"] = float(now[key] < (1 - COLLAPSE_DISTINCT_DROP) * before[key])
    for key in ("repeat_4gram", "first_line_share"):
        flags[f"diversity/{key}_rise"] = float(now[key] > before[key] + COLLAPSE_RISE)
    flags["diversity/collapse"] = float(any(flags.values()))
    return flags


def collapse_warning(flags, i):
    """The warning for iteration i's collapse_flags."""
    jumped = ", ".join(k[10:] for k, v in flags.items() if v and k != "diversity/collapse")
    return (f"WARNING: iteration {i}: diversity jumped ({jumped}): the policy may be collapsing onto one "
            f"pattern; read iter_{i:04d}/samples.jsonl")


def batch_report(rollouts, rewards, completions, group_size):
    """train.py --check's lines: the reward spread, then reward, length and diversity of the batch."""
    lengths = length_stats(rollouts["completion_mask"].sum(-1), rewards, group_size)
    div = diversity(rollouts["completion_ids"], rollouts["completion_mask"], completions)
    return spread_report(reward_spread(rewards, group_size), group_size) + [
        f"reward mean {rewards.mean().item():.3f}; length mean {lengths['len_mean']:.1f} std "
        f"{lengths['len_std']:.1f}, within-group length-reward correlation "
        f"{lengths['length_reward_corr']:+.2f}; "
        + ", ".join(f"{k} {v:.2f}" for k, v in div.items())]


def logprob_mismatch(logp, old_logp, mask):
    """max and sum of |log π_θ − log π_old| over completion tokens, so that micro-batches and ranks
    can be combined (the mean is the sum over their token count). [n, T] -> (float, float)"""
    diff = (logp.detach() - old_logp).abs()[mask].double()                 # [tokens]
    return diff.max().item(), diff.sum().item()


def rollout_mismatch(rollouts, cap, level="token"):
    """How far the distribution the sampler drew from, q (sampler_logprobs), is from the trainer's
    π_old (old_logprobs), over the tokens the policy drew (policy_tokens, as update.py:training_rows
    names them; an episode's environment turns left out), before any step: mean and max |log π_old −
    log q|, an estimate of KL(q‖π_old), the share of tokens whose weight r = π_old/q lies beyond
    the cap C; and the weight of --rollout-is-level before the cap (r per token, or Π_t r_t per
    completion, as update.py:rollout_is_weights makes it): its mean, max and share beyond C.

    The KL is the mean of log q − log π_old = −log r over the tokens q drew, unbiased whatever E_q[r]
    is. k3 (r − 1 − log r) is not: its mean under q is E_q[r] − 1 + KL, and E_q[r] = 1 only where q
    covers π_old's support. Under top-k/top-p/min-p q = π_old/Z on the kept tokens, so E_q[r] = Z (the
    mass kept) and k3 gives Z − 1 − log Z where the KL is −log Z (tests/test_rollout_is.py)."""
    mask = rollouts.get("policy_tokens", rollouts.get("loss_mask", rollouts["completion_mask"]))    # [N, T]
    x = (rollouts["old_logprobs"] - rollouts["sampler_logprobs"])[mask].double()   # log r, [tokens]
    r = x.clamp(max=20.0).exp()
    log_w = x                                                                        # [tokens]
    if level == "sequence":
        log_r = rollouts["old_logprobs"].double() - rollouts["sampler_logprobs"].double()
        log_w = torch.where(mask, log_r, 0.0).sum(-1)[mask.any(-1)]                 # log w_i, [completions]
    w = log_w.clamp(max=700.0).exp()                       # float64's exp overflows at 709
    return {"rollout_is_diff_mean": x.abs().mean().item(), "rollout_is_diff_max": x.abs().max().item(),
            "rollout_is_kl": (-x).mean().item(), "rollout_is_beyond_cap": (r > cap).double().mean().item(),
            "rollout_is_weight_mean": w.mean().item(), "rollout_is_weight_max": w.max().item(),
            "rollout_is_weight_beyond_cap": (w > cap).double().mean().item()}


def mismatch_warning(max_diff, mean_diff):
    """The warning to print when the first minibatch is not on-policy, or None."""
    if mean_diff <= MISMATCH_WARN_MEAN and max_diff <= MISMATCH_WARN_MAX:
        return None
    return (f"WARNING: before any step |log π_θ − log π_old| is {mean_diff:.3g} on average, "
            f"{max_diff:.3g} at most (on-policy it is ~0): the trainer does not compute what the sampler "
            f"did. Check that --model is the policy that sampled the rollouts, that τ matches the sampling "
            f"temperature, and the dtype/padding.")


def clip_band_warning(fraction, clip_effect):
    """The warning to print when rounding alone puts ratios outside the clip band on-policy, or None;
    `clip_effect` says what the policy loss's clip does to those tokens (update.POLICY_LOSSES)."""
    if fraction <= CLIP_BAND_WARN:
        return None
    return (f"WARNING: before any step {fraction:.1%} of the tokens have a ratio π_θ/π_old outside the "
            f"clip band, so they {clip_effect} although nothing has been learnt yet: the sampler's and "
            f"the update's log-probs differ by rounding. Pass --old-logprobs recompute, or widen --clip-eps.")


K1_WARNING = ("WARNING: --kl-estimator k1 in the loss: its expected gradient on-policy is 0 "
              "(E[∇ log π_θ] = 0), so the penalty adds only noise; k2 follows ∇KL(π_θ‖π_ref), "
              "k3 ∇KL(π_ref‖π_θ).")
BETA_ZERO_WARNING = ("WARNING: β = 0: no KL penalty holds the policy near π_ref. The source article "
                     "saw such runs collapse into repetition within a few updates; watch diversity/ and the "
                     "eval/ comparison with the reference, or set --beta (0.01 is the default) and retune "
                     "--lr with it.")


def penalty_warnings(beta, kl_estimator, kl_in_reward=0.0):
    """The warnings the KL settings call for, printed once by update.py and train.py before any work: β = 0
    (unless PPO's KL sits in the reward instead), and k1 in the loss."""
    return ([BETA_ZERO_WARNING] if beta == 0 and kl_in_reward == 0 else []) + \
        ([K1_WARNING] if kl_estimator == "k1" and beta != 0 else [])


def explained_variance(values, returns, mask):
    """1 − Var(R − V) / Var(R) over the real tokens (mask [N, T]): 1 when the critic's V predicts the
    returns R exactly, 0 when it does no better than their mean, negative when worse. None when the
    returns do not vary (nothing to explain)."""
    V, R = values[mask].double(), returns[mask].double()                    # [tokens]
    if R.numel() < 2 or R.var() == 0:
        return None
    return (1 - (R - V).var() / R.var()).item()


def episode_metrics(samples, records, prefix="env/"):
    """--env's episodes: the policy's turns an episode (env/policy_turns: its assistant messages, 1 for an
    in-line environment) and the mean of each number (or bool) the environment gave (env/NAME, for
    example env/tool_calls), over the rows that have one; nothing for single-turn rows."""
    if not samples or "turns" not in samples[0]:
        return {}
    own = {k for r in records for k in r} | set(prompting.ROW_COLUMNS)
    values = {}
    for s in samples:
        for k, v in s.items():
            if k not in own and type(v) in (int, float, bool):
                values.setdefault(k, []).append(float(v))
    return {f"{prefix}policy_turns": sum(sum(t["role"] == "assistant" for t in s["turns"]) for s in samples) / len(samples),
            **{f"{prefix}{k}": sum(v) / len(v) for k, v in sorted(values.items())}}
