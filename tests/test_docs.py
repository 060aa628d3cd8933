"""README.md and docs/: every relative link leads somewhere, and every code reference names code.

A code reference is `path/file.py:name` or `path/file.py:Class.method`, the path relative to the
repository root, written anywhere in the Markdown. It resolves when the file exists and defines
`name` at its top level (a def, a class or an assignment), or `method` inside that class: checked
with the ast module, so nothing is imported. The dotted spelling `module.function` is not used;
a span like `update.train_policy` is reported so that the docs keep one form. The only exceptions
are the placeholders a reader fills in (`path/file.py:function`, the syntax of a --reward SPEC).

A link [text](target) that is not a URL must name an existing file or folder (relative to the
page), and its `#anchor` a heading of that file, by GitHub's slug rules.

The README's table of the article's claims quotes experiments/results/: each row's verdict and
interval are those of its claim's first pre-stated test.
"""

import ast
import functools
import glob
import os
import re

from conftest import ROOT

README_MAX_LINES = 250
PLACEHOLDERS = {"path/file.py:function", "file.py:function", "path/file.py:NAME", "file.py:NAME"}
CODE_REF = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
EXTENSIONS = {"py", "md", "json", "jsonl", "safetensors", "sh", "txt", "png", "ini", "gguf", "bin", "tmp"}


def markdown_files():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def without_fences(text):
    """The text with fenced code blocks blanked (their lines kept, so line numbers stay right)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading):
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation removed (letters,
    digits, `_`, `-` and spaces kept), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)           # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every heading anchor of a Markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, found = {}, set()
    for line in without_fences(open(path, encoding="utf-8").read()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def link_problems(text, page, root=ROOT):
    """One line per relative link of `text` (written in the file `page`) that leads nowhere."""
    problems = []
    for number, line in enumerate(without_fences(text).splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):                     # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            where = f"{os.path.relpath(page, root)}:{number}: ({target})"
            if not os.path.exists(full):
                problems.append(f"{where} no such file")
            elif anchor and (not full.endswith(".md") or anchor not in anchors(full)):
                problems.append(f"{where} no heading with the anchor #{anchor}")
    return problems


@functools.lru_cache(maxsize=None)
def top_level_names(path):
    """{name: None} for the top-level defs and assignments of a Python file, {class: {methods}}."""
    names = {}
    for node in ast.parse(open(path, encoding="utf-8").read(), path).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = None
    return names


def module_names(root):
    """The modules a dotted reference could name: the stage scripts and the grpo package's modules."""
    paths = glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "grpo", "**", "*.py"), recursive=True)
    return {os.path.splitext(os.path.basename(p))[0] for p in paths} - {"__init__"}


def code_ref_problems(text, page, root=ROOT):
    """One line per code reference of `text` that names no file, or nothing defined in its file."""
    problems, where = [], os.path.relpath(page, root)
    modules = module_names(root)
    for number, line in enumerate(text.splitlines(), 1):
        for path, name in CODE_REF.findall(line):
            ref = f"{path}:{name}"
            if ref in PLACEHOLDERS:
                continue
            full = os.path.join(root, path)
            if not os.path.isfile(full):
                problems.append(f"{where}:{number}: {ref}: no such file {path}")
                continue
            names = top_level_names(full)
            outer, _, method = name.partition(".")
            if outer not in names:
                problems.append(f"{where}:{number}: {ref}: {path} defines no top-level {outer}")
            elif method and (names[outer] is None or method not in names[outer]):
                problems.append(f"{where}:{number}: {ref}: {outer} in {path} has no method {method}")
        for span in INLINE_CODE.findall(line):
            m = re.fullmatch(r"(?:grpo\.(?:\w+\.)?)?(\w+)\.(\w+)(?:\.\w+)?(?:\(\))?", span)
            if m and m.group(1) in modules and m.group(2) not in EXTENSIONS:
                problems.append(f"{where}:{number}: `{span}`: write a code reference as path/file.py:name")
    return problems


def test_the_checkers_catch_what_they_are_for(tmp_path):
    page = str(tmp_path / "page.md")
    open(page, "w", encoding="utf-8").write("# A title\n\n## update.py's metrics.json\n")
    assert code_ref_problems("`update.py:ppo_clip` and `grpo/disk/checkpoints.py:BackgroundSaver.wait`",
                             page) == []
    for bad in ("see `update.py:no_such_function`", "`no_such_file.py:main`",
                "`grpo/disk/checkpoints.py:BackgroundSaver.no_such_method`", "`update.py:ppo_clip.x`",
                "`update.ppo_clip`", "`grpo.models.modeling.completion_logprobs`"):
        assert len(code_ref_problems(bad, page)) == 1, bad
    assert code_ref_problems("`--reward path/file.py:function`, `train.py`, `metrics.json`", page) == []
    assert link_problems("[a](page.md) [b](#a-title) [c](page.md#updatepys-metricsjson) "
                         "[d](https://example.com/x.md)", page) == []
    for bad in ("[a](nope.md)", "[b](#no-such-heading)", "[c](page.md#a-titl)", "[d](../nope/page.md#a-title)"):
        assert len(link_problems(bad, page)) == 1, bad
    assert link_problems("```\n[a](nope.md)\n```\n", page) == []        # inside a code block: not a link


def test_slugs_follow_githubs_rules():
    assert slug("update.py's metrics.json") == "updatepys-metricsjson"
    assert slug("PPO with a critic: what GRPO removes") == "ppo-with-a-critic-what-grpo-removes"
    assert slug("`--loss-agg` and [the table](x.md)") == "--loss-agg-and-the-table"


def test_every_relative_link_resolves():
    problems = [p for path in markdown_files()
                for p in link_problems(open(path, encoding="utf-8").read(), path)]
    assert problems == [], "\n".join(problems)


def test_every_code_reference_resolves():
    problems = [p for path in markdown_files()
                for p in code_ref_problems(open(path, encoding="utf-8").read(), path)]
    assert problems == [], "\n".join(problems)


def test_readme_is_short_and_indexes_every_docs_page():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for path in markdown_files()[1:]:
        assert f"](docs/{os.path.basename(path)})" in readme, path


def plain_cell(text):
    """A table cell as the checks compare it: ASCII minus, no bold, no padding."""
    return text.replace("−", "-").replace("**", "").strip()


def first_test(results_md):
    """(verdict, estimate, [low, high]) of the first row of a claim table's pre-stated tests."""
    section = results_md.split("## Pre-stated tests", 1)[1]
    row = [line for line in section.splitlines() if line.startswith("| ")][1]      # past the header
    cells = [plain_cell(c) for c in row.strip("|").split("|")]
    return cells[6], cells[4], re.match(r"(\[[^\]]*\])", cells[5]).group(1)


def claims_quote_problems(readme, results_dir):
    """One line per row of the README's claims table that does not quote its results table: the
    verdict a prefix of the table's first test's, its estimate and interval written as in the table;
    a claim with no table may not have a verdict, and one with a table must."""
    problems = []
    section = readme.split("## The article's claims, measured", 1)[1].split("\n## ", 1)[0]
    for row in [line for line in section.splitlines() if re.match(r"\| C\d+ ", line)]:
        cells = [plain_cell(c) for c in row.strip("|").split("|")]
        claim, verdict, difference = cells[0].split()[0], cells[1], cells[2]
        path = os.path.join(results_dir, f"{claim.lower()}.md")
        if not os.path.exists(path):
            if verdict not in ("next", "to run"):
                problems.append(f"{claim}: a verdict ({verdict}) with no {os.path.basename(path)}")
            continue
        table_verdict, estimate, interval = first_test(open(path, encoding="utf-8").read())
        if not verdict or not table_verdict.startswith(verdict.split(" alone")[0]):
            problems.append(f"{claim}: the README says '{verdict}', the table '{table_verdict}'")
        if f"{estimate} {interval}" not in difference:
            problems.append(f"{claim}: the README says '{difference}', the table '{estimate} {interval}'")
    return problems


def test_the_claims_checker_catches_a_misquote(tmp_path):
    table = ("# C1\n\n## Pre-stated tests (Welch)\n\n| test | metric | contrast | predicted | estimate | "
             "95% interval | verdict |\n|---|---|---|---|---|---|---|\n| t | m | a − b | > 0 | +0.026 | "
             "[-0.038, +0.090] (ν = 2.1) | **not distinguishable at this scale** |\n")
    open(tmp_path / "c1.md", "w", encoding="utf-8").write(table)
    head = "## The article's claims, measured\n\n| claim | verdict | difference |\n|---|---|---|\n"
    good = "| C1 x | not distinguishable | AUC a − b: +0.026 [−0.038, +0.090] |\n| C2 y | to run | |\n"
    assert claims_quote_problems(head + good, str(tmp_path)) == []
    for bad in (good.replace("+0.090", "+0.091"), good.replace("not distinguishable", "**reproduced**"),
                good.replace("to run", "reproduced"), good.replace("not distinguishable", "next")):
        assert len(claims_quote_problems(head + bad, str(tmp_path))) == 1, bad


def test_the_readme_quotes_each_claims_table():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    problems = claims_quote_problems(readme, os.path.join(ROOT, "experiments", "results"))
    assert problems == [], "\n".join(problems)


# ----------------------------------------------------------------------------------------
# Defaults stated in the prose: equal to the parsers'

DEFAULT_STATED = [
    re.compile(r"`--([a-z][a-z0-9-]*)(?: ([^`|]+))?`[^()\n`]{0,60}\(default(?:[: ]+([^),;]+))?[),;]"),
    re.compile(r"`--([a-z][a-z0-9-]*)()`\s+\((\d[\d.e-]*)\)"),             # `--rollout-is-cap` (2)
]


def parser_defaults():
    """{flag: [defaults]} over every stage's parser and train.py's run (whose defaults may differ)."""
    import advantage
    import sample
    import score
    import train
    import update
    from grpo.loop import configs

    defaults = {}
    parsers = [stage.build_parser() for stage in (sample, score, advantage, update)]
    parsers.append(configs.parser("", list(configs.CONFIGS)))
    for parser in parsers:
        for action in parser._actions:
            for flag in action.option_strings:
                defaults.setdefault(flag[2:], []).append(action.default)
    for dest, (value, _) in configs.RUN_DEFAULTS.items():
        defaults.setdefault(dest.replace("_", "-"), []).append(value)
    return defaults


def same_value(stated, default):
    try:
        return float(stated) == float(default)
    except (TypeError, ValueError):
        return str(stated) == str(default)


def stated_default_problems(text, where, defaults):
    """One line per default the prose states for a flag that no parser has, or has otherwise. A
    default the parser leaves None or empty (computed at run time) may be described in words."""
    problems = []
    for pattern in DEFAULT_STATED:
        for m in pattern.finditer(text):
            flag, choice, value = m.group(1), m.group(2) or None, m.group(3)
            stated = (choice or value or "").strip().split()[0].strip("`")
            if flag not in defaults:
                problems.append(f"{where}: --{flag}: no parser has this flag")
            elif not any(d is None or d == "" or same_value(stated, d) for d in defaults[flag]):
                problems.append(f"{where}: --{flag}: the prose says default {stated}, the parsers "
                                f"{sorted(map(str, defaults[flag]))}")
    return problems


def test_every_default_the_prose_states_is_the_parsers():
    """docs/formats.md's tables are generated from the parsers (tests/flag_tables.py); elsewhere a
    default written beside its flag must be a parser's."""
    defaults, problems = parser_defaults(), []
    for path in markdown_files():
        if not path.endswith("formats.md"):
            problems += stated_default_problems(open(path, encoding="utf-8").read(), os.path.relpath(path, ROOT),
                                                defaults)
    assert problems == [], "\n".join(problems)
    planted = stated_default_problems("`--beta` (default 0.04) and `--loss-agg token` (default) and "
                                      "`--rollout-is-cap` (3) and `--no-such-flag` (default 1)", "page", defaults)
    assert len(planted) == 4, planted


# ----------------------------------------------------------------------------------------
# The README's symbol table: each row's code computes its symbol

def definition_source(path, name):
    """The source of `name` (a def, a class, an assignment, or Class.method) at the top level of path."""
    src = open(os.path.join(ROOT, path), encoding="utf-8").read()
    outer, _, method = name.partition(".")
    for node in ast.parse(src).body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] + [getattr(node, "name", None)]
        if outer in names:
            body = [n for n in getattr(node, "body", []) if getattr(n, "name", None) == method] if method else [node]
            return ast.get_source_segment(src, body[0]) if body else ""
    return ""


def symbol_row_problems(row):
    """A row of the symbol table whose functions do not hold what it names: every marker of its code
    cell (a backticked span that is no reference: `beta`), or, without markers, one of its symbols or
    the dest of a flag it names (--group-size: group_size)."""
    symbol, meaning, code = [c.strip() for c in row.strip().strip("|").split(" | ")]
    refs = CODE_REF.findall(code)
    sources = [definition_source(path, name) for path, name in refs]
    markers = [m for m in INLINE_CODE.findall(code) if not CODE_REF.fullmatch(m) and not m.startswith("--")]
    if markers:
        missing = [m for m in markers if not any(m in s for s in sources)]
        return [f"{symbol}: {', '.join(missing)} not in {[n for _, n in refs]}"] if missing else []
    flags = [f.replace("-", "_") for f in re.findall(r"--([a-z][a-z0-9-]*)", row)]
    candidates = flags + [c.strip().strip("`") for c in re.split(r"[,/]", symbol) if c.strip()]
    if not any(c in s for c in candidates for s in sources):
        return [f"{symbol}: none of {candidates} in {[n for _, n in refs]}"]
    return []


def test_each_symbol_rows_code_computes_its_symbol():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table = readme.split("## Where each symbol of the paper lives")[1].split("\n\n")[2]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert len(rows) > 25
    problems = [p for row in rows for p in symbol_row_problems(row)]
    assert problems == [], "\n".join(problems)
    planted = ["| β | KL weight (`--beta`) | `grpo/training/minibatches.py:aggregate` |",
               "| ε | clip range | `update.py:clipped_surrogate` (`clip.dual`) |"]
    assert all(symbol_row_problems(row) for row in planted)
