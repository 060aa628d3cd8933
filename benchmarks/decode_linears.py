"""The sampler's products on a CPU: MKL's sgemm (F.linear, torch's default for float32) against
oneDNN on weights packed once (modeling.decode_linears, what sample.py's rollout uses).

    python benchmarks/decode_linears.py          # SmolLM2-135M-Instruct, the default job's batch
    python benchmarks/decode_linears.py --threads 1

- Packing: the seconds decode_linears takes to pack every weight of the model (each rollout pays
  them once, since the weights change every iteration).
- The products alone: one decode step's products of the 30 layers at the decode step's n = 32
  rows (each weight once, cold, as in a step) and the LM head at 32 rows, milliseconds through
  each library (median of 15 after a warm-up).
- The sampler: sample.sample_completions on the default job's batch (B = 4 prompts × G = 8, 24
  new tokens, τ = 0.7, EOS ignored), with modeling.ONEDNN_DECODE off and on, alternating, median
  of --reps each and of the paired differences; whether the two drew the same tokens, and the
  largest difference of their log π_old.
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
from iteration import B, G, T, TAU, lever_setup  # noqa: E402


def median_ms(f, reps=15):
    f()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        seconds.append(time.perf_counter() - start)
    return 1000 * statistics.median(seconds)


def main(argv=None):
    args, tokenizer, policy, (prompt_ids, prompt_mask) = lever_setup(__doc__.split("\n\n")[0], argv,
                                                                    "timed sampler runs of each")
    rows = B * G
    layers = [m for layer in policy.model.layers for m in layer.modules() if type(m) is torch.nn.Linear]
    head = policy.get_output_embeddings()
    inputs = {d: torch.randn(rows, d) for d in {m.in_features for m in layers}}
    results = {"threads": args.threads, "products_ms": {}}
    with torch.inference_mode():
        for on in (False, True):
            modeling.ONEDNN_DECODE = on
            start = time.perf_counter()
            with modeling.decode_linears(policy, rows):
                if on:
                    results["pack_s"] = time.perf_counter() - start
                results["products_ms"]["onednn" if on else "mkl"] = {
                    "layers": median_ms(lambda: [m(inputs[m.in_features]) for m in layers]),
                    "lm_head": median_ms(lambda: head(inputs[head.in_features]))}
    print(f"packing every weight: {results['pack_s']:.2f} s")
    for name, ms in results["products_ms"].items():
        print(f"{name:6s}: a decode step's {len(layers)} layer products {ms['layers']:7.1f} ms, the LM head "
              f"{ms['lm_head']:6.1f} ms ({rows} rows)", flush=True)

    seconds, outputs = {False: [], True: []}, {}
    for rep in range(args.reps + 1):                                   # the first round warms up
        for on in (False, True):
            modeling.ONEDNN_DECODE = on
            start = time.perf_counter()
            with modeling.decode_linears(policy, rows):
                outputs[on] = sample.sample_completions(policy, prompt_ids, prompt_mask, T, TAU, [],
                                                        tokenizer.pad_token_id, torch.Generator().manual_seed(rep))
            if rep:
                seconds[on].append(time.perf_counter() - start)
    modeling.ONEDNN_DECODE = True
    same = torch.equal(outputs[False][0], outputs[True][0])
    diff = (outputs[False][2] - outputs[True][2]).abs().max().item()
    saved = [a - b for a, b in zip(seconds[False], seconds[True])]
    results["sampler_s"] = {"mkl": statistics.median(seconds[False]), "onednn": statistics.median(seconds[True])}
    results.update(saved_s=statistics.median(saved), rounds_faster=sum(d > 0 for d in saved), same_tokens=same,
                   max_logprob_diff=diff, runs_s={"mkl": seconds[False], "onednn": seconds[True]})
    print(f"sampler, {B} × {G} rows × {T} tokens (packing included): MKL {results['sampler_s']['mkl']:.2f} s, "
          f"oneDNN {results['sampler_s']['onednn']:.2f} s (median of {args.reps}); saved {results['saved_s']:.2f} s "
          f"(median of the paired differences, faster in {results['rounds_faster']} of {args.reps}); same tokens: "
          f"{same}; largest log π_old difference {diff:.1e}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
