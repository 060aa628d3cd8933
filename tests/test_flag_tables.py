"""docs/formats.md's flag tables are the parsers': regenerated in memory (tests/flag_tables.py), they
must equal the page's, row for row; and the check fails, naming the table and the flag, on a changed
default or help text, a flag the page lacks and a flag the parser lacks."""

import argparse
import os

from conftest import ROOT

import flag_tables
import update

FORMATS = os.path.join(ROOT, "docs", "formats.md")


def test_formats_md_flag_tables_are_the_parsers():
    text = open(FORMATS, encoding="utf-8").read()
    problems = flag_tables.differences(text, flag_tables.tables())
    assert problems == [], ("docs/formats.md's flag tables differ from the parsers; rewrite them with "
                            ".venv/bin/python tests/flag_tables.py\n" + "\n".join(problems))


def changed_update_parser(change):
    """Every table from the parsers, update.py's from its parser after `change(parser, {flag: action})`."""
    parser = update.build_parser()
    actions = {a.option_strings[0]: a for a in parser._actions}
    change(parser, actions)
    return {**flag_tables.tables(), "update.py": ("flags", flag_tables.flag_rows(parser))}


def test_the_check_names_the_table_and_the_flag_that_differ():
    text = open(FORMATS, encoding="utf-8").read()
    assert flag_tables.differences(text, changed_update_parser(lambda p, a: None)) == []

    def default(parser, actions):
        actions["--clip-eps"].default = 0.3

    def help_text(parser, actions):
        actions["--beta"].help = "β: weight of the KL penalty (default 0.04)"

    def new_flag(parser, actions):
        parser.add_argument("--new-knob", type=float, default=1.5, help="a flag the page does not have")

    def removed_flag(parser, actions):
        parser._actions.remove(actions["--fsdp"])

    for change, flag, says in ((default, "--clip-eps", "| `--clip-eps` | 0.3 |"),
                               (help_text, "--beta", "(default 0.04)"),
                               (new_flag, "--new-knob", "not in docs/formats.md's table"),
                               (removed_flag, "--fsdp", "the parser has no such flag")):
        problems = flag_tables.differences(text, changed_update_parser(change))
        assert len(problems) == 1, (flag, problems)
        assert problems[0].startswith(f"update.py {flag}:") and says in problems[0], problems[0]


def test_the_check_catches_a_table_out_of_order_or_without_markers():
    text = open(FORMATS, encoding="utf-8").read()
    generated = flag_tables.tables()
    kind, rows = generated["score.py"]
    first, second, *rest = rows
    swapped = {second: rows[second], first: rows[first], **{flag: rows[flag] for flag in rest}}
    problems = flag_tables.differences(text, {**generated, "score.py": (kind, swapped)})
    assert problems == ["score.py: the table's header, order or other lines differ from the generated one"]
    unmarked = text.replace("<!-- flags: advantage.py -->", "")
    assert any(p.startswith("advantage.py: no <!-- flags: advantage.py -->")
               for p in flag_tables.differences(unmarked, generated))


def test_a_cell_is_the_parsers_default_and_help_on_one_line():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", type=float, default=1e-6, help="first line\nsecond | line")
    parser.add_argument("--b", action=argparse.BooleanOptionalAction, default=None, help="x")
    parser.add_argument("--c", required=True, nargs="+", metavar="SPEC", help="y")
    parser.add_argument("--d", default="", choices=["", "e"], help="%(default)r")
    assert list(flag_tables.flag_rows(parser).values()) == [
        "| `--a` | 1e-6 | first line second \\| line |",
        "| `--b` / `--no-b` | — | x |",
        "| `--c` `SPEC [SPEC ...]` | required | y |",
        "| `--d` `{,e}` | `''` | '' |",
    ]
