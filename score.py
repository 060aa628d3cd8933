"""Stage 2 of GRPO: one scalar reward r_i per completion.

Reads   --rollouts FILE  rollouts.safetensors: group_ids [N], completion_ids and completion_mask [N, T]
        --samples FILE   samples.jsonl (N rows: prompt, completion, and the prompt record's fields)
Writes  --out FILE       rewards.safetensors (schema rewards/1; docs/formats.md)
            rewards [N] f32      the weighted sum Σ_k w_k · r_k of the reward functions
            group_ids [N] i64    copied from the rollouts, so advantage.py needs only this file
            reward/NAME [N] f32  each function's reward before weighting
            lengths [N] i64      |o|, completion_mask's count (for --length-strata and diagnostics)

Example:
    python score.py --rollouts it0/rollouts.safetensors --samples it0/samples.jsonl \\
        --reward exact_answer my_rewards.py:brevity --reward-weights 1.0 0.1 --out it0/rewards.safetensors

A --reward SPEC is a built-in rule reward (grpo/rewards/tasks.py, grpo/rewards/math_reward.py), `module:function`
or `file.py:function` with TRL's signature f(prompts, completions, **fields) -> list[float | None]
(fields: every other column of samples.jsonl as a list, and completion_ids), or a folder or Hub id
holding a sequence-classification reward model with one output, which reads the prompt and the
completion (a chat prompt and the answer as the assistant's turn, through its chat template).

TRL's contract: a chat prompt's row passes `prompts` as its message list and `completions` as
[{"role": "assistant", "content": text}]; a function may return None for a row it does not apply
to, and a row's reward sums the rewards that apply (TRL's nansum). A row to which none applies is
skipped (`skipped` [N] bool, reward 0): advantage.py gives it advantage 0 and leaves it out of its
group's mean and std. NaN, ±inf or an exception is an error naming the rows, unless
--on-reward-error skip skips those rows too.
--overlong-buffer (DAPO) and --length-penalty add length terms, each with weight 1 and kept as a
component. Under torchrun each rank scores a contiguous share of whole groups; rank 0 writes.
"""

import math
import numbers

import torch

from grpo import settings
from grpo.cli import ArgumentParser, StageError, add_runtime_flags, run_cli, warn
from grpo.disk import files, outputs, provenance
from grpo.models import distributed
from grpo.rewards import reward_specs
from grpo.settings import FINITE, at_least


# ----------------------------------------------------------------------------------------
# The algorithm: a weighted sum of the rewards that apply (TRL's nansum), and length terms

def score(rollouts, samples, reward_fns, weights, on_error="fail"):
    """Weighted sum of the rewards that apply to each row (TRL's nansum); returns (rewards [N],
    {name: component [N], NaN where it does not apply}, skipped [N] bool). A row to which no reward
    applies, or with a bad reward under on_error="skip", is skipped: its reward is 0, and advantage.py
    gives it advantage 0 and leaves it out of its group's statistics."""
    N = rollouts["group_ids"].shape[0]
    prompts, completions = trl_inputs(samples)
    columns = sorted({k for s in samples for k in s} - {"prompt", "completion", *reward_specs.STAGE_OUTPUTS})
    fields = {k: [s.get(k) for s in samples] for k in columns}
    if "completion_ids" in rollouts and "completion_mask" in rollouts:
        fields["completion_ids"] = [ids[mask].tolist() for ids, mask in
                                    zip(rollouts["completion_ids"], rollouts["completion_mask"])]
    components = {}
    total = torch.zeros(N)                                                                   # [N]
    applies = torch.zeros(N, dtype=torch.bool)                                               # [N]
    skipped = torch.zeros(N, dtype=torch.bool)                                               # [N]
    for (name, fn), w in zip(reward_fns, weights):
        key = name
        while key in components:
            key += "_"
        components[key], bad = call_reward(name, fn, prompts, completions, fields, on_error)
        applied = ~components[key].isnan()                                                   # [N]
        total += torch.where(applied, w * components[key], 0.0)
        applies |= applied
        skipped |= bad
    skipped |= ~applies
    return torch.where(skipped, 0.0, total), components, skipped


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong punishment per completion: 0 for |o| ≤ L_max − L, then (L_max − L − |o|)/L
    down to −1 at |o| = L_max, and −1 beyond. lengths [N] -> [N]"""
    return ((max_len - buffer - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)


def length_shaping(rewards, components, lengths, args):
    """The length terms, each added with weight 1 and kept as a component: DAPO's overlong punishment
    (--overlong-buffer) and the linear length penalty (--length-penalty). lengths [N] -> rewards [N]"""
    if args.overlong_buffer:
        components["overlong"] = overlong_penalty(lengths, args.max_new_tokens, args.overlong_buffer)  # [N]
        rewards = rewards + components["overlong"]
    if args.length_penalty:
        components["length"] = -args.length_penalty * lengths.float() / args.max_new_tokens           # [N]
        rewards = rewards + components["length"]
    return rewards


# ----------------------------------------------------------------------------------------
# The loop under torchrun: each rank scores a share of whole groups

def score_sharded(rollouts, samples, reward_fns, weights, on_error="fail"):
    """score() under torchrun: each rank scores a contiguous share of whole groups and every rank gets all
    rows back in order. One process: score()."""
    rank, world = distributed.rank_and_world()
    _, group_index = torch.unique_consecutive(rollouts["group_ids"], return_inverse=True)           # [N]
    num_groups = int(group_index.max()) + 1 if len(samples) else 0
    if world == 1 or num_groups < world:                    # too few groups to share: every rank scores all
        return score(rollouts, samples, reward_fns, weights, on_error)
    share = distributed.shard_slice(num_groups, rank, world)
    rows = torch.nonzero((group_index >= share.start) & (group_index < share.stop)).flatten()          # [n]
    keys = ("group_ids", "completion_ids", "completion_mask")
    local = {k: rollouts[k][rows] for k in keys if k in rollouts}
    local_samples = [samples[i] for i in rows.tolist()]
    total, components, skipped = score(local, local_samples, reward_fns, weights, on_error)

    def gathered(t):
        return torch.cat(distributed.all_gather_rows(t))

    return gathered(total), {k: gathered(v) for k, v in components.items()}, gathered(skipped)


# ----------------------------------------------------------------------------------------
# Calling the reward functions, reading and writing files

def call_reward(name, fn, prompts, completions, fields, on_error="fail"):
    """Run one reward function; returns (rewards [N] with NaN where it does not apply, bad [N] bool).

    None for a row means the reward does not apply to it (TRL's contract). Raising, a wrong length, or
    NaN, ±inf or a non-number is an error, or with on_error="skip" marks the rows bad (all of them when
    the function raised or gave the wrong length): score() skips bad rows."""
    n = len(prompts)
    problem, bad = None, torch.zeros(n, dtype=torch.bool)
    try:
        values = fn(prompts=prompts, completions=completions, **fields)
    except (Exception, SystemExit) as e:  # a user's reward may raise anything, exit() too: say which, what
        problem, values = f"raised {type(e).__name__}: {e} (its fields: {', '.join(sorted(fields))})", None
    if problem is None:
        if hasattr(values, "tolist"):                       # a tensor or a numpy array
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = (f"{len(values)} values" if isinstance(values, (list, tuple)) else
                   "None" if values is None else f"a {type(values).__name__}")
            problem = f"returned {got}, expected a list of {n} floats or None (one per completion)"
        else:
            bad = torch.tensor([v is not None and not finite_number(v) for v in values], dtype=torch.bool)
            if bad.any():
                rows = files.format_rows(torch.nonzero(bad).flatten())
                problem = f"returned NaN, infinite (or beyond float32), or non-numbers in rows {rows}"
    if problem is not None and on_error == "fail":
        raise StageError(f"reward {name!r} {problem} (--on-reward-error skip leaves such rows out)")
    if problem is not None and not bad.any():       # it raised or gave the wrong length: every row
        values, bad = [None] * n, torch.ones(n, dtype=torch.bool)
    if problem is not None:
        warn(f"score: reward {name!r} {problem}; {int(bad.sum())} rows skipped (advantage 0, left out of "
             f"their group's mean and std)")
    r = [math.nan if b or v is None else float(v) for v, b in zip(values, bad.tolist())]
    return torch.tensor(r, dtype=torch.float32), bad                                         # [N]


def finite_number(v):
    """Whether a reward value is a real number float32 can hold as a finite value (10**400 is not)."""
    if not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(v) and abs(float(v)) <= torch.finfo(torch.float32).max
    except OverflowError:                                   # an int too large for a float
        return False


def trl_inputs(samples):
    """prompts and completions as TRL passes them: strings, or for a chat prompt ("messages") the
    message list and [{"role": "assistant", "content": completion}]; an episode's completion is its
    turns, the policy's and the environment's, as that list (whatever the prompt)."""
    prompts, completions = [], []
    for s in samples:
        chat = s.get("messages")
        conversational = isinstance(chat, list)
        prompts.append(chat if conversational else s["prompt"])
        completions.append(s["turns"] if "turns" in s else [{"role": "assistant", "content": s["completion"]}]
                           if conversational else s["completion"])
    return prompts, completions


def write_rewards(path, rewards, group_ids, components, args, lengths=None, skipped=None, made_from=None):
    tensors = {"rewards": rewards, "group_ids": group_ids}
    tensors.update({f"reward/{k}": c for k, c in components.items()})
    if lengths is not None:
        tensors["lengths"] = lengths
    if skipped is not None and skipped.any():
        tensors["skipped"] = skipped
        tensors["rewards"] = torch.where(skipped, 0.0, rewards)              # the length terms too
    files.save_tensors(path, tensors, files.REWARDS[0], vars(args), made_from=made_from)


def read_samples(path, group_ids):
    """samples.jsonl's rows, checked against the rollouts' group_ids [N] (errors name the line)."""
    samples, lines = files.read_jsonl(path, with_lines=True)
    if len(samples) != group_ids.shape[0]:
        raise StageError(f"{path}: has {len(samples)} rows, the rollouts have {group_ids.shape[0]}")
    for i, (s, line) in enumerate(zip(samples, lines)):
        if not isinstance(s.get("prompt"), str) or not isinstance(s.get("completion"), str):
            raise StageError(f"{path}, line {line}: needs string fields 'prompt' and 'completion'")
        if "group" in s and s["group"] != int(group_ids[i]):
            raise StageError(f"{path}, line {line}: group {s['group']} but the rollouts say "
                             f"{int(group_ids[i])}")
    return samples


# score.py needs only group_ids from the rollouts (and completion ids for the reward functions' fields).
ROLLOUTS_FOR_SCORING = (files.ROLLOUTS[0], {k: (kind, shapes, k == "group_ids")
                                             for k, (kind, shapes, _) in files.ROLLOUTS[1].items()})


# ----------------------------------------------------------------------------------------
# The command line

def build_parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", required=True, help="rollouts.safetensors from sample.py")
    p.add_argument("--samples", required=True, help="samples.jsonl from sample.py")
    p.add_argument("--reward", required=True, nargs="+", action="extend", metavar="SPEC",
                   help=f"r: reward function(s): a built-in name ({', '.join(reward_specs.BUILT_IN)}), "
                        "module:function,\npath/file.py:function, or a reward-model folder or Hub id")
    p.add_argument("--reward-weights", type=float, nargs="+", action="extend", default=None, metavar="W",
                   help="w_k: one weight per --reward; r = Σ_k w_k r_k (default: all 1.0)")
    p.add_argument("--overlong-buffer", type=int, default=0, metavar="L",
                   help="L: DAPO's overlong reward shaping (Yu et al. 2025), reward/overlong: 0 up to\n"
                        "L_max − L tokens, linear down to −1 at L_max (default 0: off)")
    p.add_argument("--length-penalty", type=float, default=0.0, metavar="α",
                   help="α: add reward/length = −α·|o|/L_max, the source article's first remedy for a\n"
                        "reward that prefers long answers (default 0: off)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="L_max of the length terms (default: the rollouts' metadata)")
    p.add_argument("--on-reward-error", default="fail", choices=["fail", "skip"],
                   help="a reward that raises, returns the wrong length, or gives None/NaN/inf:\n"
                        "fail: stop with an error naming the reward and rows (default)\n"
                        "skip: skip those rows (advantage 0, out of their group's statistics), record\n"
                        "them in 'skipped', and warn")
    p.add_argument("--out", required=True, help="output rewards.safetensors")
    p.add_argument("--micro-batch-size", type=int, default=0, help="rows per reward-model pass (default all)")
    provenance.add_flag(p)
    add_runtime_flags(p)
    return p


# What each setting may be, checked before anything is read or written (train.py's runs too).
RULES = {"reward_weights": FINITE, "overlong_buffer": at_least(0), "length_penalty": at_least(0),
         "max_new_tokens": at_least(1), "micro_batch_size": at_least(0)}


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    settings.check(args, RULES)
    if args.reward_weights is None:
        args.reward_weights = [1.0] * len(args.reward)
    if len(args.reward_weights) != len(args.reward):
        raise StageError(f"--reward-weights has {len(args.reward_weights)} values for {len(args.reward)} "
                         f"--reward functions ({', '.join(args.reward)}): give one weight per function, in "
                         f"their order (each --reward and --reward-weights adds to its list)")
    if args.overlong_buffer and args.max_new_tokens:
        check_overlong(args.overlong_buffer, args.max_new_tokens)
    return args


def check_overlong(buffer, max_len):
    if not 0 < buffer <= max_len:
        raise StageError(f"--overlong-buffer must be in 1..L_max={max_len}, got {buffer}")


def main(argv=None):
    args = parse_args(argv)
    outputs.check_file(args.out, "score.py", files.REWARDS[0], (args.rollouts, args.samples))
    rollouts, meta, _ = files.load_tensors(args.rollouts, ROLLOUTS_FOR_SCORING)
    lengths = rollouts["completion_mask"].sum(-1) if "completion_mask" in rollouts else None      # [N]
    if args.overlong_buffer or args.length_penalty:
        args.max_new_tokens = args.max_new_tokens or meta.get("max_new_tokens")
        if lengths is None or not args.max_new_tokens:
            raise StageError(f"{args.rollouts}: --overlong-buffer and --length-penalty need "
                             f"'completion_mask' and L_max (--max-new-tokens, or max_new_tokens in the "
                             f"file's metadata)")
        if args.overlong_buffer:
            check_overlong(args.overlong_buffer, args.max_new_tokens)
    samples = read_samples(args.samples, rollouts["group_ids"])
    made_from = provenance.samples_of_rollouts(args.rollouts, args.samples, samples, args.allow_mismatch)
    device = distributed.init_distributed(args.device)
    reward_fns = [reward_specs.load_reward(spec, device, args.micro_batch_size, args.trust_remote_code)
                  for spec in args.reward]
    reward_specs.check_fields(reward_fns, samples, args.samples)

    rewards, components, skipped = score_sharded(rollouts, samples, reward_fns, args.reward_weights,
                                                 args.on_reward_error)
    if lengths is not None:
        rewards = length_shaping(rewards, components, lengths, args)
    if not distributed.is_main():
        return
    write_rewards(args.out, rewards, rollouts["group_ids"], components, args, lengths, skipped, made_from)
    parts = ", ".join(f"{k} {v.nanmean().item():.3f}" for k, v in components.items())
    kept = rewards[~skipped]                                                                # [n]
    print(f"scored {len(samples)} completions: reward mean {kept.mean().item():.4f} "
          f"std {kept.std().item() if len(kept) > 1 else 0.0:.4f} ({parts})"
          f"{f', {int(skipped.sum())} skipped' if skipped.any() else ''}; wrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
