"""A multi-turn environment for sample.py/train.py --env examples/guess_number.py:GuessNumber:
the model guesses the record's number, the environment answers "higher" or "lower" until it is right
(docs/environments.md). Its reward, --reward examples/guess_number.py:solved, is 1 for a solved game,
less 0.1 for each guess after the first; the records, e.g.
    {"prompt": "Guess my number from 1 to 100. Reply with one number.", "secret": 37}
"""

import re

NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    role = "user"                        # its replies are the user's turns in a chat

    def reset(self, record):
        """Before the first turn: the record of the prompt (its fields, as reward functions see them)."""
        self.secret, self.guesses, self.solved = int(record["secret"]), 0, False

    def step(self, text, token_ids):
        """After each turn the policy finished: its text and ids; the reply, or None to end the game."""
        numbers = NUMBER.findall(text)
        if not numbers:
            return "Reply with one number."
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            self.solved = True
            return None
        return "higher" if guess < self.secret else "lower"

    def fields(self):
        """What reward functions get as keyword lists, one value per row."""
        return {"guesses": self.guesses, "solved": self.solved}


def solved(prompts, completions, guesses, solved, **fields):
    return [max(0.0, 1.0 - 0.1 * (g - 1)) if s else 0.0 for g, s in zip(guesses, solved)]
