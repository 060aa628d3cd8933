"""Text a model wrote and files a user pointed at are untrusted: rule rewards never run model output
as code and parse any input in bounded time, and only safetensors and JSON are ever loaded."""

import ast
import glob
import os
from decimal import Decimal

import pytest
import torch
from conftest import ROOT, assert_user_error, cli
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.models import loading
from grpo.rewards import tasks

HOSTILE = [
    "__import__('os').system('touch {marker}')",
    "eval(\"__import__('os').system('touch {marker}')\")",
    "9**9**9**9",
    "1" * 1_000_000,
    "(" * 100_000 + "5" + ")" * 100_000,
    "[" * 50_000 + "{" * 50_000,
    "-" * 500_000 + "5",
    "0." + "9" * 200_000,
    "\x00\uffff\U0010ffff 5 \u202e",
]


@pytest.mark.parametrize("text", HOSTILE, ids=lambda t: repr(t[:20]))
def test_hostile_completions_are_only_text(text, tmp_path):
    marker = tmp_path / "pwned"
    completion = text.format(marker=marker)
    rewards = tasks.exact_answer(["q"] * 2, [completion, completion + " so 5"], answer=["5", "5"])
    assert rewards[1] == 1.0                           # the last number is found after any junk
    assert rewards[0] in (0.0, 1.0)
    assert not marker.exists()                          # nothing in the text ran
    assert tasks.char_class(["q"], [completion], char_class=["digits"])[0] <= 1.0


@settings(max_examples=300, deadline=500)
@given(st.text(max_size=2000), st.integers(-10**30, 10**30))
def test_exact_answer_finds_an_appended_answer_in_any_text(text, answer):
    assert tasks.exact_answer(["q"], [f"{text} {answer}"], answer=[str(answer)]) == [1.0]
    assert tasks.exact_answer(["q"], [text], answer=[str(answer)])[0] in (0.0, 1.0)


@settings(max_examples=300, deadline=500)
@given(st.from_regex(r"[-+]?[0-9]{1,400}(\.[0-9]{1,400})?", fullmatch=True))
def test_canonical_number_keeps_the_value(text):
    canonical = tasks.canonical_number(text)
    assert Decimal(canonical) == Decimal(text)          # Decimal parses digits; it runs nothing
    assert tasks.canonical_number(canonical) == canonical


@settings(max_examples=200, deadline=500)
@given(st.text(alphabet=st.sampled_from("0123456789+-.,()[]{}*/^eE x=\n"), max_size=5000))
def test_number_parsing_is_bounded_on_number_like_noise(text):
    result = tasks.last_number(text)
    assert result is None or tasks.canonical_number(result) == result


def project_sources():
    return [p for folder in ("", "grpo", "grpo/*", "benchmarks") for p in glob.glob(os.path.join(ROOT, folder, "*.py"))]


def test_no_code_path_unpickles_or_evaluates():
    """No pickle, torch.load, eval, exec or sympy in the project's own code (tests aside)."""
    banned_calls = {"eval", "exec", "compile", "__import__"}
    for path in project_sources():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n and n.split(".")[0] in ("pickle", "dill", "cloudpickle", "sympy", "marshal")
                               for n in names), (path, node.lineno)
            if isinstance(node, ast.Call):
                f = node.func
                # the builtins, called bare or as builtins.eval (model.eval() and re.compile are not them)
                name = (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute)
                        and isinstance(f.value, ast.Name) and f.value.id == "builtins" else "")
                assert name not in banned_calls, (path, node.lineno, name)
                if isinstance(f, ast.Attribute) and f.attr == "load" and isinstance(f.value, ast.Name):
                    assert f.value.id not in ("torch", "pickle", "np", "numpy"), (path, node.lineno)
                for kw in node.keywords:
                    if kw.arg == "trust_remote_code":         # only ever a variable the user's flag set
                        assert not (isinstance(kw.value, ast.Constant) and kw.value.value is True), (path, node.lineno)


def test_a_pickled_checkpoint_is_refused(models, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    model = loading.load_model(models["policy"], "cpu")
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")     # what an old or hostile folder holds
    for name in os.listdir(models["policy"]):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            (folder / name).write_bytes(open(os.path.join(models["policy"], name), "rb").read())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    r = cli("sample.py", "--model", folder, "--prompts", prompts, "--out", tmp_path / "out", "--group-size", 2)
    assert_user_error(r, str(folder), "only safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", HOSTILE, ids=lambda t: repr(t[:20]))
def test_the_calculators_run_nothing_a_model_wrote(text, tmp_path):
    from grpo.rewards import environments
    marker = tmp_path / "pwned"
    written = text.format(marker=marker)
    tags, inline = environments.Calculator(), environments.InlineCalculator()
    tags.reset({}), inline.reset({})
    assert tags.step(f"<calc>{written}</calc>", []).startswith("<result>")
    reply = inline.step(written + " =", [])
    assert reply == "" or reply.startswith(" ")             # a value written after "=", or nothing
    assert not marker.exists()


@settings(max_examples=200, deadline=500)
@given(st.text(alphabet=st.sampled_from("0123456789+-*/.,() ×÷"), max_size=3000))
def test_the_inline_calculator_is_bounded_on_expression_like_noise(text):
    from grpo.rewards import environments
    env = environments.InlineCalculator()
    env.reset({})
    reply = env.step(text + "=", [])
    assert reply == "" or reply.startswith(" ")
