"""The built-in `math` reward: answer extraction, GSM8K and MATH references, math-verify's verdicts,
and model text written to hurt (every such row scores 0 within a second and runs nothing)."""

import time

import pytest
import torch
from conftest import cli, write_jsonl
from safetensors.torch import load_file, save_file

from grpo.rewards import math_reward
from grpo.rewards.math_reward import math, model_answer, reference_answer


@pytest.mark.parametrize("text, answer", [
    ("so x = 3 and \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{ {a}_{2} }", "{a}_{2}"),             # the last box, nested braces kept
    ("I think 12, no, 14 apples", "14"),                          # no box: the last number
    ("\\boxed{3", None),                                          # a box that never closes is no answer
    ("no answer here", None),
])
def test_model_answer(text, answer):
    assert model_answer(text) == answer


@pytest.mark.parametrize("solution, answer, reference", [
    (None, "She sold 48/2 = 24 clips.\n#### 1,234", "1234"),        # GSM8K
    ("So the area is $\\boxed{\\frac{3}{4}}$.", None, "\\frac{3}{4}"),  # MATH
    ("… \\boxed{5}", "5.0", "5.0"),                                   # MATH-500 has both: answer first
    (None, 72, "72"),
    ("no box", None, None),
    (None, None, None),
])
def test_reference_answer(solution, answer, reference):
    assert reference_answer(solution, answer) == reference


def test_math_verify_decides_equivalence():
    completions = ["\\boxed{0.5}", "it is \\boxed{\\dfrac{2}{4}}", "\\boxed{(x+1)^2}", "\\boxed{\\text{(B)}}",
                   "The answer is 1,234.", "\\boxed{0.6}", "\\boxed{x^2+1}", "answer: 12"]
    references = ["\\frac{1}{2}", "\\frac{1}{2}", "x^2+2x+1", "B", "1234", "\\frac{1}{2}", "x^2+2x+1", "13"]
    got = math(["q"] * 8, completions, answer=references)
    assert got == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_conversational_completions_and_rows_without_a_reference():
    completions = [[{"role": "assistant", "content": "\\boxed{7}"}]] * 3
    assert math([[{"role": "user", "content": "q"}]] * 3, completions, solution=[None, "\\boxed{7}", "none"],
                answer=["#### 7", None, None]) == [1.0, 1.0, None]


HOSTILE = {
    "100 KB of braces": "{" * 100_000,
    "a box of 100 KB of braces": "\\boxed{" + "{" * 100_000,
    "a number of 10^5 digits": "7" * 100_000,
    "a boxed number of 10^5 digits": "\\boxed{" + "7" * 100_000 + "}",
    "\\frac nested 20 deep": "\\boxed{" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "}",
    "\\frac nested 2000 deep": "\\boxed{" + "\\frac{1}{" * 2000 + "2" + "}" * 2000 + "}",
    "a macro that expands for ever": "\\boxed{\\def\\x{\\x\\x}\\x}",
    "a power tower": "\\boxed{9^{9^{9^{9}}}}",
    "a huge factorial": "\\boxed{(10^{10})!}",
    "a sum of 10^12 terms": "\\boxed{\\sum_{k=1}^{10^{12}} k^{k}}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_answers_score_zero_within_a_second(name):
    if math_reward.VERIFIER.process is None:
        math_reward.VERIFIER.start()          # a worker killed by the row before restarts here, untimed
    start = time.perf_counter()
    assert math(["q"], [HOSTILE[name]], answer=["7"]) == [0.0]
    assert time.perf_counter() - start < 1.0


def test_model_text_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    payloads = [f"\\boxed{{__import__('os').system('touch {marker}')}}",
                f"__import__('os').system('touch {marker}')",
                f"\\boxed{{exec(\"open('{marker}', 'w')\")}}",
                f"\\boxed{{\\input{{{marker}}}}}"]
    assert math(["q"] * 4, payloads, answer=["42"] * 4) == [0.0] * 4
    assert not marker.exists()


def test_score_py_math_reward_on_gsm8k_and_math_records(tmp_path):
    rows = [("#### 18", None, "so \\boxed{18}"), ("#### 18", None, "18 eggs"), ("#### 18", None, "17"),
            (None, "Thus $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\boxed{\\frac{\\sqrt3}{2}}"),
            (None, "Thus $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\boxed{\\sqrt{3}/2}"),
            (None, "Thus $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\boxed{0.87}"),
            (None, None, "\\boxed{1}"), (None, None, "\\boxed{2}")]      # no reference: skipped
    write_jsonl(tmp_path / "samples.jsonl", [
        {"group": i // 2, "prompt": "q", "completion": c, **({"answer": a} if a else {}),
         **({"solution": s} if s else {})} for i, (a, s, c) in enumerate(rows)])
    save_file({"group_ids": torch.arange(4).repeat_interleave(2)}, str(tmp_path / "rollouts.safetensors"))
    r = cli("score.py", "--rollouts", tmp_path / "rollouts.safetensors", "--samples", tmp_path / "samples.jsonl",
            "--reward", "math", "--out", tmp_path / "r.safetensors")
    assert r.code == 0, r.err
    got = load_file(tmp_path / "r.safetensors")
    assert got["rewards"].tolist() == [1, 1, 0, 1, 1, 0, 0, 0]
    assert got["skipped"].tolist() == [False] * 6 + [True] * 2



def test_a_list_is_not_a_number_and_a_worker_killed_on_a_row_recovers():
    # "1,2" is a list of two numbers, not 12; "1,234" is one number.
    assert math(["q"] * 2, ["\\boxed{12}", "\\boxed{1,234}"], answer=["1,2", "1234"]) == [0.0, 1.0]
    math_reward.VERDICTS.clear()
    assert math(["q"], [HOSTILE["a power tower"]], answer=["7"]) == [0.0]      # the worker is killed
    assert math(["q"], ["\\boxed{\\frac{2}{4}}"], answer=["0.5"]) == [1.0]    # a new one gives the verdict
    assert ("9^{9^{9^{9}}}", "7") not in math_reward.VERDICTS                # no verdict is not remembered
