"""Stage 2 of GRPO: one scalar reward r_i per completion.

Reads   --rollouts FILE  rollouts.safetensors (group_ids [N], completion_ids [N, T], completion_mask [N, T])
        --samples FILE   samples.jsonl (N rows: prompt, completion, and the prompt record's fields)
Writes  --out FILE       rewards.safetensors (schema rewards/1)
            rewards [N] f32     the weighted sum Σ_k w_k · r_k of the reward functions
            group_ids [N] i64   copied from the rollouts, so advantage.py needs only this file
            reward/NAME [N] f32 each function's reward before weighting

Example:
    python score.py --rollouts it0/rollouts.safetensors --samples it0/samples.jsonl \\
        --reward exact_answer my_rewards.py:brevity --reward-weights 1.0 0.1 --out it0/rewards.safetensors

A --reward SPEC is one of
- a built-in rule reward by name (tasks.py: exact_answer);
- `module:function` or `path/to/file.py:function`, a user function with TRL's reward signature
  `f(prompts, completions, **fields) -> list[float]`; `fields` holds every other column of
  samples.jsonl as a list (e.g. answer, group) and `completion_ids` (token ids up to the mask);
- a local folder holding a Hugging Face sequence-classification reward model with one output.
  It reads the rendered prompt followed by the completion, or, when the record has "messages"
  and the reward model's tokenizer has a chat template, the chat with the completion as the
  assistant's reply.

Every reward must be a finite number: None, NaN or ±inf is an error naming the rows.

--overlong-buffer L adds DAPO's soft overlong punishment (reward/overlong, weight 1), from the
completion lengths |o| (completion_mask, first EOS included) and L_max = max_new_tokens.
"""

import importlib
import importlib.util
import math
import numbers
import os
import sys

import torch

import common
import tasks


def parse_args(argv=None):
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", required=True, help="rollouts.safetensors from sample.py")
    p.add_argument("--samples", required=True, help="samples.jsonl from sample.py")
    p.add_argument("--reward", required=True, nargs="+", action="extend", metavar="SPEC",
                   help="r: reward function(s): a built-in name (" + ", ".join(tasks.REWARDS) + "), module:function,\n"
                        "path/file.py:function, or a reward-model folder; repeat or list several")
    p.add_argument("--reward-weights", type=float, nargs="+", default=None, metavar="W",
                   help="w_k: one weight per --reward; r = Σ_k w_k r_k (default: all 1.0)")
    p.add_argument("--overlong-buffer", type=int, default=0, metavar="L",
                   help="DAPO's overlong reward shaping (Yu et al. 2025), added as reward/overlong: with\n"
                        "L_max = max_new_tokens, 0 up to L_max − L tokens, linear down to −1 at L_max,\n"
                        "−1 beyond (default 0: off)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="L_max for --overlong-buffer (default: the sampling limit in the rollouts' metadata)")
    p.add_argument("--out", required=True, help="output rewards.safetensors")
    p.add_argument("--micro-batch-size", type=int, default=0, help="rows per reward-model forward pass (default 0: all)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda when available)")
    args = p.parse_args(argv)
    if args.reward_weights is None:
        args.reward_weights = [1.0] * len(args.reward)
    if len(args.reward_weights) != len(args.reward):
        raise common.StageError(f"--reward-weights has {len(args.reward_weights)} values for {len(args.reward)} "
                                f"--reward functions")
    return args


def load_reward(spec, device, micro_batch_size):
    """Resolve a --reward SPEC to (name, function with the TRL reward signature)."""
    if spec in tasks.REWARDS:
        return spec, tasks.REWARDS[spec]
    if ":" in spec:
        return load_user_function(spec)
    if os.path.isdir(spec):
        return os.path.basename(os.path.normpath(spec)), reward_model_function(spec, device, micro_batch_size)
    raise common.StageError(f"--reward {spec!r}: unknown reward; expected a built-in name ({', '.join(tasks.REWARDS)}), "
                            f"module:function, path/file.py:function, or a reward-model folder")


def load_user_function(spec):
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise common.StageError(f"--reward {spec!r}: no such file {target}")
            module_spec = importlib.util.spec_from_file_location(f"user_reward_{abs(hash(target))}", target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except common.StageError:
        raise
    except Exception as e:  # the user's module can raise anything on import; report it as one line
        raise common.StageError(f"--reward {spec!r}: importing {target} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise common.StageError(f"--reward {spec!r}: {target} has no function {name!r}")
    return name, fn


def reward_model_function(path, device, micro_batch_size):
    """A TRL-style reward function backed by a sequence-classification model with one output."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = common.load_tokenizer(path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).to(device).eval()
    except (OSError, ValueError) as e:
        raise common.StageError(f"{path}: cannot load a sequence-classification reward model "
                                f"({str(e).splitlines()[0]})") from None
    if model.config.num_labels != 1:
        raise common.StageError(f"{path}: a reward model must have one output (num_labels=1), "
                                f"this one has {model.config.num_labels}")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id

    @torch.inference_mode()
    def reward_model(prompts, completions, messages=None, **fields):
        texts = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            chat = messages[i] if messages is not None else None
            if chat is not None and tokenizer.chat_template is not None:
                texts.append(tokenizer.apply_chat_template(
                    chat + [{"role": "assistant", "content": completion}], tokenize=False))
            else:
                texts.append(prompt + completion)
        scores = []
        for rows in common.row_slices(len(texts), micro_batch_size):
            batch = tokenizer(texts[rows], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            scores.append(model(**batch).logits[:, 0].float().cpu())                       # [n]
        return torch.cat(scores).tolist()

    return reward_model


def call_reward(name, fn, prompts, completions, fields, n):
    """Run one reward function and check that it returned n finite numbers."""
    try:
        values = fn(prompts=prompts, completions=completions, **fields)
    except Exception as e:  # a user's reward may raise anything; say which reward and what it raised
        raise common.StageError(f"reward {name!r} raised {type(e).__name__}: {e}") from None
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if values is None or not hasattr(values, "__len__") or len(values) != n:
        got = "None" if values is None else f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
        raise common.StageError(f"reward {name!r} returned {got}, expected a list of {n} floats (one per completion)")
    bad = [i for i, v in enumerate(values) if v is None or not isinstance(v, numbers.Real) or not math.isfinite(v)]
    if bad:
        raise common.StageError(f"reward {name!r} returned None, NaN, infinite or non-numbers in rows "
                                f"{common.format_rows(bad)}")
    return torch.tensor([float(v) for v in values], dtype=torch.float32)                    # [N]


def score(rollouts, samples, reward_fns, weights):
    """Weighted sum of the rewards; returns (rewards [N], {name: component [N]})."""
    N = rollouts["group_ids"].shape[0]
    prompts = [s["prompt"] for s in samples]
    completions = [s["completion"] for s in samples]
    columns = sorted({k for s in samples for k in s} - {"prompt", "completion"})
    fields = {k: [s.get(k) for s in samples] for k in columns}
    if "completion_ids" in rollouts and "completion_mask" in rollouts:
        fields["completion_ids"] = [ids[mask].tolist() for ids, mask in
                                    zip(rollouts["completion_ids"], rollouts["completion_mask"])]
    components = {}
    total = torch.zeros(N)                                                                   # [N]
    for (name, fn), w in zip(reward_fns, weights):
        key = name
        while key in components:
            key += "_"
        components[key] = call_reward(name, fn, prompts, completions, fields, N)
        total += w * components[key]
    return total, components


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong punishment per completion: 0 for |o| ≤ L_max − L, then (L_max − L − |o|)/L
    down to −1 at |o| = L_max, and −1 beyond. lengths [N] -> [N]"""
    return ((max_len - buffer - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)


def add_overlong(rewards, components, completion_mask, max_len, buffer):
    """Add the overlong penalty to the total with weight 1 and keep it as the component 'overlong'."""
    components["overlong"] = overlong_penalty(completion_mask.sum(-1), max_len, buffer)      # [N]
    return rewards + components["overlong"]


def write_rewards(path, rewards, group_ids, components, args):
    tensors = {"rewards": rewards, "group_ids": group_ids, **{f"reward/{k}": v for k, v in components.items()}}
    common.save_tensors(path, tensors, common.REWARDS[0], vars(args))


def check_samples(samples, group_ids, path):
    if len(samples) != group_ids.shape[0]:
        raise common.StageError(f"{path}: has {len(samples)} rows, the rollouts have {group_ids.shape[0]}")
    for i, s in enumerate(samples):
        if not isinstance(s.get("prompt"), str) or not isinstance(s.get("completion"), str):
            raise common.StageError(f"{path}, row {i}: needs string fields 'prompt' and 'completion'")
        if "group" in s and s["group"] != int(group_ids[i]):
            raise common.StageError(f"{path}, row {i}: group {s['group']} but the rollouts say {int(group_ids[i])}")


# score.py needs only group_ids from the rollouts (and completion ids for the reward functions' fields).
ROLLOUTS_FOR_SCORING = (common.ROLLOUTS[0], {k: (kind, shapes, k == "group_ids")
                                             for k, (kind, shapes, _) in common.ROLLOUTS[1].items()})


def main(argv=None):
    args = parse_args(argv)
    rollouts, meta, _ = common.load_tensors(args.rollouts, ROLLOUTS_FOR_SCORING)
    if args.overlong_buffer:
        args.max_new_tokens = args.max_new_tokens or meta.get("max_new_tokens")
        if "completion_mask" not in rollouts or not args.max_new_tokens:
            raise common.StageError(f"{args.rollouts}: --overlong-buffer needs 'completion_mask' and L_max "
                                    f"(--max-new-tokens, or max_new_tokens in the file's metadata)")
        if not 0 < args.overlong_buffer <= args.max_new_tokens:
            raise common.StageError(f"--overlong-buffer must be in 1..L_max={args.max_new_tokens}, "
                                    f"got {args.overlong_buffer}")
    samples = common.read_jsonl(args.samples)
    check_samples(samples, rollouts["group_ids"], args.samples)
    device = common.pick_device(args.device)
    reward_fns = [load_reward(spec, device, args.micro_batch_size) for spec in args.reward]

    rewards, components = score(rollouts, samples, reward_fns, args.reward_weights)
    if args.overlong_buffer:
        rewards = add_overlong(rewards, components, rollouts["completion_mask"], args.max_new_tokens,
                               args.overlong_buffer)
    write_rewards(args.out, rewards, rollouts["group_ids"], components, args)
    parts = ", ".join(f"{k} {v.mean().item():.3f}" for k, v in components.items())
    print(f"scored {len(samples)} completions: reward mean {rewards.mean().item():.4f} "
          f"std {rewards.std().item() if len(samples) > 1 else 0.0:.4f} ({parts}); wrote {args.out}")


if __name__ == "__main__":
    common.run_cli(main)
