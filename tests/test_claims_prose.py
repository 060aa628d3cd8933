"""Every sentence about a claim says what its table says: the README's claims table and each claim's
bullet in docs/claims.md are read against experiments/results/CLAIM.md.

- A verdict in bold is a verdict of the table: in the README only in the verdict column, where it is
  the first test's, and only where it holds under Holm too (else the cell says both, unbolded); in a
  bullet, the first bold verdict is the first test's, and every other one is
  the verdict of some test of the table (alone, under Holm, or at the second look).
- Every interval quoted as `E [L, H]` and every `mean ± std` is in the table, at the precision
  written, unless its sentence says it lies outside the plan ("outside the plan", "computed
  afterwards"), where it is an observation from the records, not a test.
"""

import os
import re

from conftest import ROOT

NUMBER = r"[+\-−]?\d+(?:\.\d+)?"
INTERVAL = re.compile(rf"({NUMBER}),? \[({NUMBER}), ({NUMBER})\]")
MEAN_STD = re.compile(r"(\d+(?:\.\d+)?) ± (\d+(?:\.\d+)?)")
BOLD = re.compile(r"\*\*([^*]+)\*\*")
VERDICTS = ("reproduced", "refuted", "not distinguishable", "withdrawn")
OUTSIDE = ("outside the plan", "computed afterwards", "not a stated test")


def number(text):
    return float(text.replace("−", "-").replace("+", ""))


def same(written, exact):
    """Whether `exact` (a table's number) rounds to `written` at the precision it is written with."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return abs(round(number(exact), decimals) - number(written)) < 10 ** -(decimals + 3)


def table_of(claim):
    path = os.path.join(ROOT, "experiments", "results", f"{claim.lower()}.md")
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


def table_facts(md):
    """(its intervals, its mean ± std pairs, its verdicts, the first test's verdict) of a claim's table."""
    intervals = INTERVAL.findall(md)
    section = md.split("## Pre-stated tests", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    verdicts, first, first_family = set(), None, None
    for row in rows:
        cells = [c.replace("**", "").strip() for c in row.strip("|").split("|")]
        if len(cells) < 8 or not cells[5].startswith("["):
            break
        intervals.append((cells[4], *re.findall(NUMBER, cells[5])[:2]))
        verdicts.update([cells[6], cells[7]])
        first, first_family = first or cells[6], first_family or cells[7]
    verdicts.update(c.replace("**", "").strip() for c in re.findall(r"\| ([^|]*(?:reproduced|refuted|"
                                                                      r"not distinguishable)[^|]*) ", md))
    return intervals, MEAN_STD.findall(md), verdicts, (first, first_family)


def outside_the_plan(text, start, end, reach=220):
    return any(word in text[max(0, start - reach):end + reach] for word in OUTSIDE)


def number_problems(where, text, md):
    intervals, pairs, _, _ = table_facts(md)
    problems = []
    for m in INTERVAL.finditer(text):
        if outside_the_plan(text, m.start(), m.end()):
            continue
        if not any(all(same(w, t) for w, t in zip(m.groups(), row)) for row in intervals):
            problems.append(f"{where}: '{m.group(0)}' is in no interval of its table")
    for m in MEAN_STD.finditer(text):
        if outside_the_plan(text, m.start(), m.end()):
            continue
        if not any(same(m.group(1), a) and same(m.group(2), b) for a, b in pairs):
            problems.append(f"{where}: '{m.group(0)}' is in no mean ± std of its table")
    return problems


def readme_problems(readme):
    problems = []
    section = readme.split("## The article's claims, measured", 1)[1].split("\n## ", 1)[0]
    for row in [line for line in section.splitlines() if re.match(r"\| C\d+ ", line)]:
        cells = row.strip("|").split("|")
        claim = cells[0].split()[0]
        md = table_of(claim)
        if md is None:
            continue
        for cell in cells[2:]:
            for bold in BOLD.findall(cell):
                problems.append(f"README {claim}: '**{bold}**' in bold outside the verdict column")
        alone, family = table_facts(md)[3]
        if alone != family and ("**" in cells[1] or "Holm" not in cells[1]):
            problems.append(f"README {claim}: the first test is {alone} alone and {family} under Holm; its verdict "
                            f"cell must say both, without bold")
        problems += number_problems(f"README {claim}", "|".join(cells[2:]), md)
    return problems


def bullets(claims_md):
    """{claim: its bullet's text} of docs/claims.md (a bullet starts `- **CN**`)."""
    found = {}
    for m in re.finditer(r"^- \*\*(C\d+)\*\*(.*?)(?=^- \*\*C\d+\*\*|^\*\*|^#|\Z)", claims_md, re.M | re.S):
        found[m.group(1)] = m.group(2)
    return found


def bullet_problems(claims_md):
    problems = []
    for claim, text in bullets(claims_md).items():
        md = table_of(claim)
        if md is None:
            continue
        _, _, verdicts, (first, _) = table_facts(md)
        said = [" ".join(b.split()).strip(" .") for b in BOLD.findall(text)]
        said = [b for b in said if b.startswith(VERDICTS)]
        if said and not first.startswith(said[0]):
            problems.append(f"docs/claims.md {claim}: first verdict '{said[0]}', the table's first test '{first}'")
        for verdict in said:
            if not any(v.startswith(verdict) for v in verdicts):
                problems.append(f"docs/claims.md {claim}: '**{verdict}**' is no verdict of its table")
        problems += number_problems(f"docs/claims.md {claim}", text, md)
    return problems


def test_every_sentence_says_what_its_table_says():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    claims_md = open(os.path.join(ROOT, "docs", "claims.md"), encoding="utf-8").read()
    assert len(bullets(claims_md)) == 10
    problems = readme_problems(readme) + bullet_problems(claims_md)
    assert problems == [], "\n".join(problems)


def test_a_planted_overstatement_is_caught():
    """A bold verdict outside the verdict column, a verdict no test has, and a misquoted interval."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    claims_md = open(os.path.join(ROOT, "docs", "claims.md"), encoding="utf-8").read()
    row = next(line for line in readme.splitlines() if line.startswith("| C9 "))
    before = len(readme_problems(readme))
    assert len(readme_problems(readme.replace(row, row[:-1] + " dynamic sampling **reproduced** |"))) == before + 1
    c4 = bullets(claims_md)["C4"]
    before = len(bullet_problems(claims_md))
    planted = claims_md.replace(c4, c4 + " Larger G **refuted** the gain.\n")
    assert len(bullet_problems(planted)) == before + 1
    interval = INTERVAL.search(c4).group(0)
    wrong = interval[:-2] + "9]"
    assert len(bullet_problems(claims_md.replace(interval, wrong, 1))) == before + 1
