"""Prompt sets that the default task lacks, written as JSON-lines prompt files for train.py.

    mixed_difficulty: one-digit sums (3 plus 5) and three-digit sums (418 plus 276), half and half, in
        the default task's words ("What is a plus b? Answer in one short sentence."), each record with
        "answer" and "difficulty" ("one_digit" or "three_digit"). For C1: prompts of very unequal
        difficulty in one batch. The 81 one-digit pairs (a, b in 1..9) are split 24 held out, 57 for
        training; as many three-digit pairs are drawn for training, and 24 more held out. The held-out
        file alternates the two difficulties, so its first M prompts (train.py --eval-prompts M) are
        balanced. Seeded (seed 0 for every run: the runs' seeds change the order of the records,
        not the records). The base model, 8 samples of each held-out prompt at τ = 0.7 within 64
        tokens: 35% of the one-digit answers right (2 of 24 groups all equal), none of the
        three-digit ones (every group all wrong).

Files are written to DIR/NAME_train.jsonl and DIR/NAME_eval.jsonl; writing the same set again gives the
same bytes, so a run's --prompts path names the same records whenever it is written.
"""

import json
import os
import random

QUESTION = "What is {a} plus {b}? Answer in one short sentence."


def sum_record(a, b, difficulty):
    return {"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b),
            "difficulty": difficulty}


def mixed_difficulty(seed=0, num_eval_each=24):
    """(train records, held-out records): one-digit and three-digit sums, half and half."""
    rng = random.Random(seed)
    easy = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    rng.shuffle(easy)
    hard = set()
    while len(hard) < len(easy):
        hard.add((rng.randint(100, 999), rng.randint(100, 999)))
    hard = sorted(hard)
    rng.shuffle(hard)
    n = num_eval_each
    train = [sum_record(a, b, "one_digit") for a, b in easy[n:]] + \
            [sum_record(a, b, "three_digit") for a, b in hard[n:]]
    held_out = []
    for (a, b), (c, d) in zip(easy[:n], hard[:n]):
        held_out += [sum_record(a, b, "one_digit"), sum_record(c, d, "three_digit")]
    return train, held_out


PROMPT_SETS = {"mixed_difficulty": mixed_difficulty}


def write_prompt_set(name, folder):
    """Writes the set's two files into `folder`; returns (train path, held-out path)."""
    train, held_out = PROMPT_SETS[name]()
    os.makedirs(folder, exist_ok=True)
    paths = []
    for part, records in (("train", train), ("eval", held_out)):
        path = os.path.join(folder, f"{name}_{part}.jsonl")
        text = "".join(json.dumps(r) + "\n" for r in records)
        if not (os.path.isfile(path) and open(path).read() == text):
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        paths.append(path)
    return tuple(paths)
