"""docs/formats.md's flag tables, generated from the parsers the commands use, so that a flag's name,
default and help text are written once, in the code.

    .venv/bin/python tests/flag_tables.py      # rewrite the tables in docs/formats.md in place

Each table sits between `<!-- flags: NAME -->` and `<!-- end flags -->`, NAME being a stage
(sample.py, score.py, advantage.py, update.py: its build_parser()), train.py (the run's own flags,
grpo/loop/configs.py's parser; the stages' flags a run takes are the stage tables') or `train.py
RUN_DEFAULTS` (the stage flags whose default differs in a run, and why). Only what is between the
markers is rewritten; the prose around a table is the page's own. tests/test_flag_tables.py
regenerates the tables in memory and fails, naming the table and the flag, where the page differs.
The generator lives beside the tests rather than in grpo/: it imports the stage scripts, which the
package never does.
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FORMATS = os.path.join(ROOT, "docs", "formats.md")
BLOCK = re.compile(r"(<!-- flags: (.+?) -->\n)(.*?)(<!-- end flags -->)", re.S)
UNSET = "—"            # a default of None: the flag is unset unless given, and its help says what happens then
SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def cell(text):
    """Text as one Markdown table cell: whitespace (the help's line breaks) joined into single spaces,
    and `|` escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def number(x):
    """A float as a reader types it: 1e-6 rather than Python's 1e-06."""
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), repr(x))


def shown(value):
    """A default as the table shows it: — for None, '' and [] in code, numbers as typed."""
    if value is None:
        return UNSET
    if value in ("", []):
        return f"`{value!r}`"
    if isinstance(value, list):
        return " ".join(map(shown, value))
    return number(value) if isinstance(value, float) else str(value)


def shown_default(action):
    """The parser's default as the table shows it: required, on/off for a switch, else shown()."""
    if action.required:
        return "required"
    if isinstance(action, SWITCHES) and action.default is not None:
        return "on" if action.default else "off"
    return shown(action.default)


def invocation(action):
    """The flag cell: its name (both spellings of a --x/--no-x switch), then its choices or the metavar
    it names as argparse's usage writes them."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(f"`{name}`" for name in action.option_strings)
    name = f"`{action.option_strings[0]}`"
    if action.choices:
        return name + " `{" + ",".join(map(str, action.choices)) + "}`"
    if action.metavar and action.nargs != 0:
        return name + f" `{action.metavar}" + (f" [{action.metavar} ...]`" if action.nargs in ("+", "*") else "`")
    return name


def help_text(parser, action):
    """The help argparse prints for the flag (with any %(default)s filled in)."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def flag_rows(parser):
    """{flag: its table row} for every flag of `parser` but --help, in the parser's order."""
    return {action.option_strings[0]: f"| {invocation(action)} | {shown_default(action)} | "
                                       f"{cell(help_text(parser, action))} |"
            for action in parser._actions if action.dest != "help"}


def run_default_rows(run_defaults, flags):
    """{flag: row} of train.py's RUN_DEFAULTS: the stage flags ({dest: (action, scripts)}) whose default
    in a run is not the stage's, the run's default and the reason."""
    rows = {}
    for dest, (value, why) in run_defaults.items():
        action, scripts = flags[dest]
        flag = action.option_strings[0]
        rows[flag] = f"| `{flag}` | {', '.join(scripts)} | {shown(value)} | {cell(why)} |"
    return rows


HEADERS = {"flags": "| flag | default | meaning |\n|---|---|---|\n",
           "run defaults": "| flag | stages | default in a run | why |\n|---|---|---|---|\n"}


def tables():
    """{NAME: (kind, {flag: row})} for every table formats.md holds, from the parsers the commands use."""
    import advantage
    import sample
    import score
    import train
    import update
    from grpo.loop import configs

    out = {script: ("flags", flag_rows(stage.build_parser()))
           for script, stage in (("sample.py", sample), ("score.py", score), ("advantage.py", advantage),
                                 ("update.py", update))}
    out["train.py"] = ("flags", flag_rows(configs.parser(train.__doc__.split("\n\n")[0], list(configs.CONFIGS))))
    out["train.py RUN_DEFAULTS"] = ("run defaults", run_default_rows(configs.RUN_DEFAULTS, train.FLAGS))
    return out


def render(kind, rows):
    return HEADERS[kind] + "".join(row + "\n" for row in rows.values())


def rewrite(text, generated):
    """`text` with every marked table replaced by the generated one; a table with no markers in the
    page, or markers that name no table, is an error."""
    found = {m.group(2) for m in BLOCK.finditer(text)}
    if found != set(generated):
        raise SystemExit(f"docs/formats.md: tables {sorted(set(generated) - found)} have no <!-- flags: NAME "
                         f"--> ... <!-- end flags --> markers; markers {sorted(found - set(generated))} name no table")
    return BLOCK.sub(lambda m: m.group(1) + render(*generated[m.group(2)]) + m.group(4), text)


def table_rows(block):
    """{flag: row} of a table as the page has it (the first `--flag` of each row names it)."""
    rows = {}
    for line in block.splitlines():
        m = re.match(r"\| `(--[\w-]+)", line)
        if m:
            rows[m.group(1)] = line
    return rows


def differences(text, generated):
    """One line per difference between the page's tables and the generated ones, naming the table and
    the flag: a row that differs, a flag missing from the page, a flag the parser does not have, a
    table with no markers, and rows out of the parser's order."""
    problems, found = [], {}
    for m in BLOCK.finditer(text):
        found[m.group(2)] = m.group(3)
    for name in sorted(set(found) - set(generated)):
        problems.append(f"docs/formats.md: <!-- flags: {name} --> names no table")
    for name, (kind, rows) in generated.items():
        if name not in found:
            problems.append(f"{name}: no <!-- flags: {name} --> ... <!-- end flags --> table in docs/formats.md")
            continue
        page, before = table_rows(found[name]), len(problems)
        for flag, row in rows.items():
            if flag not in page:
                problems.append(f"{name} {flag}: not in docs/formats.md's table; the parser has\n    {row}")
            elif page[flag] != row:
                problems.append(f"{name} {flag}: docs/formats.md says\n    {page[flag]}\n  the parser\n    {row}")
        for flag in page.keys() - rows.keys():
            problems.append(f"{name} {flag}: in docs/formats.md's table, but the parser has no such flag")
        if len(problems) == before and found[name] != render(kind, rows):
            problems.append(f"{name}: the table's header, order or other lines differ from the generated one")
    return problems


def main():
    text = open(FORMATS, encoding="utf-8").read()
    generated = tables()
    new = rewrite(text, generated)
    blocks = {m.group(2): m.group(3) for m in BLOCK.finditer(text)}
    changed = [name for name, table in generated.items() if blocks.get(name) != render(*table)]
    if new != text:
        with open(FORMATS, "w", encoding="utf-8") as f:
            f.write(new)
    print(f"docs/formats.md: {len(generated)} flag tables, {len(changed)} rewritten"
          + (f" ({', '.join(changed)})" if changed else ""))


if __name__ == "__main__":
    main()
