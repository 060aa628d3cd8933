"""Environments (docs/environments.md's contract) used by the tests."""

from grpo.rewards import tasks


class Scripted:
    """Three policy turns: replies "ok1" and "ok2" to the first two, ends the episode at the third.
    A digit ends a turn as EOS does (the tiny random model writes one within a few tokens); `seen`
    keeps the ids of every turn it was given."""

    stop = list("0123456789")

    def reset(self, record):
        self.seen = []

    def step(self, text, token_ids):
        self.seen.append(list(token_ids))
        return None if len(self.seen) == 3 else f"ok{len(self.seen)}"

    def fields(self):
        return {"seen": self.seen}


class Hint:
    """The tiny task with its class hidden: a turn that ends with '?' is answered with the class's name,
    as the tiny task's prompts name it ("digits:")."""

    stop = ["?"]

    def reset(self, record):
        self.name, self.calls = record["char_class"], 0

    def step(self, text, token_ids):
        if not text.endswith("?"):
            return None
        self.calls += 1
        return f"{self.name}:"

    def fields(self):
        return {"tool_calls": self.calls}


def hinted_class(prompts, completions, char_class, tool_calls, **fields):
    """The tiny task's reward (the share of the final turn's characters in the class) for an answer given
    after the hint; 0 without one, so no answer scores without the tool."""
    shares = tasks.char_class(prompts, completions, char_class)
    return [share if calls else 0.0 for share, calls in zip(shares, tool_calls)]


class NoStep:
    def reset(self, record):
        pass


class TakesAName:
    stop = ["?"]

    def reset(self, record):
        pass

    def step(self, text, token_ids):
        return None

    def fields(self):
        return {"char_class": "taken"}
