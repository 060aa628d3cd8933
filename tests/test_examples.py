"""examples/math_data.py: GSM8K and MATH rows in their published columns, from local parquet and JSONL
files, become prompt records whose reference the built-in `math` reward reads."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import ROOT, write_jsonl

from grpo.rewards.math_reward import math

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to "
                 "her friends in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A farm has 1,200 hens and buys 34 more. How many hens does it have?",
     "answer": "It has 1,200+34 = <<1200+34=1234>>1,234 hens.\n#### 1,234"},
    {"question": "A row that lost its final answer.", "answer": "Some reasoning and no marker."},
]
MATH = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
    {"problem": "Find $x$ if $2x = 10$.", "level": "Level 2", "type": "Algebra",
     "solution": "Dividing by 2, $x = \\boxed{5}$."},
    {"problem": "A solution without a box.", "level": "Level 5", "type": "Geometry",
     "solution": "The answer is left as an exercise."},
]


def recipe(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "math_data.py"), *map(str, args)],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def read(path):
    return [json.loads(line) for line in open(path)]


def test_gsm8k_parquet_and_math_jsonl_become_prompt_files(tmp_path):
    pq.write_table(pa.Table.from_pylist(GSM8K), tmp_path / "gsm8k-train.parquet")
    write_jsonl(tmp_path / "math.jsonl", MATH)
    # MATH-500's columns: an explicit answer beside the solution, and subject in place of type.
    math500 = [{"problem": "Compute $3^2$.", "solution": "$3^2 = \\boxed{9}$", "answer": "9",
                "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"}]
    pq.write_table(pa.Table.from_pylist(math500), tmp_path / "math500.parquet")
    out = recipe("--dataset", "gsm8k", "--files", tmp_path / "gsm8k-*.parquet", "--out", tmp_path / "g.jsonl")
    assert "2 prompt records from 3 rows (1 without a readable reference dropped" in out
    recipe("--dataset", "math", "--files", tmp_path / "math.jsonl", "--out", tmp_path / "m.jsonl")
    recipe("--dataset", "math", "--files", tmp_path / "math500.parquet", "--out", tmp_path / "m500.jsonl")
    gsm8k, math_records, m500 = read(tmp_path / "g.jsonl"), read(tmp_path / "m.jsonl"), read(tmp_path / "m500.jsonl")
    assert [r["answer"] for r in gsm8k] == ["72", "1234"]
    assert [r["answer"] for r in math_records] == ["\\frac{3}{4}", "5"] and m500[0]["answer"] == "9"
    assert math_records[0]["level"] == "Level 1" and math_records[0]["type"] == "Prealgebra"
    assert m500[0]["unique_id"] == "test/algebra/1.json"
    for record, row in zip(gsm8k + math_records, GSM8K[:2] + MATH[:2]):
        system, user = record["prompt"]
        assert system["role"] == "system" and "\\boxed{}" in system["content"]
        assert user == {"role": "user", "content": row.get("question", row.get("problem"))}
        assert "####" not in record["solution"]
    # The reference solutions themselves score 1 under the `math` reward, and a wrong answer 0.
    records = gsm8k + math_records + m500
    solutions = [r["solution"] for r in records]
    assert math([r["prompt"] for r in records], solutions, answer=[r["answer"] for r in records]) == [1.0] * 5
    assert math(["q"] * 2, ["\\boxed{73}", "\\boxed{\\frac{4}{3}}"], answer=["72", "\\frac{3}{4}"]) == [0.0, 0.0]


def test_recipe_refuses_files_without_the_published_columns(tmp_path):
    write_jsonl(tmp_path / "wrong.jsonl", [{"text": "no question here"}])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "math_data.py"), "--dataset", "gsm8k",
                        "--files", tmp_path / "wrong.jsonl", "--out", tmp_path / "o.jsonl"],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "'question'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.jsonl").exists()
