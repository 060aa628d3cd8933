"""The sampler's draw of one token per row from softmax(logits / τ): torch.multinomial against
sample.draw (what sample.py uses: multinomial's own exponentials, made a batch at once) and two
draws that need one random number per row or fewer passes.

    python benchmarks/draw.py                       # N = 32 rows × V = 49,152 (the default job's batch)
    python benchmarks/draw.py --rows 64 --threads 1

- multinomial: `torch.multinomial(probs, 1)` (on a CPU it races one exponential per vocabulary
  entry, N × V random numbers a step, made one call at a time).
- sample.draw: the same race with the same exponentials (float64 uniforms in the generator's order,
  -log1p(-u)) made by whole-tensor kernels: the same tokens as multinomial for a seed.
- inverse CDF: one uniform per row, `searchsorted(cumsum(probs), u)`.
- Gumbel-max: `argmax(logits / τ + Gumbel noise)`, N × V random numbers but no softmax.

Each is timed from the logits of a step (the softmax included where the draw needs it), median of
--reps. All four are exact draws from the same distribution; the last two consume the generator
differently, so for one seed they give other tokens than the first two: adopting either would
change every recorded run's completions (the default job's held-out numbers among them). Prints each one's
milliseconds a step and the seconds an iteration of the default job spends on it (23 drawn steps:
the sampler draws T = 24 tokens and needs no forward after the last), then one JSON line.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sample  # noqa: E402


def multinomial(logits, temperature, generator):
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)


def batched_race(logits, temperature, generator):
    return sample.draw(torch.softmax(logits / temperature, dim=-1), generator)


def inverse_cdf(logits, temperature, generator):
    cdf = torch.softmax(logits / temperature, dim=-1).cumsum(-1)
    u = torch.rand(logits.shape[0], 1, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).clamp_(max=logits.shape[-1] - 1)


def gumbel_max(logits, temperature, generator):
    u = torch.rand(logits.shape, generator=generator).clamp_(min=1e-20)
    return (logits / temperature - torch.log(-torch.log(u))).argmax(-1, keepdim=True)


DRAWS = {"multinomial": multinomial, "sample.draw": batched_race, "inverse CDF": inverse_cdf, "Gumbel-max": gumbel_max}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="N, rows drawn at once (default 32)")
    p.add_argument("--vocab", type=int, default=49152, help="V (default 49,152, SmolLM2's)")
    p.add_argument("--temperature", type=float, default=0.7, help="τ (default 0.7)")
    p.add_argument("--steps", type=int, default=23, help="drawn steps an iteration (default 23)")
    p.add_argument("--reps", type=int, default=50, help="timed draws of each (default 50)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    results = {}
    for name, draw in DRAWS.items():
        generator = torch.Generator().manual_seed(0)
        draw(logits, args.temperature, generator)                       # warm-up
        seconds = []
        for _ in range(args.reps):
            start = time.perf_counter()
            draw(logits, args.temperature, generator)
            seconds.append(time.perf_counter() - start)
        step_ms = 1000 * statistics.median(seconds)
        results[name] = {"step_ms": step_ms, "iteration_s": step_ms * args.steps / 1000}
        print(f"{name:12s} {step_ms:8.2f} ms a step   {step_ms * args.steps / 1000:6.3f} s an iteration "
              f"({args.steps} steps)", flush=True)
    print(json.dumps({"rows": args.rows, "vocab": args.vocab, "threads": args.threads, **results}))


if __name__ == "__main__":
    main()
