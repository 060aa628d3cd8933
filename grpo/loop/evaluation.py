"""Held-out evaluation: greedy answers of the policy beside the reference's, and their rewards; with
--eval-samples n, n sampled answers a prompt and pass@1, pass@k and maj@n, as papers report them.

train.py writes them to eval/iter_XXXX.jsonl (and eval/iter_XXXX_samples.jsonl) and logs the rewards
under eval/. The same sampled numbers from a stage run (sample.py --group-size n on held-out prompts,
then score.py): `python -m grpo.loop.evaluation DIR` reads DIR/samples.jsonl and DIR/rewards.safetensors.
"""

import json
import math
import os
import re
from collections import Counter

import torch
from tqdm import tqdm
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from grpo.cli import ArgumentParser, StageError, run_cli
from grpo.disk import files
from grpo.loop import diagnostics
from grpo.models import distributed, loading, modeling
from grpo.models.distributed import row_slices
from grpo.rewards import prompting


# ----------------------------------------------------------------------------------------
# Sampled accuracy: a sample passes a reward function when its value reaches 1 (a rule reward's full
# mark); rows a function does not apply to (NaN) are left out of that function's numbers.

def pass_at_k(n, c, k):
    """The unbiased estimator of pass@k from n samples of which c pass (Chen et al. 2021, eq. 1):
    1 − C(n − c, k) / C(n, k), as the product 1 − Π_{i=n−c+1..n} (1 − k/i), which never forms the
    binomials. A prompt with fewer than k samples scored (rows a function does not apply to left out)
    passes when any of them does."""
    if c == 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def answer_of(completion):
    """The answer maj@n votes on: the completion's last number (commas dropped), else its stripped text."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
    return numbers[-1] if numbers else completion.strip()


def sampled_metrics(groups, completions, values):
    """pass@1 (the mean pass rate), pass@k for k = 2, 4, … up to n and n itself (unbiased), and maj@n
    (the most frequent answer's pass; a tie goes to the answer drawn first) of one reward function's
    `values` [N] over the prompts `groups` [N] of n samples each; each the mean over the prompts with
    a value. {} where no row has one."""
    by_group = {}
    for g, completion, v in zip(groups, completions, values):
        if not math.isnan(v):
            by_group.setdefault(g, []).append((answer_of(completion), v >= 1.0))
    if not by_group:
        return {}
    n = max(len(rows) for rows in by_group.values())
    ks = sorted({k for k in (2 ** j for j in range(n.bit_length())) if k <= n} | {n})
    out = {f"pass@{k}": sum(pass_at_k(len(rows), sum(p for _, p in rows), k) for rows in by_group.values())
           / len(by_group) for k in ks}
    majority = []
    for rows in by_group.values():
        top = Counter(a for a, _ in rows).most_common(1)[0][0]
        majority.append(next(p for a, p in rows if a == top))
    out[f"maj@{n}"] = sum(majority) / len(majority)
    return out


def sampled_eval(groups, completions, components):
    """sampled_metrics of each reward function, as eval/ keys: eval/pass@1/NAME, …, eval/maj@n/NAME."""
    return {f"eval/{key}/{name}": value for name, v in components.items()
            for key, value in sampled_metrics(groups, completions, [float(x) for x in v]).items()}


class Progress(StoppingCriteria):
    """A progress bar for generate, one tick per decoding step (it never stops generation itself)."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, input_ids, scores, **kwargs):
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def greedy_answers(model, tokenizer, records, score, max_new_tokens, micro_batch_size=0, desc="eval", episodes=None):
    """Greedy completions of the prompt records and their rewards: (texts, completions, rewards [n],
    skipped [n], lengths [n], components: each reward function's [n], NaN where it does not apply). transformers' generate does the decoding, `micro_batch_size` rows at a
    time (0: all), under a progress bar: no log-probs are needed here, and the explicit config keeps a
    model's own generation settings (sampling, penalties) out of it. `score(rows, rollouts)` returns
    (rewards [n], components, skipped [n]) as score.score does for training, with its weights and
    --on-reward-error. With --env, `episodes(model, records)` plays them instead (sample.py's episodes at
    top-k 1), returning the rollouts and samples.jsonl rows whose completions are scored."""
    if episodes is not None:
        rollouts, rows = episodes(model, records)
        rewards, components, skipped = score(rows, rollouts)
        return ([s["prompt"] for s in rows], [s["completion"] for s in rows], rewards, skipped,
                rollouts["completion_mask"].sum(-1).float().cpu(), components)
    device = next(model.parameters()).device
    texts, token_lists = prompting.render_prompts(records, tokenizer, "held-out prompts", None)
    prompt_ids, prompt_mask = prompting.left_pad(token_lists, tokenizer.pad_token_id)        # [n, P]
    eos = loading.eos_token_ids(tokenizer, model)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id)
    pieces, slices = [], row_slices(len(records), micro_batch_size)
    with tqdm(total=len(slices) * max_new_tokens, desc=desc, unit="step", leave=False,
              disable=None if distributed.is_main() else True) as bar:
        for k, rows in enumerate(slices):
            out = model.generate(input_ids=prompt_ids[rows].to(device),
                                 attention_mask=prompt_mask[rows].long().to(device), generation_config=config,
                                 stopping_criteria=StoppingCriteriaList([Progress(bar)]))
            pieces.append(out[:, prompt_ids.shape[1]:].cpu())                              # [m, T_m]
            bar.update((k + 1) * max_new_tokens - bar.n)                     # a slice that stopped early
    # A slice stops early only when each of its rows has its EOS: the padding lies after every EOS.
    width = max(p.shape[1] for p in pieces)
    ids = torch.cat([modeling.pad_columns(p, width, tokenizer.pad_token_id) for p in pieces])    # [n, T]
    is_eos = torch.isin(ids, torch.tensor(eos))                                             # [n, T]
    mask = (is_eos.long().cumsum(-1) - is_eos.long()) == 0          # up to and including the first EOS
    completions = [tokenizer.decode(ids[b][mask[b]], skip_special_tokens=True) for b in range(len(records))]
    rows = [prompting.sample_row(record, b, texts[b], completions[b]) for b, record in enumerate(records)]
    rollouts = {"group_ids": torch.arange(len(rows)), "completion_ids": ids, "completion_mask": mask}
    rewards, components, skipped = score(rows, rollouts)
    return texts, completions, rewards, skipped, mask.sum(-1).float(), components


class HeldOut:
    """The policy's greedy answers beside the reference's. The reference never changes, so its answers
    are computed once per process: from the policy itself at step 0 when β = 0 keeps no reference
    model in memory, else from the reference model (loaded from `ref_dir` if need be)."""

    def __init__(self, records, tokenizer, score, max_new_tokens, run_dir, trust_remote_code=False,
                 micro_batch_size=0, sample=None, episodes=None):
        self.records, self.tokenizer, self.score = records, tokenizer, score
        self.episodes = episodes       # --env: (model, records) → greedy episodes' rollouts and samples
        self.max_new_tokens, self.run_dir, self.trust_remote_code = max_new_tokens, run_dir, trust_remote_code
        self.micro_batch_size = micro_batch_size
        self.sample = sample           # --eval-samples n: (policy, records) → n sampled rollouts a record
        self.reference = None

    def __call__(self, policy, ref_model, ref_dir, step):
        """Writes eval/iter_{step}.jsonl and returns the eval/ metrics."""
        answers = greedy_answers(policy, self.tokenizer, self.records, self.score, self.max_new_tokens,
                                 self.micro_batch_size, desc=f"eval {step}", episodes=self.episodes)
        if self.reference is None and ref_model is None and step == 0:
            self.reference = answers
        elif self.reference is None:
            device = next(policy.parameters()).device
            ref_model = ref_model or loading.load_model(ref_dir, device, self.trust_remote_code)
            self.reference = greedy_answers(ref_model, self.tokenizer, self.records, self.score,
                                            self.max_new_tokens, self.micro_batch_size, desc="eval π_ref",
                                            episodes=self.episodes)
        texts, completions, rewards, skipped, lengths, components = answers
        _, ref_completions, ref_rewards, ref_skipped, ref_lengths, _ = self.reference
        rows = [{**record, "group": b, "prompt": texts[b], "completion": completions[b],
                 "reward": None if skipped[b] else rewards[b].item(), "ref_completion": ref_completions[b],
                 "ref_reward": None if ref_skipped[b] else ref_rewards[b].item()}
                for b, record in enumerate(self.records)]
        os.makedirs(os.path.join(self.run_dir, "eval"), exist_ok=True)
        files.write_jsonl(os.path.join(self.run_dir, "eval", f"iter_{step:04d}.jsonl"), rows)
        sampled = self.sampled(policy, step) if self.sample is not None else {}
        # Rows no reward applied to (or skipped by --on-reward-error skip) are left out, as in training.
        return {"eval/reward_mean": None if skipped.all() else rewards[~skipped].mean().item(),
                "eval/ref_reward_mean": None if ref_skipped.all() else
                ref_rewards[~ref_skipped].mean().item(),
                "eval/skipped_rewards": int(skipped.sum()),
                "eval/completion_len": lengths.mean().item(),
                "eval/ref_completion_len": ref_lengths.mean().item(),
                "eval/same_as_ref": sum(c == r for c, r in zip(completions, ref_completions)) / len(rows),
                "eval/num_prompts": len(rows),
                **{f"eval/reward/{name}": None if v.isnan().all() else v.nanmean().item()     # each function's
                   for name, v in components.items()}, **sampled}

    def sampled(self, policy, step):
        """--eval-samples n: n answers a prompt drawn as in training, scored, written to
        eval/iter_XXXX_samples.jsonl; their pass@k and maj@n."""
        rollouts, samples = self.sample(policy, self.records)
        rewards, components, skipped = self.score(samples, rollouts)
        groups, completions = rollouts["group_ids"].tolist(), [s["completion"] for s in samples]
        rows = [{**s, "reward": None if skipped[i] else rewards[i].item(),
                 "rewards": {k: None if v[i].isnan() else v[i].item() for k, v in components.items()},
                 "answer": answer_of(completions[i])} for i, s in enumerate(samples)]
        files.write_jsonl(os.path.join(self.run_dir, "eval", f"iter_{step:04d}_samples.jsonl"), rows)
        return {**sampled_eval(groups, completions, components),
                **diagnostics.episode_metrics(samples, self.records, "eval/sampled_env/")}


# ----------------------------------------------------------------------------------------
# The same numbers from a stage run

def main(argv=None):
    p = ArgumentParser(description="pass@1, pass@k and maj@n of a sample.py + score.py folder (DIR/samples.jsonl "
                                   "and DIR/rewards.safetensors: n = --group-size samples a prompt)")
    p.add_argument("dir", help="the folder of sample.py's samples.jsonl and score.py's rewards.safetensors")
    args = p.parse_args(argv)
    samples = files.read_jsonl(os.path.join(args.dir, "samples.jsonl"))
    path = os.path.join(args.dir, "rewards.safetensors")
    rewards, _, _ = files.load_tensors(path, files.REWARDS)
    components = files.reward_components(path)
    if len(samples) != rewards["rewards"].numel():
        raise StageError(f"{path}: {rewards['rewards'].numel()} rows, samples.jsonl has {len(samples)}")
    print(json.dumps(sampled_eval(rewards["group_ids"].tolist(), [s["completion"] for s in samples], components),
                     indent=2))


if __name__ == "__main__":
    run_cli(main)
