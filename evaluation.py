"""Periodic comparison with the base model: the policy and the reference answer the same held-out
prompts greedily, side by side in eval/iter_XXXX.jsonl, and their rewards are logged under eval/."""

import os

import torch

import common
import sample
import score


@torch.inference_mode()
def greedy_completions(model, tokenizer, held_out, reward_fns, max_new_tokens):
    """Greedy completions and rewards of the held-out prompts: (texts, completions, rewards, lengths)."""
    device = next(model.parameters()).device
    texts, token_lists = sample.render_prompts(held_out, tokenizer, "held-out prompts", None)
    prompt_ids, prompt_mask = sample.left_pad(token_lists, tokenizer.pad_token_id)
    ids, mask, _, _ = sample.sample_completions(
        model, prompt_ids.to(device), prompt_mask.to(device), max_new_tokens, 0.0,
        common.eos_token_ids(tokenizer, model), tokenizer.pad_token_id, generator=None)
    ids, mask = ids.cpu(), mask.cpu()
    completions = [tokenizer.decode(ids[b][mask[b]], skip_special_tokens=True) for b in range(len(held_out))]
    rows = [{**record, "group": b, "prompt": texts[b], "completion": completions[b]} for b, record in enumerate(held_out)]
    batch = {"group_ids": torch.arange(len(rows)), "completion_ids": ids, "completion_mask": mask}
    rewards, _, _ = score.score(batch, rows, reward_fns, [1.0] * len(reward_fns))
    return texts, completions, rewards, mask.sum(-1).float()


def evaluate(models, held_out, reward_fns, cfg, run_dir, step, reference):
    """The policy and the reference side by side on the held-out prompts (greedy); writes
    eval/iter_XXXX.jsonl and returns eval/ metrics. The reference's answers never change, so they
    are computed once per process and kept in `reference`."""
    texts, completions, rewards, lengths = greedy_completions(models["sampler"], models["tokenizer"], held_out,
                                                              reward_fns, cfg.max_new_tokens)
    if not reference:
        if models["ref"] is None and step == 0:               # β = 0 keeps no reference, but at 0 the policy is it
            reference.update(completions=completions, rewards=rewards, lengths=lengths)
        else:
            ref = models["ref"] or common.load_model(models["base"], next(models["sampler"].parameters()).device,
                                                     cfg.trust_remote_code)
            _, c, r, n = greedy_completions(ref, models["tokenizer"], held_out, reward_fns, cfg.max_new_tokens)
            reference.update(completions=c, rewards=r, lengths=n)
    rows = [{**record, "group": b, "prompt": texts[b], "completion": completions[b], "reward": rewards[b].item(),
             "ref_completion": reference["completions"][b], "ref_reward": reference["rewards"][b].item()}
            for b, record in enumerate(held_out)]
    os.makedirs(os.path.join(run_dir, "eval"), exist_ok=True)
    common.write_jsonl(os.path.join(run_dir, "eval", f"iter_{step:04d}.jsonl"), rows)
    return {"eval/reward_mean": rewards.mean().item(), "eval/ref_reward_mean": reference["rewards"].mean().item(),
            "eval/completion_len": lengths.mean().item(), "eval/ref_completion_len": reference["lengths"].mean().item(),
            "eval/same_as_ref": sum(c == r for c, r in zip(completions, reference["completions"])) / len(rows),
            "eval/num_prompts": len(rows)}
