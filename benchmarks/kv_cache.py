"""The sampler's KV cache on the default job's batch: transformers' DynamicLayer, which concatenates
each new position onto the whole cache, against grpo/kv_cache.py's buffers made once (what sample.py
uses).

    python benchmarks/kv_cache.py                # SmolLM2-135M-Instruct, B = 4 × G = 8, 24 new tokens
    python benchmarks/kv_cache.py --reps 5 --threads 1

sample.sample_completions as sample.rollout runs it (prefix sharing, the oneDNN LM head, τ = 0.7,
EOS ignored), the concatenating cache and the preallocated one alternating, median of --reps each
after a warm-up round, and the median of the paired differences (each round's two runs back to
back, so a slow patch of the machine slows both); the self time of aten::cat in one further run of
each under torch.profiler; and whether the two drew the same tokens and log π_old bit for bit.
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
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import sample  # noqa: E402
from grpo import kv_cache, modeling  # noqa: E402
from iteration import B, G, T, TAU, lever_setup  # noqa: E402

PREALLOCATE = kv_cache.preallocate
CACHES = {"concatenating": lambda cache, room: cache, "preallocated": PREALLOCATE}


def main(argv=None):
    args, tokenizer, policy, (prompt_ids, prompt_mask) = lever_setup(__doc__.split("\n\n")[0], argv,
                                                                    "timed sampler runs of each")

    def run(name, seed):
        kv_cache.preallocate = CACHES[name]
        with modeling.decode_linears(policy, prompt_ids.shape[0]):
            return sample.sample_completions(policy, prompt_ids, prompt_mask, T, TAU, [], tokenizer.pad_token_id,
                                             torch.Generator().manual_seed(seed))

    seconds, outputs, cat_s = {name: [] for name in CACHES}, {}, {}
    for rep in range(args.reps + 1):                                   # the first round warms up
        for name in CACHES:
            start = time.perf_counter()
            outputs[name] = run(name, rep)
            if rep:
                seconds[name].append(time.perf_counter() - start)
    for name in CACHES:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(name, 0)
        cat_s[name] = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::cat") / 1e6
    kv_cache.preallocate = PREALLOCATE
    same = all(torch.equal(a, b) for a, b in zip(outputs["concatenating"], outputs["preallocated"]))
    saved = [a - b for a, b in zip(seconds["concatenating"], seconds["preallocated"])]
    results = {"threads": args.threads, "same_outputs": same, "runs_s": seconds,
               "sampler_s": {name: statistics.median(s) for name, s in seconds.items()}, "cat_s": cat_s,
               "saved_s": statistics.median(saved), "rounds_faster": sum(d > 0 for d in saved)}
    for name in CACHES:
        print(f"{name:14s} sampler {results['sampler_s'][name]:6.2f} s (median of {args.reps}), "
              f"aten::cat {cat_s[name]:5.2f} s", flush=True)
    print(f"saved {results['saved_s']:.2f} s a sampler run (median of the {args.reps} rounds' differences; "
          f"faster in {results['rounds_faster']} of {args.reps})")
    print(f"{B} × {G} rows × {T} tokens; the same tokens, masks and log π_old bit for bit: {same}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
