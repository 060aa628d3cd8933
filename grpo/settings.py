"""Settings: the range rules every stage applies to its flags, and train.py's run configuration made
from the stages' own parsers, so that a setting has one name, type, default and help text.

A stage checks its arguments with `check(args, RULES)` before it reads or writes anything, and
train.py builds each stage's arguments with that stage's own parse_args, so a run is checked by the
same rules before its folder exists. A rule is a range (`at_least(1)`, `above(0)`, `between(0, 1)`);
combinations of flags are checked in the stage's parse_args.
"""

import argparse
import math

from grpo.cli import StageError
from grpo.disk import files


class Range:
    """lo ≤ x ≤ hi (either end open, or absent), for a number or each number of a list."""

    def __init__(self, lo=None, hi=None, lo_open=False, hi_open=False, infinite=False):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        self.infinite = infinite            # +inf is a value (no limit), not a mistake

    def __call__(self, x):
        return ((self.lo is None or (x > self.lo if self.lo_open else x >= self.lo))
                and (self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)))

    def __str__(self):
        if self.lo is None and self.hi is None:
            return "a finite number"
        if self.hi is None:
            return f"{'>' if self.lo_open else '≥'} {self.lo:g}" + (" (inf: no limit)" if self.infinite else "")
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


FINITE = Range()


def at_least(lo):
    return Range(lo)


def above(lo):
    return Range(lo, lo_open=True)


def between(lo, hi, lo_open=False, hi_open=False):
    return Range(lo, hi, lo_open=lo_open, hi_open=hi_open)


def above_or_inf(lo):
    return Range(lo, lo_open=True, infinite=True)


def check(args, rules):
    """Stop with one line naming the first flag outside its range (or not finite); unset flags pass."""
    for name, rule in rules.items():
        value = getattr(args, name, None)
        for x in value if isinstance(value, list) else [] if value is None else [value]:
            if not ((math.isfinite(x) or (rule.infinite and x == math.inf)) and rule(x)):
                shown = f"{x:g}" + (" (not finite)" if not math.isfinite(x) and rule.lo is None else "")
                raise StageError(f"--{name.replace('_', '-')} must be {rule}, got {shown}")


# ----------------------------------------------------------------------------------------
# train.py's run configuration: the stages' flags, each once

def kind(action):
    """(element type, is a list) of a flag: bool for switches, else its argparse type (str if none)."""
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        return bool, False
    element = action.type if isinstance(action.type, type) else str        # a checking function takes a string
    return element, action.nargs in ("+", "*")


def stage_flags(parsers, owned):
    """{dest: (action, [scripts])}: every flag of the stage parsers ({script: parser}) but those a run
    sets itself at each iteration (owned[script]), once, with the stages that take it. Flags of one name
    in several stages are one setting, so they must be of one kind."""
    flags = {}
    for script, parser in parsers.items():
        for action in parser._actions:
            if action.dest == "help" or action.dest in owned[script]:
                continue
            if action.dest in flags:
                first, scripts = flags[action.dest]
                assert kind(first) == kind(action), f"--{action.dest}: {scripts[0]} and {script} disagree"
                scripts.append(script)
            else:
                flags[action.dest] = (action, [script])
    return flags


def add_flags(parser, flags, defaults):
    """Add each stage flag to train.py's parser with its help text, the stages that take it, and the
    run's default where it differs from the stage's; the parsed value is None where not given."""
    for dest, (action, scripts) in flags.items():
        element, is_list = kind(action)
        where = ", ".join(scripts) + (f"; in a run: {defaults[dest][0]!r}, since {defaults[dest][1]}"
                                      if dest in defaults else "")
        text = f"{action.help} [{where}]".replace("%", "%%")       # argparse formats help with %
        if element is bool:
            parser.add_argument(action.option_strings[0], action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:                                             # a list flag given twice appends
            parser.add_argument(action.option_strings[0], type=element, nargs=action.nargs, default=None,
                                action="extend" if is_list else "store", choices=action.choices,
                                metavar=action.metavar, help=text)


def argv(parser, values):
    """The command line that gives `parser` these values ({dest: value}): a flag for each of its flags
    whose value is set and not the parser's default switch position (None and [] are unset)."""
    out = []
    for action in parser._actions:
        value = values.get(action.dest)
        if value is None or value == [] or action.dest == "help" or (isinstance(value, bool)
                                                                      and value == action.default):
            continue
        out.append(("--" if value is not False else "--no-") + action.dest.replace("_", "-"))
        if isinstance(value, list):
            out += map(str, value)
        elif not isinstance(value, bool):
            out.append(str(value))
    return out


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
LIST_NAMES = {int: "a list of integers", float: "a list of numbers", str: "a list of strings"}


def check_types(fields, kinds, path):
    """A --config-file's values against each field's kind ({name: (element type, is a list)}): one line
    naming the field, the type expected and the value given. None is allowed (unset)."""
    for name, value in fields.items():
        element, is_list = kinds[name]
        values = value if is_list and isinstance(value, list) else [value]
        ok = (is_list == isinstance(value, list) or value is None) and all(
            v is None or (isinstance(v, element) and not (element is not bool and isinstance(v, bool)))
            or (element is float and isinstance(v, int) and not isinstance(v, bool)) for v in values)
        if not ok:
            expected = LIST_NAMES[element] if is_list else TYPE_NAMES[element]
            raise StageError(f"{path}: field {name!r} must be {expected}, got {value!r}")


def defaults(parser, flags, run_defaults, command):
    """Every setting at its default: the run's own (its parser's), and each stage flag's (the stage's,
    or run_defaults' where a run's default differs)."""
    run = {a.dest: a.default for a in parser._actions if a.dest not in command and a.dest not in flags}
    return {**run, **{name: run_defaults[name][0] if name in run_defaults else action.default
                      for name, (action, _) in flags.items()}}


def kinds(parser, flags, command):
    """Each setting's (element type, is a list)."""
    run = {a.dest: kind(a) for a in parser._actions if a.dest not in command and a.dest not in flags}
    return {**run, **{name: kind(action) for name, (action, _) in flags.items()}}


def in_todays_names(fields):
    """Settings saved by an earlier version, in today's names: --rewards became --reward (with
    --reward-weights); --ratio-level sequence became --policy-loss gspo, and --dual-clip C alone
    --policy-loss dual_clip (update.py:POLICY_LOSSES)."""
    fields = dict(fields)
    if "rewards" in fields and "reward" not in fields:
        fields["reward"] = fields.pop("rewards")
    if "ratio_level" in fields and "policy_loss" not in fields:
        sequence = fields.pop("ratio_level") == "sequence"
        fields["policy_loss"] = "gspo" if sequence else "dual_clip" if fields.get("dual_clip") is not None else "ppo"
    return fields


def read_config(path, defaults, kinds):
    """Settings from a JSON file: {"config": {...}} as a run's config.json holds them, or the settings
    alone, checked by name and type; those it leaves out take their default."""
    saved = files.read_json(path)
    fields = saved.get("config", saved) if isinstance(saved, dict) else None
    if not isinstance(fields, dict):
        raise StageError(f"{path}: expected a JSON object of settings")
    fields = in_todays_names(fields)
    unknown = sorted(set(fields) - set(defaults))
    if unknown:
        raise StageError(f"{path}: unknown settings {', '.join(unknown)}")
    check_types(fields, kinds, path)
    return {**defaults, **fields}
