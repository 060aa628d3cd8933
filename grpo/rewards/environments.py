"""Environments for multi-turn episodes (sample.py --env SPEC): the contract, the episode loop, its
loader, the tool helper and the built-in calculators.

An environment is the other party of an episode. sample.py makes one per row by calling the SPEC's
object with no arguments, then:

    env.reset(record)               before the first turn, with the prompt's record (a dict)
    env.step(text, token_ids)       after each policy turn that ended (EOS, or one of env.stop), with
        -> str | None               the turn's text (special tokens skipped) and its token ids: the
                                    environment's reply, appended as its own turn, or None to end
    env.stop        (optional)      strings that end a policy turn as EOS does (a tool call's closing tag)
    env.role        (optional)      the role of its turns in a chat (default "user"); None: its reply is
                                    written in-line, into the policy's turn, which goes on after it
    env.fields()    (optional)      -> dict of what reward functions see of the episode (keyword lists
                                    in score.py, columns of samples.jsonl), for example its tool calls

A reply is tokenized once, as the chat template puts it between two assistant turns (or as it is for a
string prompt), and never again: the ids the update trains on are the ids the policy drew and the
environment's as tokenized here (docs/environments.md). An environment is trusted code, as a reward is.

A SPEC is a built-in name (calculator), `module:NAME` or `path/file.py:NAME`.
"""

import ast
import functools
import operator
import os
import re
from fractions import Fraction

import torch

from grpo.cli import StageError
from grpo.rewards import prompting, reward_specs


@torch.inference_mode()
def sample_episodes(prompt_ids, prompt_mask, envs, chats, tokenizer, eos_ids, max_new_tokens, max_turns, sample_turn):
    """Episodes of policy turns and environment replies, one per row (grpo/rewards/environments.py): each
    turn is drawn by `sample_turn(ids, mask, rooms)` (sample_completions with the run's τ and truncation,
    ending a row at its EOS, a stop string or its room [n'] of the budget) from the row's prompt and
    every turn before it, and the environment's reply to a finished turn is tokenized once. The ids are concatenated as they come, never re-tokenized, so the
    update reads exactly what the policy drew and what the environment said.

    An episode ends when its environment returns None, when a turn runs out of the budget of
    max_new_tokens tokens for all turns (truncated), or after max_turns policy turns (truncated if the
    environment still replied: its reply is dropped, as is one that leaves no room for another turn).
    Returns the completion columns with loss_mask [n, T], true on the policy's tokens (old and sampler
    log-probs are 0 on the environment's), and each row's turns as chat messages (an environment whose
    role is None writes in-line, into the policy's own message, as Toolformer's calculator does)."""
    n, device, role = len(envs), prompt_ids.device, getattr(envs[0], "role", "user")
    stops = getattr(envs[0], "stop", None) or ()
    context = [ids[mask].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]      # the prompt, then turns
    rows = [{"ids": [], "policy": [], "old": [], "q": [], "turns": [], "truncated": False} for _ in range(n)]
    live, truncating = list(range(n)), False
    for turn in range(max_turns):
        rooms = torch.tensor([max_new_tokens - len(rows[r]["ids"]) for r in live], device=device)   # [n']
        ids, mask = prompting.left_pad([context[r] for r in live], tokenizer.pad_token_id)      # [n', P']
        out = sample_turn(ids.to(device), mask.to(device), rooms)       # no row draws past its room
        truncating = "sampler_logprobs" in out
        still = []
        for j, r in enumerate(live):
            row = rows[r]
            length = int(out["completion_mask"][j].sum())             # up to its EOS, stop string or room
            turn_ids = out["completion_ids"][j, :length].tolist()
            row["ids"] += turn_ids
            row["policy"] += [True] * length
            row["old"] += out["old_logprobs"][j, :length].tolist()
            row["q"] += out["sampler_logprobs"][j, :length].tolist() if truncating else []
            text = tokenizer.decode(turn_ids, skip_special_tokens=True)
            if role is None and row["turns"]:                 # an in-line tool: one assistant message
                row["turns"][-1]["content"] += text
            else:
                row["turns"].append({"role": "assistant", "content": text})
            said = up_to_stop(text, stops)                    # the text up to the stop string that ended it
            ended = said is not None or turn_ids[-1] in eos_ids
            reply = envs[r].step(text if said is None else said, turn_ids) if ended else None
            if reply is not None:
                eos_text = tokenizer.decode(turn_ids[-1:]) if turn_ids[-1] in eos_ids else ""
                new = tokenizer(reply_text(tokenizer, chats[r], role, reply, eos_text),
                                add_special_tokens=False)["input_ids"]
            row["truncated"] = not ended or (reply is not None and (
                turn == max_turns - 1 or len(row["ids"]) + len(new) >= max_new_tokens))
            if reply is None or row["truncated"]:
                continue
            row["ids"] += new
            row["policy"] += [False] * len(new)
            row["old"] += [0.0] * len(new)
            row["q"] += [0.0] * len(new) if truncating else []
            if role is None:
                row["turns"][-1]["content"] += reply
            else:
                row["turns"].append({"role": role, "content": reply})
            context[r] += turn_ids + new
            still.append(r)
        live = still
        if not live:
            break
    T = max(len(row["ids"]) for row in rows)

    def column(key, pad, dtype):                                                        # [n, T]
        return torch.tensor([row[key] + [pad] * (T - len(row[key])) for row in rows], dtype=dtype, device=device)
    lengths = torch.tensor([len(row["ids"]) for row in rows], device=device)            # [n]
    columns = {"completion_ids": column("ids", tokenizer.pad_token_id, torch.long),
               "completion_mask": torch.arange(T, device=device)[None] < lengths[:, None],
               "loss_mask": column("policy", False, torch.bool), "old_logprobs": column("old", 0.0, torch.float32),
               "truncated": torch.tensor([row["truncated"] for row in rows], device=device)}
    if truncating:
        columns["sampler_logprobs"] = column("q", 0.0, torch.float32)
    return columns, [row["turns"] for row in rows]


class Tools:
    """Tools the model calls by writing <NAME>argument</NAME>: the first call of a turn is answered with
    <result>value</result> (or <result>error: why</result>), and a turn that calls nothing ends the
    episode. Each closing tag is a stop string: the policy's turn ends with the token that completes it."""

    role = "user"

    def __init__(self, **functions):
        self.functions = functions                    # name -> function(argument: str) -> value
        self.stop = [f"</{name}>" for name in functions]
        self.call = re.compile(r"<(%s)>(.*?)</\1>" % "|".join(map(re.escape, functions)), re.DOTALL)
        self.calls = 0

    def reset(self, record):
        self.calls = 0

    def step(self, text, token_ids):
        found = self.call.search(text)
        if found is None:
            return None
        self.calls += 1
        name, argument = found.groups()
        try:
            value = self.functions[name](argument.strip())
        except ToolError as e:
            value = f"error: {e}"
        return f"<result>{value}</result>"

    def fields(self):
        return {"tool_calls": self.calls}


class ToolError(ValueError):
    """A tool's answer to a bad argument, which the model reads as its result."""


# The calculator's grammar: numbers, + − × ÷ and parentheses; nothing else is evaluated.
_ARITHMETIC = re.compile(r"[0-9.+\-*/() ]+")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression, max_chars=100):
    """The value of an arithmetic expression (integers, decimals, + - * / and parentheses), exact: an
    integer, or a decimal rounded to 6 places. Its characters are checked first (no exponents, names or
    other notations), then it is parsed by Python's ast and walked by hand, never evaluated; within
    max_chars no value has more than about max_chars digits. Anything else is a ToolError."""
    if len(expression) > max_chars:
        raise ToolError(f"longer than {max_chars} characters")
    expression = expression.replace("×", "*").replace("÷", "/").replace(",", "")
    if not _ARITHMETIC.fullmatch(expression):
        raise ToolError("only numbers, + - * / and parentheses")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError("not an arithmetic expression") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(ast.get_source_segment(expression, node))        # the digits as written
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ToolError("division by zero")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ToolError("only numbers, + - * / and parentheses")

    result = value(tree.body)
    if result.denominator == 1:
        return str(result.numerator)
    millionths = round(result * 10 ** 6)                                 # exact: Fractions all the way
    sign, whole, rest = "-" if millionths < 0 else "", *divmod(abs(millionths), 10 ** 6)
    return f"{sign}{whole}.{rest:06d}".rstrip("0").rstrip(".") if millionths else "0"


class Calculator(Tools):
    """The built-in environment: one tool, <calc>expression</calc>, answered by `calculate`."""

    def __init__(self):
        super().__init__(calc=calculate)


# An arithmetic expression just before a turn's "=": digits, operators, parentheses and spaces.
_LAST_EXPRESSION = re.compile(r"[\d.,()+\-*/×÷ ]*[\d)]\s*[+\-*/×÷]\s*[\d.,()+\-*/×÷ ]*$")


class InlineCalculator:
    """Toolformer's calculator (Schick et al. 2023): whenever the model writes "=" after an arithmetic
    expression ("964 * 59 ="), the result is written after it in its own turn (" 56876") and the model
    goes on; no format to learn, which a model too small to follow <calc> instructions needs. The
    result's ids are the environment's (false in loss_mask)."""

    role, stop = None, ["="]

    def reset(self, record):
        self.calls = 0

    def step(self, text, token_ids):
        if not text.endswith("="):
            return None                              # the turn ended with EOS: the answer is given
        window = text[:-1][-101:]                    # one more than calculate takes: longer is refused
        found = _LAST_EXPRESSION.search(window)
        if found and found.start() == 0 and len(text) - 1 > len(window):
            found = None                             # the expression goes on before the window
        try:
            value = calculate(found.group().strip()) if found else None
        except ToolError:
            value = None
        if value is None:
            return ""                                # an "=" after no expression: nothing to write
        self.calls += 1
        return f" {value}"

    def fields(self):
        return {"tool_calls": self.calls}


BUILT_IN = {"calculator": Calculator, "inline_calculator": InlineCalculator}


def make(spec, records, group_size):
    """One environment of --env SPEC per row, G a record, each reset with its row's record."""
    factory = load_env(spec)[1]
    envs = [factory() for _ in range(len(records) * group_size)]
    for row, env in enumerate(envs):
        env.reset(records[row // group_size])
    return envs


def load_env(spec):
    """--env SPEC to (name, the factory called once per episode), checked by making one environment:
    once per process for a SPEC's file as it is (its absolute path and modification time), so a run's
    every rollout reuses the factory parse_args loaded, and an edited file is loaded anew."""
    target = spec.rpartition(":")[0]
    if target.endswith(".py") and os.path.isfile(target):
        return _load_env(spec, os.path.abspath(target), os.path.getmtime(target))
    return _load_env(spec, None, None)


@functools.cache
def _load_env(spec, path, mtime):
    """load_env's work, cached by `path` and `mtime` too."""
    if spec in BUILT_IN:
        return spec, BUILT_IN[spec]
    if ":" not in spec:
        raise StageError(f"--env {spec!r}: unknown environment; expected a built-in name ({', '.join(BUILT_IN)}), "
                         f"module:NAME or path/file.py:NAME")
    name, factory = reward_specs.load_user_function(spec, flag="--env", kind="class or function")
    env = factory()
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise StageError(f"--env {spec!r}: {name}() made an object without {' and '.join(missing)}(); an "
                         f"environment has reset(record) and step(text, token_ids) (docs/environments.md)")
    return name, factory


def reply_text(tokenizer, chat, role, reply, eos_text):
    """The text that follows a policy turn for the environment's `reply`: in a chat (a chat template and
    a chat prompt), what the template writes after an assistant's words up to the next assistant turn
    (the assistant turn's end, unless `eos_text`, the EOS that ended it, is already that end; the reply's
    turn; the generation prompt); otherwise (or in-line, role None) the reply as it is."""
    if not chat or tokenizer.chat_template is None or role is None:
        return reply
    mark = "\x00assistant-words\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": mark},
                                          {"role": role, "content": reply}], tokenize=False, add_generation_prompt=True)
    after = text[text.index(mark) + len(mark):]
    return after[len(eos_text):] if eos_text and after.startswith(eos_text) else after


def turn_ends(tokenizer, strings):
    """sample_completions' `stop` for an episode's turn, given the tokens [n] drawn so far and the rows'
    rooms [n]: the rows that have drawn their room, or whose last tokens, decoded, hold a stop string.
    A token writes at least one byte, so a string that the last len(string in UTF-8) + 1 tokens do not
    hold was not just written (the one more: a tokenizer may drop the first one's leading space)."""
    width = max((len(s.encode()) for s in strings), default=0) + 1

    def ended(tokens, rooms):
        full = len(tokens) >= rooms                                                         # [n]
        if not strings:
            return full
        tails = torch.stack(tokens[-width:], dim=1).tolist()                                # [n, ≤width]
        return full | torch.tensor([any(s in tokenizer.decode(tail) for s in strings) for tail in tails],
                                   device=full.device)
    return ended


def up_to_stop(text, strings):
    """`text` up to the end of the first stop string in it (a token may write more after it), or None."""
    ends = [text.find(s) + len(s) for s in strings if s in text]
    return text[:min(ends)] if ends else None


def episode_row(sample, turns, env):
    """samples.jsonl's row of an episode: the sampler's row (its completion the whole episode's text) with
    the turns, and the environment's fields, which must not take a name the row already has."""
    fields = fields_of(env)
    taken = sorted(set(fields) & (set(sample) | {"turns", "completion_ids"}))
    if taken:
        raise StageError(f"the environment's fields {', '.join(map(repr, taken))} have the name of a column of "
                         f"samples.jsonl (the prompt record's or the stages'); rename them")
    return {**sample, "turns": turns, **fields}


def field_names(factory, records):
    """The names of the fields an environment gives reward functions: those of a new one reset with the
    first record (so a reward that needs a field no one gives stops before any sampling)."""
    if not records:
        return set()
    env = factory()
    env.reset(records[0])
    return set(fields_of(env))


def fields_of(env):
    """The environment's fields() (optional in the contract): {} for one without."""
    return env.fields() if callable(getattr(env, "fields", None)) else {}
