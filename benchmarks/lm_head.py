"""The sampler's LM head on a CPU: MKL's sgemm (F.linear, torch's default for float32) against
oneDNN (modeling.decode_lm_head, what sample.py's rollout uses).

    python benchmarks/lm_head.py                 # SmolLM2-135M-Instruct, the default job's batch
    python benchmarks/lm_head.py --threads 1

- The product alone: [n × d] × [d × V] at the decode step's n = 32 rows and at the update's
  n = 32 × 23 rows, GFLOP/s of each library (iteration.sustained_seconds: the best of 3 windows
  of 0.3 s).
- The sampler: sample.sample_completions on the default job's batch (B = 4 prompts × G = 8, 24
  new tokens, τ = 0.7, EOS ignored), with modeling.ONEDNN_LM_HEAD off and on, alternating, median
  of --reps each; whether the two drew the same tokens, and the largest difference of their
  log π_old.
Prints a line each, then one JSON line.
"""

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import sample  # noqa: E402
from grpo import modeling  # noqa: E402
from iteration import B, G, T, TAU, lever_setup, sustained_seconds  # noqa: E402


def gflops(f, m, k, n):
    return 2 * m * k * n / sustained_seconds(f, torch.device("cpu"), seconds=0.3) / 1e9


def main(argv=None):
    args, tokenizer, policy, (prompt_ids, prompt_mask) = lever_setup(__doc__.split("\n\n")[0], argv,
                                                                    "timed sampler runs of each")
    head = policy.get_output_embeddings()
    results = {"threads": args.threads, "product_gflop_s": {}}
    for rows in (B * G, B * G * (T - 1)):
        x = torch.randn(rows, head.in_features)
        m, k, n = rows, head.in_features, head.out_features
        with torch.inference_mode():
            mkl = gflops(lambda: head(x), m, k, n)
            with modeling.decode_lm_head(policy):
                onednn = gflops(lambda: head(x), m, k, n)
        results["product_gflop_s"][f"{m}x{k}x{n}"] = {"mkl": mkl, "onednn": onednn}
        print(f"LM head {m} × {k} × {n}: MKL {mkl:6.1f} GFLOP/s, oneDNN {onednn:6.1f} GFLOP/s", flush=True)

    seconds, outputs = {False: [], True: []}, {}
    for rep in range(args.reps + 1):                                   # the first round warms up
        for on in (False, True):
            modeling.ONEDNN_LM_HEAD = on
            start = time.perf_counter()
            with modeling.decode_lm_head(policy):
                outputs[on] = sample.sample_completions(policy, prompt_ids, prompt_mask, T, TAU, [],
                                                        tokenizer.pad_token_id, torch.Generator().manual_seed(rep))
            if rep:
                seconds[on].append(time.perf_counter() - start)
    same = torch.equal(outputs[False][0], outputs[True][0])
    diff = (outputs[False][2] - outputs[True][2]).abs().max().item()
    results["sampler_s"] = {"mkl": statistics.median(seconds[False]), "onednn": statistics.median(seconds[True])}
    results.update(same_tokens=same, max_logprob_diff=diff)
    print(f"sampler, {B} × {G} rows × {T} tokens: MKL head {results['sampler_s']['mkl']:.2f} s, oneDNN head "
          f"{results['sampler_s']['onednn']:.2f} s (median of {args.reps}); same tokens: {same}; largest "
          f"log π_old difference {diff:.1e}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
