"""The rollouts dict of sample.py's file: the sampler's micro-batches stacked into its columns, and
samples.jsonl's rows; whole groups stacked from several parts (torchrun's ranks, DAPO's sampling
rounds), prompts re-padded on the left, completions on the right, groups renumbered; sampling shared
among torchrun's ranks; and DAPO's dynamic sampling, which keeps the groups whose rewards differ over
several rounds.
"""

import torch

from grpo import groups
from grpo.cli import StageError
from grpo.models import distributed, modeling
from grpo.rewards import prompting


def pad_right(tensors, value):
    """Stack [n_i, T_i] chunks into [sum n_i, max T_i], padding on the right."""
    T = max(t.shape[1] for t in tensors)
    return torch.cat([modeling.pad_columns(t, T, value) for t in tensors])


def stack_completions(parts, pad_id):
    """The sampler's micro-batches' completion columns (sample.sample_completions) stacked: [N, T]
    padded on the right to the longest, truncated [N]."""
    pads = {"completion_ids": pad_id, "completion_mask": False}
    return {key: torch.cat([p[key] for p in parts]) if key == "truncated" else
            pad_right([p[key] for p in parts], pads.get(key, 0.0)) for key in parts[0]}


def sample_rows(rollouts, records, texts, tokenizer):
    """samples.jsonl's rows: each row's group, prompt text and decoded completion (up to and
    including its EOS, special tokens skipped) beside its record's fields."""
    groups = rollouts["group_ids"].tolist()
    return [prompting.sample_row(records[b], b, texts[b], tokenizer.decode(ids[mask], skip_special_tokens=True))
            for b, ids, mask in zip(groups, rollouts["completion_ids"], rollouts["completion_mask"])]


def concat_rollouts(parts, pad_id):
    """Stack whole groups of several rollouts dicts: prompts re-padded on the left, completions on the
    right, group_ids renumbered 0..B−1 in order. Each part holds complete groups."""
    P = max(part["prompt_ids"].shape[1] for part in parts)
    out, offset, groups = {}, 0, []
    for part in parts:
        _, first = torch.unique_consecutive(part["group_ids"], return_inverse=True)
        groups.append(first + offset)
        offset += int(first.max()) + 1
    for key in parts[0]:
        value = pad_id if key.endswith("_ids") else 0                     # masks: False, log-probs: 0
        if key.startswith("prompt"):
            out[key] = torch.cat([torch.nn.functional.pad(p[key], (P - p[key].shape[1], 0), value=value)
                                  for p in parts])
        elif parts[0][key].dim() == 2:
            out[key] = pad_right([p[key] for p in parts], value)
        else:
            out[key] = torch.cat([p[key] for p in parts])
    out["group_ids"] = torch.cat(groups)                                                    # [N]
    return out


def sharded(rollout, num_records, seed, pad_id, device):
    """sample.py's rollout under torchrun: `rollout(share, generator)` samples the records of the slice
    `share` (whole groups) with `generator`. Rank r samples a contiguous share with its own generator,
    seeded distributed.rank_seed(seed, r), and every rank gets all rows back in group order, so rank r's
    groups are what one process draws for that share with that seed. One process: rollout(all, None)."""
    rank, world = distributed.rank_and_world()
    if world == 1:
        return rollout(slice(None), None)
    if num_records < world:
        raise StageError(f"{num_records} prompts for {world} processes: each process samples whole groups, "
                         f"so --num-prompts must be at least the number of processes")
    share = distributed.shard_slice(num_records, rank, world)
    generator = torch.Generator(device=device).manual_seed(distributed.rank_seed(seed, rank))
    tensors, samples = rollout(share, generator)
    for s in samples:
        s["group"] += share.start
    parts = {k: distributed.all_gather_rows(v, pad_id if k.endswith("_ids") else 0, left=k.startswith("prompt"))
             for k, v in tensors.items()}
    tensors = concat_rollouts([{k: parts[k][r] for k in parts} for r in range(world)], pad_id)
    return tensors, distributed.all_gather_json(samples)


def dapo_dynamic_sampling(sample_round, first_slot, rounds, B, G, pad_id, perf):
    """DAPO's dynamic sampling (Yu et al. 2025) for train.py --dynamic-sampling: groups whose rewards
    are all equal give no gradient, so they are dropped and the B records of the next slot sampled,
    until B informative groups or `rounds` rounds. `sample_round(slot)` samples and scores one round:
    (batch, sample_args, score_args), the batch a dict of records, rollouts, samples, rewards,
    components and skipped. Returns the same for the kept groups, renumbered 0..B−1."""
    kept, last = [], None
    for r in range(rounds):
        last, sample_args, score_args = sample_round(first_slot + r)
        informative = ~groups.no_signal_groups(last["rewards"].double().reshape(B, G),
                                                     ~last["skipped"].reshape(B, G))                # [B]
        kept += [(last, b) for b in range(B) if informative[b]]
        perf["charts/sample_rounds"] = r + 1
        if len(kept) >= B:
            break
    perf["charts/informative_groups"] = min(len(kept), B)
    kept = [(part, slice(b * G, (b + 1) * G), b) for part, b in (kept or [(last, b) for b in range(B)])[:B]]
    batch = {"rollouts": concat_rollouts([{k: v[rows] for k, v in part["rollouts"].items()}
                                          for part, rows, _ in kept], pad_id),
             "records": [part["records"][b] for part, _, b in kept],
             "samples": [dict(s, group=g) for g, (part, rows, _) in enumerate(kept)
                         for s in part["samples"][rows]],
             "components": {k: torch.cat([part["components"][k][rows] for part, rows, _ in kept])
                            for k in last["components"]},
             **{k: torch.cat([part[k][rows] for part, rows, _ in kept]) for k in ("rewards", "skipped")}}
    return batch, sample_args, score_args
