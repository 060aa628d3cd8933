"""User reward functions (TRL's convention) used by the tests."""

import re


def text(completion):
    """A completion's text: a string prompt's completion is a string, a chat prompt's is TRL's
    [{"role": "assistant", "content": text}]."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def digits_in_even_groups(prompts, completions, group, **fields):
    """The number of digits in the completion for even groups; 0 for every row of odd groups, which
    therefore carry no signal (for DAPO's dynamic sampling)."""
    return [float(sum(ch.isdigit() for ch in text(c))) if g % 2 == 0 else 0.0 for c, g in zip(completions, group)]


def constant(prompts, completions, **fields):
    """The same reward for every completion: no group has any spread."""
    return [1.0] * len(completions)


def token_count(prompts, completions, completion_ids, **fields):
    """The completion's length in tokens, first EOS included: exactly the `lengths` score.py records."""
    return [float(len(ids)) for ids in completion_ids]


# The two reward functions of TRL's documentation, in its exact shape: conversational completions
# (completion[0]["content"]), the dataset's columns as keyword lists, None where a reward does not
# apply. TRL's accuracy reward parses the solution with math-verify and returns None when it cannot;
# this one reads the solution's last number, so that the test needs no verifier.

def format_reward(completions, **kwargs):
    """1.0 when the completion contains a digit followed by a full stop, else 0.0."""
    pattern = r".*\d\."
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def accuracy_reward(completions, solution, **kwargs):
    """1.0 when the completion's last number is the solution's, 0.0 when not, None when the solution
    holds no number (the reward does not apply)."""
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        gold = re.findall(r"\d+", sol or "")
        if gold:
            found = re.findall(r"\d+", content)
            reward = float(bool(found) and found[-1] == gold[-1])
        else:
            reward = None
        rewards.append(reward)
    return rewards


def nothing(prompts, completions, **fields):
    """0 for every completion: with PPO's zero-initialised critic head, every GAE advantage and return is 0."""
    return [0.0] * len(completions)


def turns_and_seen(prompts, completions, seen, **fields):
    """An episode's turns (its completion, in TRL's conversational shape) and its environment's field
    `seen`, as one number: 10 × turns + the environment's count of the policy's turns."""
    return [float(len(c) * 10 + len(s)) for c, s in zip(completions, seen)]
