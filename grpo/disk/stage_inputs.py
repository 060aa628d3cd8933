"""A stage's input files read together and checked against each other before anything is computed or
written: update.py's rollouts and advantages (same rows, groups and widths; the reference it needs),
and the rollouts advantage.py's GAE reads beside its rewards (values, masks, log-probs). The files'
own schemas are grpo/disk/files.py's; what they were made from, grpo/disk/provenance.py's."""

import torch

from grpo.cli import StageError
from grpo.disk import files, provenance
from grpo.disk.files import ROLLOUTS, format_rows, load_tensors


# GAE reads only these keys of the rollouts (values and the log-probs are checked where they are needed).
ROLLOUTS_FOR_GAE = (ROLLOUTS[0], {k: (kind, shapes, k in ("completion_mask", "group_ids"))
                                        for k, (kind, shapes, _) in ROLLOUTS[1].items()})


def gae_rollouts(rollouts_file, rewards_file, data, kl_in_reward=0.0):
    """The tensors of a rollouts file that advantage.py's GAE reads, checked against the rewards file's
    `data`: same rows, same groups,
    a completion mask that is a prefix of each row, values present and 0 where the mask is false, and
    both log-probs with --kl-in-reward."""
    rollouts, _, dims = load_tensors(rollouts_file, ROLLOUTS_FOR_GAE)
    if dims["N"] != data["rewards"].numel() or not torch.equal(rollouts["group_ids"], data["group_ids"]):
        raise StageError(f"{rewards_file}: its rows (N = {data['rewards'].numel()}) and group_ids differ "
                         f"from those of {rollouts_file} (N = {dims['N']})")
    if "values" not in rollouts:
        raise StageError(f"{rollouts_file}: no 'values' for --estimator gae; sample with --critic DIR")
    missing = [k for k in ("old_logprobs", "ref_logprobs") if k not in rollouts]
    if kl_in_reward != 0 and missing:
        raise StageError(f"{rollouts_file}: --kl-in-reward needs '{missing[0]}'"
                         f"{'; sample with --ref-model' if missing[0] == 'ref_logprobs' else ''}")
    mask = rollouts["completion_mask"]                                      # [N, T]
    prefix = torch.arange(mask.shape[1]) < mask.sum(-1, keepdim=True)       # [N, T]
    if not torch.equal(mask, prefix) or not mask[:, 0].all():
        bad = torch.nonzero((mask != prefix).any(-1) | ~mask[:, 0]).flatten()
        raise StageError(f"{rollouts_file}: completion_mask of rows {format_rows(bad)} is not a run of "
                         f"true from the first token (GAE needs each completion's tokens in order)")
    check_loss_mask(rollouts_file, rollouts)
    outside = torch.nonzero(((rollouts["values"] != 0) & ~mask).any(-1)).flatten()
    if len(outside):
        raise StageError(f"{rollouts_file}: 'values' is non-zero where completion_mask is false in rows "
                         f"{format_rows(outside)}; the values and the mask do not belong together")
    return rollouts


def check_loss_mask(path, rollouts):
    """An episode's loss_mask (the policy's tokens) lies within completion_mask and marks at least one
    token of every row."""
    if "loss_mask" not in rollouts:
        return
    loss_mask = rollouts["loss_mask"]
    outside = torch.nonzero((loss_mask & ~rollouts["completion_mask"]).any(-1)).flatten()
    if len(outside):
        raise StageError(f"{path}: 'loss_mask' is true where completion_mask is false in rows "
                         f"{format_rows(outside)}; the policy's tokens are completion tokens")
    empty = torch.nonzero(~loss_mask.any(-1)).flatten()
    if len(empty):
        raise StageError(f"{path}: rows {format_rows(empty)} have no token of the policy (loss_mask all false)")


def check_token_ids(path, rollouts, model):
    """The rollouts' prompt and completion ids are ids of `model`'s embedding table."""
    vocab = model.get_input_embeddings().num_embeddings
    for key in ("prompt_ids", "completion_ids"):
        bad = torch.nonzero(((rollouts[key] < 0) | (rollouts[key] >= vocab)).any(-1)).flatten()
        if len(bad):
            raise StageError(f"{path}: '{key}' holds ids outside the model's vocabulary [0, {vocab}) in rows "
                             f"{format_rows(bad)}; were they made with another tokenizer?")


def update_inputs(args):
    """Rollouts and advantages, checked against each other before anything is computed or written.
    Sets args.temperature and args.max_new_tokens to what is used, so the output's metadata says it."""
    rollouts, meta, dims = load_tensors(args.rollouts, ROLLOUTS)
    adv, _, adv_dims = load_tensors(args.advantages, files.ADVANTAGES)
    provenance.advantages_of_rollouts(args.advantages, args.rollouts, args.allow_mismatch)
    if adv_dims["N"] != dims["N"]:
        raise StageError(f"{args.advantages}: has {adv_dims['N']} rows, {args.rollouts} has {dims['N']}")
    if not torch.equal(adv["group_ids"], rollouts["group_ids"]):
        raise StageError(f"{args.advantages}: group_ids differ from those of {args.rollouts} "
                         f"(rows out of order?)")
    if "T" in adv_dims and adv_dims["T"] != dims["T"]:
        raise StageError(f"{args.advantages}: per-token advantages have T = {adv_dims['T']}, "
                         f"the rollouts have T = {dims['T']}")
    if args.ref_logprobs != "rollouts":                  # π_ref: --ref-model, or the one the rollouts name
        args.ref_model = args.ref_model or meta.get("ref_model")
    if args.ref_logprobs is None:                        # a file made by hand names none: its ref_logprobs
        args.ref_logprobs = "recompute" if args.ref_model else "rollouts"
    if args.ref_logprobs == "recompute" and not args.ref_model:
        raise StageError(f"{args.rollouts}: --ref-logprobs recompute, but no reference model is named; pass "
                         f"--ref-model")
    if args.rollout_is != "none" and "sampler_logprobs" not in rollouts and args.old_logprobs != "recompute":
        raise StageError(f"{args.rollouts}: --rollout-is {args.rollout_is} needs 'sampler_logprobs', which sample.py "
                         f"writes with --top-k, --top-p or --min-p; without them π_old is the sampling "
                         f"distribution itself (--rollout-is none), unless --old-logprobs recompute makes π_old "
                         f"the policy now (π_prox) and the file's old_logprobs the sampler's")
    if args.ref_logprobs == "rollouts" and args.beta != 0 and "ref_logprobs" not in rollouts:
        raise StageError(f"{args.rollouts}: no 'ref_logprobs' but --beta is {args.beta}; sample with "
                         f"--ref-model, pass --ref-model, or train with --beta 0")
    empty = torch.nonzero(~rollouts["completion_mask"].any(-1)).flatten()
    if len(empty):
        raise StageError(f"{args.rollouts}: rows {files.format_rows(empty)} have no completion token "
                         f"(completion_mask all false)")
    check_loss_mask(args.rollouts, rollouts)
    if args.critic and "values" not in rollouts:
        raise StageError(f"{args.rollouts}: no 'values' for --critic; sample with sample.py --critic DIR")
    if args.critic and "returns" not in adv:
        raise StageError(f"{args.advantages}: no 'returns' for --critic; compute the advantages with "
                         f"advantage.py --estimator gae")
    sampled_at = meta.get("temperature")
    if args.temperature and sampled_at and args.temperature != sampled_at and not args.allow_mismatch:
        raise StageError(f"{args.rollouts}: sampled at --temperature {sampled_at:g}, and --temperature is "
                         f"{args.temperature:g}; log π_old and the update's log π_θ must be at one τ (leave "
                         f"--temperature out to take the file's, or --allow-mismatch)")
    args.temperature = args.temperature or sampled_at or 1.0
    args.max_new_tokens = args.max_new_tokens or meta.get("max_new_tokens")
    if args.loss_agg == "dr_grpo" and not args.max_new_tokens:
        raise StageError(f"{args.rollouts}: --loss-agg dr_grpo divides by N × L_max, and the file's "
                         f"metadata has no max_new_tokens; pass --max-new-tokens")
    return rollouts, adv["advantages"], adv.get("returns")
