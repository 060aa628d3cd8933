"""Per-token log-probs and entropy of an update's logits, forward and backward: the project's
chunked function (grpo/modeling.py:logprobs_from_logits) against autograd through the plain
formula, which the project used before.

    python benchmarks/logprobs.py                      # N = 32 rows × T = 23 × V = 49,152 (the default job)
    python benchmarks/logprobs.py --rows 8 --threads 1

- plain: z = logits / τ, lse = logsumexp(z), log p = z_tok − lse, H = lse − Σ softmax(z)·z (a
  metric, no gradient), then autograd's backward (it keeps z and makes the softmax and the
  gather's scatter, each a float32 tensor the size of the logits).
- chunked: the same values a few rows at a time, with the backward written out
  (modeling._TokenLogprobs), no [N, T, V] float32 tensor but the gradient itself.

Each variant runs in its own child process: the median seconds of --reps forward + backward
passes, and the peak resident memory the passes added to the logits (VmHWM, read from /proc, less
the RSS once the logits exist), the gradient of the logits included (printed beside it).
Prints one line a variant and one JSON line.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from grpo import modeling  # noqa: E402


def plain(logits, tokens, temperature):
    """The formula through autograd: what logprobs_from_logits computed before it was chunked."""
    z = logits.float() / temperature
    lse = z.logsumexp(-1)
    logp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        p = (z - lse.unsqueeze(-1)).exp()
        entropy = lse - torch.einsum("...v,...v->...", p, z)
    return logp, entropy


def chunked(logits, tokens, temperature):
    return modeling.logprobs_from_logits(logits, tokens, temperature, with_entropy=True)


VARIANTS = {"plain": plain, "chunked": chunked}


def rss_kb(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def child(args):
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.tokens, args.vocab, generator=generator) * 3).requires_grad_()
    tokens = torch.randint(args.vocab, (args.rows, args.tokens), generator=generator)
    weights = torch.randn(args.rows, args.tokens, generator=generator)
    base_kb = rss_kb("VmRSS")
    seconds = []
    for _ in range(args.reps + 1):                           # the first one warms up
        start = time.perf_counter()
        logp, entropy = VARIANTS[args.variant](logits, tokens, args.temperature)
        (logp * weights).sum().backward()
        logits.grad = None
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": statistics.median(seconds[1:]),
                      "extra_mb": (rss_kb("VmHWM") - base_kb) / 1024}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="N (default 32)")
    p.add_argument("--tokens", type=int, default=23, help="T, scored positions a row (default 23)")
    p.add_argument("--vocab", type=int, default=49152, help="V (default 49,152, SmolLM2's)")
    p.add_argument("--temperature", type=float, default=0.7, help="τ (default 0.7)")
    p.add_argument("--reps", type=int, default=5, help="timed passes of each (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        return child(args)
    results = {}
    for name in VARIANTS:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]), "--variant", name],
                             check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name:8s} {results[name]['seconds']:7.3f} s forward + backward   {results[name]['extra_mb']:8.1f} MB "
              f"above the logits (their gradient: {args.rows * args.tokens * args.vocab * 4 / 2**20:.1f} MB)",
              flush=True)
    print(json.dumps({"rows": args.rows, "tokens": args.tokens, "vocab": args.vocab, "threads": args.threads,
                      **results}))


if __name__ == "__main__":
    main()
