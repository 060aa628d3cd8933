"""update.py's metrics.json: each minibatch's numbers summed over its micro-batches and the ranks,
one record per AdamW step (measured before the step), and their mean over the steps.

A per-token mean is a term summed over the loss's tokens, divided by their count, so that it does
not depend on how a minibatch is cut into micro-batches or shared between ranks. The first
minibatch, before any step (when π_θ is still π_old), also gives the on-policy check:
|log π_θ − log π_old| and the share of tokens whose ratio (the policy loss's: GSPO's is its sequence's)
is already outside the clip band; and |log π_θ − log π_ref|,
exactly 0 while θ is still θ_ref (docs/numerics.md).
"""

import math

import torch

from grpo.loop import diagnostics
from grpo.models import distributed

# metrics.json's per-token means -> the term of update.py:micro_batch_loss they average (clipped_low,
# clipped_high, dual_clipped: the tokens the policy loss's clip acted on; None where it has no such clip).
TOKEN_MEANS = {"kl": "kl", "kl_penalty": "kl_penalty", "clip_frac_low": "clipped_low",
               "clip_frac_high": "clipped_high", "clip_frac_dual": "dual_clipped", "ratio_mean": "ratio",
               "entropy": "entropy"}
SUMS = ("loss", "policy_loss", *TOKEN_MEANS, "logprob_diff", "ref_logprob_diff", "completion_tokens",
        "signal_clipped", "signal_tokens", "outside_clip", "checked")
MAXES = ("ratio", "logprob_diff", "ref_logprob_diff")


class UpdateMetrics:
    """The numbers of one update: start() a minibatch, add() each micro-batch, end_minibatch() with the
    gradient norms, step() after each AdamW step, summary() at the end."""

    def __init__(self, clip, has_ref):
        self.clip, self.has_ref = clip, has_ref          # update.Clip: the band [1 − ε_low, 1 + ε_high]
        self.steps, self.on_policy, self.signal = [], None, []

    def start(self):
        self.sums, self.maxes = dict.fromkeys(SUMS, 0.0), dict.fromkeys(MAXES, 0.0)

    @torch.no_grad()
    def add(self, batch, loss, terms):
        """A micro-batch's loss and per-token terms (update.py:micro_batch_loss's)."""
        sums, maxes = self.sums, self.maxes
        mask, loss_mask = batch["policy_tokens"], batch["loss_mask"]           # [n, T]
        sums["loss"] += loss.item()
        sums["policy_loss"] += terms["policy_loss"].item()
        for name, term in TOKEN_MEANS.items():
            if terms[term] is not None:
                sums[name] += torch.where(loss_mask, terms[term].float(), 0.0).sum().item()
        A = batch["advantages"]                                                   # [n] or [n, T]
        signal = loss_mask & ((A != 0)[:, None] if A.dim() == 1 else (A != 0))     # [n, T] tokens that can clip
        sums["signal_tokens"] += signal.sum().item()
        sums["signal_clipped"] += ((terms["clipped_low"] | terms["clipped_high"]) & signal).sum().item()
        if loss_mask.any():
            maxes["ratio"] = max(maxes["ratio"], terms["ratio"][loss_mask].max().item())
        for name, other in (("logprob_diff", batch["old_logprobs"]), ("ref_logprob_diff", terms["ref_logp"])):
            if other is not None:
                diff_max, diff_sum = diagnostics.logprob_mismatch(terms["logp"], other, mask)
                sums[name] += diff_sum
                maxes[name] = max(maxes[name], diff_max)
        sums["completion_tokens"] += mask.sum().item()
        ratio = terms["ratio"]                                                      # [n, T]
        outside = (ratio < 1 - self.clip.low) | (ratio > 1 + self.clip.high)
        sums["outside_clip"] += (outside & mask).sum().item()
        sums["checked"] += mask.sum().item()

    def end_minibatch(self, grad_norm):
        """Combine the ranks' sums; False when the loss or a gradient is not finite (no step then)."""
        self.sums = distributed.all_reduce(self.sums, "sum")
        self.maxes = distributed.all_reduce(self.maxes, "max")
        self.grad_norm = grad_norm
        if self.on_policy is None:
            tokens, ref = self.sums["completion_tokens"], self.has_ref
            self.on_policy = {"logprob_diff_max": self.maxes["logprob_diff"],
                              "logprob_diff_mean": self.sums["logprob_diff"] / tokens,
                              "ref_logprob_diff_max": self.maxes["ref_logprob_diff"] if ref else None,
                              "ref_logprob_diff_mean": self.sums["ref_logprob_diff"] / tokens if ref else None,
                              "outside_clip_on_policy": self.sums["outside_clip"] / self.sums["checked"]}
        return math.isfinite(grad_norm) and math.isfinite(self.sums["loss"])

    def step(self, num_tokens, lr):
        self.steps.append(self._step_metrics(self.sums, self.maxes, self.grad_norm, num_tokens, lr))
        self.signal.append((self.sums["signal_clipped"], self.sums["signal_tokens"]))

    def _step_metrics(self, sums, maxes, grad_norm, num_tokens, lr):
        """One optimizer step's metrics, in metrics.json's names (kl is null without a reference)."""
        per_token = {name: sums[name] / num_tokens for name in TOKEN_MEANS}
        if not self.has_ref:
            per_token["kl"] = per_token["kl_penalty"] = None
        metrics = {"loss": sums["loss"], "policy_loss": sums["policy_loss"], **per_token,
                   "clip_frac": per_token["clip_frac_low"] + per_token["clip_frac_high"],
                   "ratio_max": maxes["ratio"], "grad_norm": grad_norm, "tokens": num_tokens, "lr": lr}
        return metrics

    def summary(self, skipped):
        """metrics.json: the mean of each metric over the optimizer steps (null for a null one, all null
        with no step), the step counts, the on-policy check, and clip_frac_signal: the share of the
        tokens that can clip (of rows with a nonzero advantage, in the steps after the first, whose
        ratio is 1) whose objective was clipped; null where there are none."""
        if self.steps:
            steps = self.steps
            means = {k: None if v is None else sum(s[k] for s in steps) / len(steps)
                     for k, v in steps[0].items()}
        else:
            placeholder = self._step_metrics(dict.fromkeys(SUMS, 0.0), dict.fromkeys(MAXES, 0.0),
                                             0.0, 1, 0.0)
            means = dict.fromkeys(placeholder)
        later = self.signal[1:]                       # the first step's ratio is 1: nothing can clip there
        clipped, tokens = sum(c for c, _ in later), sum(t for _, t in later)
        return {**means, "clip_frac_signal": clipped / tokens if tokens else None,
                "optimizer_steps": len(self.steps), "skipped_steps": skipped, **self.on_policy}

    def warnings(self, clip_effect):
        """What the on-policy check calls for: sampler and trainer disagree, or rounding alone clips
        (`clip_effect`: what the policy loss's clip does to those tokens, update.POLICY_LOSSES)."""
        on_policy = self.on_policy
        warnings = [diagnostics.mismatch_warning(on_policy["logprob_diff_max"],
                                                 on_policy["logprob_diff_mean"]),
                    diagnostics.clip_band_warning(on_policy["outside_clip_on_policy"], clip_effect)]
        return [w for w in warnings if w]
