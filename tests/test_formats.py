"""docs/formats.md against the code it documents, and the layout rules a reader relies on."""

import ast
import glob
import os
import re

import pytest
from conftest import ROOT

import advantage
import sample
import score
import train
import update
from grpo.disk import files
from grpo.loop import configs

STAGES = {"sample.py": sample, "score.py": score, "advantage.py": advantage, "update.py": update}
FORMATS = open(os.path.join(ROOT, "docs", "formats.md"), encoding="utf-8").read()


@pytest.mark.parametrize("script", STAGES)
def test_every_stage_flag_is_documented_in_its_table(script):
    table = FORMATS.split(f"### {script}\n", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"^\| `(--[a-z-]+)`", table, flags=re.M))
    flags = {a.option_strings[0] for a in STAGES[script].build_parser()._actions if a.dest != "help"}
    assert documented == flags


def test_every_train_flag_is_documented():
    parser = configs.parser("", list(configs.CONFIGS))
    flags = {a.option_strings[0] for a in parser._actions if a.dest != "help"}
    section = FORMATS.split("### train.py\n", 1)[1].split("\n## ", 1)[0]
    for flag in flags:
        assert f"`{flag}" in section, flag


@pytest.mark.parametrize("schema", [files.ROLLOUTS, files.REWARDS, files.ADVANTAGES])
def test_every_schema_key_is_documented(schema):
    name, keys = schema
    section = FORMATS.split(f"schema `{name}`", 1)[1].split("\n## ", 1)[0]
    for key, (kind, shapes, _) in keys.items():
        row = next(line for line in section.splitlines() if f"`{key}`" in line)
        assert {"int": "int64", "float": "float32", "bool": "bool"}[kind] in row, key
        for shape in shapes:
            assert "[" + ", ".join(shape) + "]" in row, (key, shape)


def top_level_python():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))


def imported_modules(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_layout_five_stages_on_top_and_a_package_that_imports_no_stage():
    assert top_level_python() == ["advantage.py", "sample.py", "score.py", "train.py", "update.py"]
    stages = {"sample", "score", "advantage", "update", "train"}
    for path in glob.glob(os.path.join(ROOT, "grpo", "**", "*.py"), recursive=True):
        assert not imported_modules(path) & stages, path
    for script in ("sample.py", "score.py", "advantage.py", "update.py"):
        assert not imported_modules(os.path.join(ROOT, script)) & stages, script


def test_the_packages_map_names_every_module_where_it_is():
    """grpo/__init__.py's map: a folder line ("disk/  ...") and its modules indented under it; every
    module and folder of grpo/ once, and nothing that is not there."""
    mapped, folder = [], ""
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "grpo", "__init__.py")).read()))
    for line in "\n".join(doc.split("\n\n")[1:-1]).splitlines():          # between the intro and the shapes
        m = re.match(r"^( *)(\w+)(/?)\s", line + " ")
        if not m:
            continue
        if m.group(3):
            folder = m.group(2) + "/"
            mapped.append(folder)
        else:
            mapped.append((folder if len(m.group(1)) > 4 else "") + m.group(2))
    present = [os.path.relpath(p, os.path.join(ROOT, "grpo"))[:-3]
               for p in glob.glob(os.path.join(ROOT, "grpo", "**", "*.py"), recursive=True)
               if not p.endswith("__init__.py")]
    present += [d + "/" for d in os.listdir(os.path.join(ROOT, "grpo"))
                if os.path.isfile(os.path.join(ROOT, "grpo", d, "__init__.py"))]
    assert sorted(mapped) == sorted(present)


def test_nothing_points_outside_the_repository():
    for path in glob.glob(os.path.join(ROOT, "**", "*.*"), recursive=True):
        if not path.endswith((".py", ".md", ".sh", ".txt")):
            continue
        text = open(path, encoding="utf-8").read()
        for outside in ("../" + "shared", "DESIGN" + ".md"):     # spelt in two parts: this file is scanned too
            assert outside not in text, (path, outside)
