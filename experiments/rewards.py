"""Rewards that the claims need and the built-in tasks lack, with TRL's signature
f(prompts, completions, **fields) -> list[float], passed as `train.py --reward experiments/rewards.py:NAME`.

verbose_judge (C6): the exact answer (1 or 0) plus a judge that likes long answers: BONUS per completion
    token (completion_ids, which score.py passes, through the EOS), capped at CAP. The base model's
    answers to the sums average about 20 tokens at τ = 0.7 (18 to one-digit, 23 to three-digit sums
    in a pilot of 384 samples); the cap is reached at 40, within C6's 64 new tokens.
flip_10, flip_20 (C10): the exact answer, flipped (1 ↔ 0) for each row with probability 0.1 or 0.2.
    The draw is a function of the row alone, so a run is reproducible and resumes to the same rewards:
    it is seeded by a hash of the call's prompts and completions and the row's index, so two calls
    with different completions draw afresh (a fixed hash of prompt and completion alone would flip
    the same answer to the same prompt every time: a systematic error, not noise). The held-out
    evaluation scores with it too; the claims rescore held-out answers with the plain exact answer.
"""

import hashlib
import json
import random

from grpo.rewards.tasks import exact_answer

BONUS, CAP = 0.01, 0.4


def verbose_judge(prompts, completions, answer, completion_ids, **fields):
    correct = exact_answer(prompts, completions, answer)
    return [c + min(BONUS * len(ids), CAP) for c, ids in zip(correct, completion_ids)]


def flipped(p):
    """exact_answer flipped for each row with probability p (see the module docstring)."""

    def reward(prompts, completions, answer, **fields):
        correct = exact_answer(prompts, completions, answer)
        batch = hashlib.sha256(json.dumps([prompts, completions], sort_keys=True).encode()).hexdigest()
        return [1.0 - r if random.Random(f"{batch}/{i}").random() < p else r for i, r in enumerate(correct)]

    reward.__name__ = f"flip_{round(100 * p)}"
    return reward


flip_10 = flipped(0.1)
flip_20 = flipped(0.2)
