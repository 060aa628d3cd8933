"""GSM8K and MATH as prompt files for train.py --prompts: a chat with a system prompt that asks for the
final answer in \\boxed{}, and the reference that the built-in `math` reward reads.

    python examples/math_data.py --dataset gsm8k --split train --out data/gsm8k_train.jsonl
    python examples/math_data.py --dataset gsm8k --split test  --out data/gsm8k_test.jsonl
    python examples/math_data.py --dataset math  --split train --out data/math_train.jsonl
    python examples/math_data.py --dataset math  --files my/math/*.parquet --out data/math.jsonl

The data come from the Hugging Face Hub through the `datasets` library (GSM8K: openai/gsm8k, config
"main"; MATH: EleutherAI/hendrycks_math, its seven subject configs together; --hub-id names another
copy in the same columns, for example HuggingFaceH4/MATH-500), or from local parquet or JSONL files
in the published columns (--files):

    GSM8K  question, answer ("<reasoning> #### 72")
    MATH   problem, solution ("… \\boxed{\\frac{3}{4}}"), level, type (or subject); answer if present

Each output record: "prompt" as [system, user] chat turns (TRL's conversational format), "answer"
(GSM8K: the number after ####; MATH: the dataset's answer, else the solution's last \\boxed{}),
"solution" (the worked solution) and the dataset's other columns. A row whose reference cannot be
read is dropped and counted.
"""

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo.rewards.math_reward import reference_answer  # noqa: E402

SYSTEM_PROMPT = ("Solve the problem step by step. Put your final answer, and nothing else, in "
                 "\\boxed{} at the end of your reply.")
HUB = {"gsm8k": ("openai/gsm8k", ["main"]),
       "math": ("EleutherAI/hendrycks_math", ["algebra", "counting_and_probability", "geometry",
                                              "intermediate_algebra", "number_theory", "prealgebra",
                                              "precalculus"])}
COLUMNS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def load_rows(dataset, split, paths=None, hub_id=None):
    """The dataset's rows as dicts: from local parquet/JSONL files, or from the Hub."""
    import datasets

    if paths:
        kinds = {os.path.splitext(p)[1] for p in paths}
        if kinds - {".parquet", ".jsonl", ".json"} or len(kinds) != 1:
            raise SystemExit(f"--files: give .parquet or .jsonl/.json files, of one kind; "
                             f"got {sorted(kinds)}")
        builder = "parquet" if kinds == {".parquet"} else "json"
        return list(datasets.load_dataset(builder, data_files=paths, split="train"))
    repo, configs = HUB[dataset]
    if hub_id:
        repo, configs = hub_id, [None]
    return [row for config in configs for row in datasets.load_dataset(repo, config, split=split)]


def to_record(dataset, row):
    """A prompt record for train.py, or None when the row's reference cannot be read."""
    question_key, solution_key = COLUMNS[dataset]
    missing = [k for k in (question_key, solution_key) if k not in row]
    if missing:
        raise SystemExit(f"a {dataset} row needs the columns {question_key!r} and {solution_key!r}; "
                         f"missing {missing} in a row with {sorted(row)}")
    if dataset == "gsm8k":
        reasoning, marker, _ = row["answer"].rpartition("####")
        answer = reference_answer(answer=row["answer"]) if marker else None
        solution = reasoning.strip()
    else:
        answer = reference_answer(solution=row["solution"], answer=row.get("answer"))
        solution = row["solution"]
    if not answer:
        return None
    extra = {k: v for k, v in row.items() if k not in (question_key, solution_key, "answer")}
    return {"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": row[question_key]}],
            "answer": answer, "solution": solution, **extra}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, choices=sorted(HUB))
    p.add_argument("--split", default="train", help="the Hub split (default train); GSM8K and MATH have test")
    p.add_argument("--files", nargs="+", default=None, help="local .parquet or .jsonl files (globs expanded)")
    p.add_argument("--hub-id", default=None,
                   help="another Hub copy in the same columns (all of it, one config)")
    p.add_argument("--limit", type=int, default=0, help="keep the first N records (default all)")
    p.add_argument("--out", required=True, help="the prompt file to write (JSON lines)")
    args = p.parse_args(argv)
    paths = None
    if args.files:
        paths = [m for pattern in args.files for m in sorted(glob.glob(pattern)) or [pattern]]
    for path in paths or []:
        if not os.path.isfile(path):
            raise SystemExit(f"--files: no such file {path}")
    rows = load_rows(args.dataset, args.split, paths, args.hub_id)
    records = [r for r in (to_record(args.dataset, row) for row in rows) if r is not None]
    dropped = len(rows) - len(records)
    if args.limit:
        records = records[:args.limit]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print(f"{args.dataset}: {len(records)} prompt records from {len(rows)} rows "
          f"({dropped} without a readable reference dropped"
          f"{f', first {args.limit} kept' if args.limit else ''}); wrote {args.out}")


if __name__ == "__main__":
    main()
