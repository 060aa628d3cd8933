"""Stage 4 of GRPO: update the policy with PPO's clipped objective and a β·KL penalty to π_ref.

For every completion token o_t of completion o_i (DeepSeekMath, eq. 3; DESIGN.md):

    ρ_t   = exp(log π_θ(o_t) − log π_old(o_t))
    ℓ_t   = −min(ρ_t·A_i, clip(ρ_t, 1−ε_low, 1+ε_high)·A_i) + β·k3_t
    k3_t  = exp(log π_ref(o_t) − log π_θ(o_t)) − (log π_ref(o_t) − log π_θ(o_t)) − 1
    loss  = mean over sequences of the masked token mean of ℓ_t          (--loss-agg seq)

Reads   --model DIR        the policy π_θ (equal to π_old before the first step); if DIR holds
                           optimizer.safetensors, AdamW continues from it (--fresh-optimizer: not)
        --rollouts FILE    rollouts.safetensors: ids and masks, old_logprobs, ref_logprobs [N, T]
        --advantages FILE  advantages.safetensors: advantages [N] (or [N, T]), group_ids [N]
Writes  --out DIR          config.json, model.safetensors and tokenizer files (a Hugging Face
                           checkpoint), optimizer.safetensors, metrics.json

Example:
    python update.py --model ckpt/ --rollouts it0/rollouts.safetensors --advantages it0/advantages.safetensors \\
        --out ckpt1/ --lr 1e-6 --beta 0.01 --clip-eps 0.2 --loss-agg seq --epochs 1 --minibatch-size 16

Variants (one flag beside one `if` each; README's table has the formulas): --loss-agg token|dr_grpo,
--clip-eps-high (DAPO), --dual-clip (dual-clip PPO), --ratio-level sequence (GSPO),
--kl-estimator k1|k2 (Schulman's estimators).

Choices where the paper and DESIGN.md are silent:
- log π_old is the rollouts' old_logprobs, never recomputed: the file is the record of what was
  sampled. log π_θ is recomputed with common.completion_logprobs at the sampling temperature
  (the rollouts' metadata; --temperature overrides), the function sample.py uses.
- μ = --epochs passes; each pass shuffles the N rows with a seeded generator and cuts them into
  minibatches of --minibatch-size completions, one AdamW step per minibatch. A minibatch is
  processed in micro-batches of --micro-batch-size rows whose losses are divided by the
  minibatch's normaliser (sequences or tokens), so the gradient does not depend on the split.
- Dropout is off (eval mode) so that ρ = 1 exactly on the first, on-policy step.
- Gradients are clipped to a total norm of --max-grad-norm; AdamW with weight decay 0 by default.
- A row whose completion_mask is all false (no completion token) is an error: it has no ℓ_t to
  average, and sample.py never writes one, so such a file was built wrongly.
- --out DIR is replaced as a unit (written beside it, then renamed), so it must be new, empty, or
  an earlier checkpoint folder; a folder holding other files (say, the rollouts) is refused.
- Under torchrun each minibatch's rows are split across the ranks (DDP, or FSDP2 with --fsdp); the
  loss keeps the whole minibatch's normaliser, so loss, grad_norm and the step equal one process's.
- metrics.json holds each metric measured before each optimizer step, averaged over the steps;
  `kl` is null when the rollouts have no ref_logprobs (only allowed with β = 0).
"""

import json
import math
import os
import time

import torch
from safetensors import safe_open
from tqdm import tqdm

import common
import diagnostics


def parse_args(argv=None):
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="policy π_θ to update (HF checkpoint folder)")
    p.add_argument("--rollouts", required=True, help="rollouts.safetensors from sample.py (π_old, π_ref log-probs)")
    p.add_argument("--advantages", required=True, help="advantages.safetensors from advantage.py (A)")
    p.add_argument("--out", required=True, help="output folder for the updated checkpoint, optimizer state, metrics.json")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    p.add_argument("--beta", type=float, default=0.01, help="β: weight of the KL penalty to π_ref (default 0.01)")
    p.add_argument("--clip-eps", type=float, default=0.2, help="ε (ε_low): clip ρ to [1−ε, 1+ε] (default 0.2)")
    p.add_argument("--clip-eps-high", type=float, default=None,
                   help="ε_high: upper clip 1+ε_high (DAPO's clip-higher uses 0.28; default: ε)")
    p.add_argument("--loss-agg", default="seq", choices=["seq", "token", "dr_grpo"],
                   help="seq: mean over sequences of the token mean (DeepSeekMath, default)\n"
                        "token: Σ over tokens / token count (DAPO)\n"
                        "dr_grpo: Σ over tokens / (N × L_max) (Dr. GRPO)")
    p.add_argument("--dual-clip", type=float, default=None, metavar="C",
                   help="C > 1: for A < 0 cap the token loss at C·|A| (dual-clip PPO, Ye et al. 2020; default off)")
    p.add_argument("--ratio-level", default="token", choices=["token", "sequence"],
                   help="token: ρ_t per token (PPO, GRPO; default)\n"
                        "sequence: one ρ_i = exp(mean_t log ρ_t) per completion, clipped per sequence\n"
                        "(GSPO, Zheng et al. 2025; it uses a far smaller ε: --clip-eps 3e-4 --clip-eps-high 4e-4)")
    p.add_argument("--kl-estimator", default="k3", choices=["k1", "k2", "k3"],
                   help="estimator of KL(π_θ‖π_ref) in the loss, x = log π_ref − log π_θ (Schulman 2020):\n"
                        "k1 = −x, k2 = x²/2, k3 = eˣ − x − 1 (default; metrics.json's kl is always k3)")
    p.add_argument("--epochs", type=int, default=1, help="μ: passes over the rollouts (default 1)")
    p.add_argument("--minibatch-size", type=int, default=0,
                   help="completions per optimizer step (default 0: all N, one step per epoch)")
    p.add_argument("--micro-batch-size", type=int, default=0,
                   help="rows per forward/backward; gradients accumulate up to the minibatch (default 0: whole minibatch)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the gradient's total norm to this (default 1.0)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--temperature", type=float, default=None,
                   help="τ for log π_θ (default: the sampling temperature in the rollouts' metadata, else 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="L_max for --loss-agg dr_grpo (default: from the rollouts' metadata; an error if neither)")
    p.add_argument("--max-bad-steps", type=int, default=5,
                   help="steps with a non-finite loss or gradient are skipped; stop with an error after this many (default 5)")
    p.add_argument("--fresh-optimizer", action="store_true", help="ignore optimizer.safetensors in --model")
    p.add_argument("--seed", type=int, default=0, help="seed of the minibatch shuffle (default 0)")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the policy, its gradients and AdamW's state across the ranks with\n"
                        "FSDP2 (fully_shard per decoder layer) instead of a full copy per rank in DDP (default)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda when available)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the model folder run its own Python code (default off: it is code from the folder)")
    args = p.parse_args(argv)
    if args.clip_eps_high is None:
        args.clip_eps_high = args.clip_eps
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise common.StageError(f"--dual-clip must be > 1 (it caps the loss above the clipped term), got {args.dual_clip}")
    if args.epochs < 1:
        raise common.StageError(f"--epochs must be at least 1, got {args.epochs}")
    return args


def grpo_token_loss(logp, old_logp, ref_logp, advantages, mask, beta, clip_eps, clip_eps_high,
                    dual_clip=None, ratio_level="token", kl_estimator="k3"):
    """ℓ_t of DESIGN.md for every token, and its terms. Tensors [n, T]; advantages [n] or [n, T]."""
    A = advantages[:, None] if advantages.dim() == 1 else advantages          # [n, 1] or [n, T]
    log_ratio = logp - old_logp                                                # [n, T]
    if ratio_level == "sequence":  # GSPO: one ratio per completion, exp of the mean token log-ratio
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand_as(logp)                                  # [n, T], constant along T
    ratio = torch.exp(log_ratio)                                               # ρ_t            [n, T]
    pg_unclipped = ratio * A                                                   # ρ_t·A
    pg_clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * A      # clip(ρ_t)·A
    pg_loss = -torch.min(pg_unclipped, pg_clipped)                             # −min(·,·)      [n, T]
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:      # dual-clip PPO: with A < 0 the loss is at most C·|A|, however large ρ gets
        dual_clipped = (A < 0) & (pg_loss > dual_clip * A.abs())
        pg_loss = torch.where(dual_clipped, dual_clip * A.abs(), pg_loss)
    if ref_logp is not None:
        x = ref_logp - logp                                                    # log π_ref − log π_θ
        kl = torch.exp(x) - x - 1                                              # k3_t, the KL that is reported
        if kl_estimator == "k1":
            penalty = -x
        elif kl_estimator == "k2":
            penalty = x ** 2 / 2
        else:
            penalty = kl
    else:
        kl = penalty = torch.zeros_like(logp)
    loss = pg_loss + beta * penalty                                            # ℓ_t            [n, T]
    terms = {"pg_loss": pg_loss, "kl": kl, "kl_penalty": penalty, "ratio": ratio, "dual_clipped": dual_clipped,
             "clipped_low": (ratio < 1 - clip_eps) & (A < 0),                  # the clip is the active term
             "clipped_high": (ratio > 1 + clip_eps_high) & (A > 0)}
    return loss, terms


def aggregate(token_loss, mask, loss_agg, num_seqs, num_tokens, max_new_tokens):
    """This micro-batch's share of the minibatch loss; the minibatch's sequences and tokens normalise."""
    masked = torch.where(mask, token_loss, 0.0)                                # [n, T]
    if loss_agg == "seq":      # mean over sequences of the masked token mean (DeepSeekMath)
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if loss_agg == "token":    # Σ ℓ_t / Σ |o_i| over the minibatch (DAPO)
        return masked.sum() / num_tokens
    return masked.sum() / (num_seqs * max_new_tokens)  # dr_grpo: Σ ℓ_t / (N × L_max)


def update(policy, optimizer, rollouts, advantages, args, temperature, max_new_tokens):
    """μ epochs of clipped-objective steps on the rollouts; returns metrics averaged over steps.

    Under torchrun each rank takes its share of every minibatch's rows; the normalisers (sequences,
    tokens) are the whole minibatch's, and each rank's loss is scaled by the world size because DDP
    and FSDP average gradients, so the step equals the one-process step.
    """
    device = next(policy.parameters()).device
    rank, world = common.rank_and_world()
    N = rollouts["group_ids"].shape[0]
    ref = rollouts.get("ref_logprobs")
    generator = torch.Generator().manual_seed(args.seed)
    steps, skipped, mismatch = [], 0, torch.zeros((), dtype=torch.float64)
    bar = tqdm(total=args.epochs * len(common.row_slices(N, args.minibatch_size)), desc="update", leave=False,
               disable=None if rank == 0 else True)
    for _ in range(args.epochs):
        order = torch.randperm(N, generator=generator)                                # [N]
        for mb in common.row_slices(N, args.minibatch_size):
            rows = order[mb]                                                           # [M]
            mask = rollouts["completion_mask"][rows]                                   # [M, T]
            num_seqs, num_tokens = len(rows), int(mask.sum())
            local = rows[common.shard_slice(len(rows), rank, world)]                   # [M / world]
            micros = [(local[m], float(world)) for m in common.row_slices(len(local), args.micro_batch_size)]
            # Every rank makes as many passes as rank 0, which has the largest share (FSDP's gathers are
            # collectives); a spare pass runs one row at weight 0, as does a rank with no rows.
            busiest = len(common.row_slices(max(-(-len(rows) // world), 1), args.micro_batch_size))
            micros += [(rows[:1], 0.0)] * (busiest - len(micros))
            sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64)
            ratio_max = torch.zeros((), dtype=torch.float64)
            optimizer.zero_grad(set_to_none=True)
            for k, (idx, weight) in enumerate(micros):
                batch = {key: v[idx].to(device) for key, v in rollouts.items()}
                m = batch["completion_mask"]                                           # [n, T]
                with common.grad_sync(policy, k == len(micros) - 1):
                    logp, entropy = common.completion_logprobs(
                        policy, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], m,
                        temperature, with_entropy=True)                                # [n, T]
                    token_loss, terms = grpo_token_loss(
                        logp, batch["old_logprobs"], batch.get("ref_logprobs"), advantages[idx].to(device), m,
                        args.beta, args.clip_eps, args.clip_eps_high, args.dual_clip, args.ratio_level,
                        args.kl_estimator)
                    loss = aggregate(token_loss, m, args.loss_agg, num_seqs, num_tokens, max_new_tokens)
                    (loss * weight).backward()   # DDP and FSDP average over ranks; × world makes it a sum
                if weight == 0:
                    continue
                with torch.no_grad():
                    if not steps and not skipped:   # first minibatch, before any step: must be on-policy
                        diff = (logp - batch["old_logprobs"]).abs()[m].double()        # [tokens]
                        mismatch = torch.maximum(mismatch, diff.max().cpu())
                        sums[SUM_KEYS.index("logprob_diff")] += diff.sum().item()
                    sums[0] += loss.item()
                    sums[1] += aggregate(terms["pg_loss"], m, args.loss_agg, num_seqs, num_tokens,
                                         max_new_tokens).item()
                    for j, key in enumerate(SUM_KEYS[2:-1], 2):
                        term = entropy if key == "entropy" else terms[key]
                        sums[j] += torch.where(m, term.float(), 0.0).sum().item()
                    ratio_max = torch.maximum(ratio_max, terms["ratio"][m].max().double().cpu())
            sums, ratio_max = common.all_reduce(sums, "sum"), common.all_reduce(ratio_max, "max").item()
            grad_norm = common.total_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
            if not steps and not skipped:
                mismatch_max = common.all_reduce(mismatch.cpu(), "max").item()
                mismatch = (mismatch_max, sums[SUM_KEYS.index("logprob_diff")].item() / num_tokens)
            if not (math.isfinite(grad_norm) and math.isfinite(sums[0].item())):
                # A non-finite loss or gradient would write NaN into every weight: skip the step instead.
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                common.warn(f"update: non-finite {'loss' if not math.isfinite(sums[0].item()) else 'gradient'} "
                            f"(grad_norm {grad_norm}); optimizer step skipped ({skipped} so far)")
                if skipped > args.max_bad_steps:
                    raise common.StageError(f"{skipped} optimizer steps had a non-finite loss or gradient, more than "
                                            f"--max-bad-steps {args.max_bad_steps}; stopping. Lower --lr, check the "
                                            f"rewards and advantages, or look for NaN weights in --model")
                bar.update(1)
                continue
            optimizer.step()
            s = dict(zip(SUM_KEYS, sums.tolist()))
            steps.append({
                "loss": s["loss"], "policy_loss": s["policy_loss"],
                "kl": s["kl"] / num_tokens if ref is not None else None,
                "kl_penalty": s["kl_penalty"] / num_tokens if ref is not None else None,
                "clip_frac": (s["clipped_low"] + s["clipped_high"]) / num_tokens,
                "clip_frac_low": s["clipped_low"] / num_tokens, "clip_frac_high": s["clipped_high"] / num_tokens,
                "clip_frac_dual": s["dual_clipped"] / num_tokens,
                "ratio_mean": s["ratio"] / num_tokens, "ratio_max": ratio_max,
                "entropy": s["entropy"] / num_tokens, "grad_norm": grad_norm, "tokens": num_tokens,
            })
            bar.update(1)
            bar.set_postfix(loss=f"{s['loss']:.4f}")
    bar.close()
    if steps:
        metrics = {k: (None if steps[0][k] is None else sum(s[k] for s in steps) / len(steps)) for k in steps[0]}
    else:
        metrics = dict.fromkeys(["loss", "policy_loss", "kl", "kl_penalty", "clip_frac", "clip_frac_low",
                                 "clip_frac_high", "clip_frac_dual", "ratio_mean", "ratio_max", "entropy",
                                 "grad_norm", "tokens"])
    metrics.update(optimizer_steps=len(steps), skipped_steps=skipped,
                   logprob_diff_max=mismatch[0], logprob_diff_mean=mismatch[1])
    warning = diagnostics.mismatch_warning(*mismatch)
    if warning:
        common.warn(warning)
    return metrics


# Per-minibatch sums gathered across micro-batches (and ranks) before each optimizer step.
SUM_KEYS = ["loss", "policy_loss", "kl", "kl_penalty", "clipped_low", "clipped_high", "dual_clipped", "ratio",
            "entropy", "logprob_diff"]


def make_optimizer(policy, lr, weight_decay=0.0):
    return torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)


def optimizer_state_tensors(policy, optimizer):
    """AdamW's per-parameter state keyed 'param_name/exp_avg' etc., for a safetensors file (no pickle)."""
    names = {p: n for n, p in common.unwrap(policy).named_parameters()}
    return {f"{names[p]}/{k}": common.full_tensor(v if torch.is_tensor(v) else torch.tensor(v))
            for p, state in optimizer.state.items() for k, v in state.items()}


def load_optimizer_state(policy, optimizer, path):
    """Restore AdamW's state from optimizer_state_tensors' file; every parameter must have its state."""
    try:
        with safe_open(path, framework="pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a damaged file raises several types; all mean the same here
        raise common.StageError(f"{path}: not a readable optimizer state ({str(e).splitlines()[0]}); "
                                f"delete it or pass --fresh-optimizer") from None
    device = next(policy.parameters()).device
    for name, p in common.unwrap(policy).named_parameters():
        state = {key: saved.get(f"{name}/{key}") for key in ("step", "exp_avg", "exp_avg_sq")}
        if any(v is None for v in state.values()):
            raise common.StageError(f"{path}: no AdamW state for parameter {name}; is it from another model? "
                                    f"(--fresh-optimizer ignores it)")
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].shape != p.shape:
                raise common.StageError(f"{path}: {name}/{key} has shape {list(state[key].shape)}, "
                                        f"the parameter has {list(p.shape)}")
        moments = {key: state[key].to(device) for key in ("exp_avg", "exp_avg_sq")}
        if hasattr(p, "device_mesh"):                   # an FSDP2 shard: keep this rank's part of the state
            from torch.distributed.tensor import distribute_tensor

            moments = {k: distribute_tensor(v, p.device_mesh, p.placements) for k, v in moments.items()}
        optimizer.state[p] = {"step": state["step"].float(), **moments}


def save_update(policy, tokenizer, optimizer, metrics, args, out_dir, extra_files=None, writer=None, buffers=None,
                then=None):
    """Checkpoint, optimizer state and metrics.json, written into `out_dir` as one unit.

    With a common.BackgroundWriter, the weights and AdamW's state are first copied into `buffers`
    (a dict kept by the caller) and the files are written in its thread while training goes on.
    """
    weights, state = common.checkpoint_tensors(policy), optimizer_state_tensors(policy, optimizer)   # every rank
    if not common.is_main():                              # rank 0 writes
        return
    policy = common.unwrap(policy)
    if writer is not None:
        writer.wait()                                     # the previous write still reads the buffers
        weights = common.snapshot(weights, buffers.setdefault("weights", {}))
        state = common.snapshot(state, buffers.setdefault("optimizer", {}))

    def write():
        common.save_checkpoint(policy, tokenizer, out_dir, weights=weights, extra_files={
            "optimizer.safetensors": lambda path: common.save_tensors(path, state, "optimizer/1", vars(args)),
            "metrics.json": lambda path: common.write_json(path, metrics),
            **(extra_files or {}),
        })
        if then is not None:                              # e.g. train.py keeping the save for replay
            then()

    if writer is None:
        write()
    else:
        writer.submit(write)


def load_inputs(args):
    """Rollouts and advantages, checked against each other before anything is computed or written."""
    rollouts, meta, dims = common.load_tensors(args.rollouts, common.ROLLOUTS)
    adv, _, adv_dims = common.load_tensors(args.advantages, common.ADVANTAGES)
    if adv_dims["N"] != dims["N"]:
        raise common.StageError(f"{args.advantages}: has {adv_dims['N']} rows, {args.rollouts} has {dims['N']}")
    if not torch.equal(adv["group_ids"], rollouts["group_ids"]):
        raise common.StageError(f"{args.advantages}: group_ids differ from those of {args.rollouts} (rows out of order?)")
    if "T" in adv_dims and adv_dims["T"] != dims["T"]:
        raise common.StageError(f"{args.advantages}: per-token advantages have T = {adv_dims['T']}, "
                                f"the rollouts have T = {dims['T']}")
    if args.beta != 0 and "ref_logprobs" not in rollouts:
        raise common.StageError(f"{args.rollouts}: no 'ref_logprobs' but --beta is {args.beta}; sample with "
                                f"--ref-model, or train with --beta 0")
    empty = torch.nonzero(~rollouts["completion_mask"].any(-1)).flatten()
    if len(empty):
        raise common.StageError(f"{args.rollouts}: rows {common.format_rows(empty)} have no completion token "
                                f"(completion_mask all false)")
    rollouts.pop("values", None)
    # Record the τ and L_max actually used, so the output's metadata says what was computed.
    args.temperature = args.temperature or meta.get("temperature", 1.0)
    args.max_new_tokens = args.max_new_tokens or meta.get("max_new_tokens")
    if args.loss_agg == "dr_grpo" and not args.max_new_tokens:
        raise common.StageError(f"{args.rollouts}: --loss-agg dr_grpo divides by N × L_max, and the file's metadata "
                                f"has no max_new_tokens; pass --max-new-tokens")
    return rollouts, adv["advantages"], args.temperature, args.max_new_tokens


def main(argv=None):
    args = parse_args(argv)
    common.check_checkpoint_out(args.out)
    if args.beta == 0:
        common.warn(diagnostics.BETA_ZERO_WARNING)
    rollouts, advantages, temperature, max_new_tokens = load_inputs(args)
    device = common.init_distributed(args.device)
    tokenizer = common.load_tokenizer(args.model, args.trust_remote_code)
    policy = common.distribute(common.load_model(args.model, device, args.trust_remote_code), args.fsdp)
    optimizer = make_optimizer(policy, args.lr, args.weight_decay)
    state_file = os.path.join(args.model, "optimizer.safetensors")
    if os.path.isfile(state_file) and not args.fresh_optimizer:
        load_optimizer_state(policy, optimizer, state_file)

    t0 = time.perf_counter()
    metrics = update(policy, optimizer, rollouts, advantages, args, temperature, max_new_tokens)
    metrics["seconds"] = time.perf_counter() - t0
    save_update(policy, tokenizer, optimizer, metrics, args, args.out)
    if common.is_main():
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}))


if __name__ == "__main__":
    common.run_cli(main)
