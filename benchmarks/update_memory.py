"""Peak memory and time of one update.py step, with and without --gradient-checkpointing.

    python benchmarks/update_memory.py                     # SmolLM2-135M-Instruct (the default model)
    python benchmarks/update_memory.py --model DIR --rows 16 --tokens 256

The batch is made up: --rows completions of exactly --tokens random tokens after a 16-token prompt,
advantages ±1, old log-probs recomputed by the policy (--old-logprobs recompute), β = 0. Each setting
runs update.py in its own child process, one AdamW step over the whole batch in one micro-batch, so
that the activations of all rows are alive at once. Peak memory is the child's maximum resident set
(from wait4): the measure on the CPU; on a GPU it is host memory, not the GPU's. Prints a table and
one JSON line.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpo.models import loading  # noqa: E402
from grpo.disk import files
from grpo.models import builders


def made_up_batch(model_dir, rows, tokens, out_dir):
    """rollouts.safetensors and advantages.safetensors for `rows` completions of `tokens` tokens."""
    vocab = loading.load_tokenizer(model_dir).vocab_size
    g = torch.Generator().manual_seed(0)
    rollouts = {
        "prompt_ids": torch.randint(vocab, (rows, 16), generator=g),
        "prompt_mask": torch.ones(rows, 16, dtype=torch.bool),
        "completion_ids": torch.randint(vocab, (rows, tokens), generator=g),
        "completion_mask": torch.ones(rows, tokens, dtype=torch.bool),
        "group_ids": torch.arange(rows) // 2,
        "old_logprobs": torch.zeros(rows, tokens),
        "truncated": torch.ones(rows, dtype=torch.bool),
    }
    files.save_tensors(os.path.join(out_dir, "rollouts.safetensors"), rollouts, files.ROLLOUTS[0],
                       {"temperature": 1.0, "max_new_tokens": tokens})
    advantages = {"advantages": torch.tensor([1.0, -1.0]).repeat(rows)[:rows],
                  "group_ids": rollouts["group_ids"]}
    files.save_tensors(os.path.join(out_dir, "advantages.safetensors"), advantages, files.ADVANTAGES[0], {})


def run_update(model_dir, work, checkpointing):
    """Seconds and peak RSS (MiB) of one update.py child process."""
    argv = [sys.executable, os.path.join(ROOT, "update.py"), "--model", model_dir,
            "--rollouts", os.path.join(work, "rollouts.safetensors"),
            "--advantages", os.path.join(work, "advantages.safetensors"),
            "--out", os.path.join(work, f"out_{int(checkpointing)}"), "--lr", "1e-6", "--beta", "0",
            "--old-logprobs", "recompute"] + (["--gradient-checkpointing"] if checkpointing else [])
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"update.py failed: {child.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    model_dir = args.model or builders.default_model_dir()
    with tempfile.TemporaryDirectory() as work:
        made_up_batch(model_dir, args.rows, args.tokens, work)
        results = {on: run_update(model_dir, work, on) for on in (False, True)}
    print(f"one update step, {args.rows} rows × {args.tokens} tokens, one micro-batch")
    print(f"{'':28}{'seconds':>10}{'peak RSS MiB':>15}")
    for on, (seconds, rss) in results.items():
        print(f"{'--gradient-checkpointing' if on else 'plain':28}{seconds:10.1f}{rss:15.0f}")
    print(json.dumps({"rows": args.rows, "tokens": args.tokens,
                      "plain_s": round(results[False][0], 2), "plain_rss_mb": round(results[False][1]),
                      "checkpointing_s": round(results[True][0], 2),
                      "checkpointing_rss_mb": round(results[True][1])}))


if __name__ == "__main__":
    main()
