"""The levers of an iteration's cost that another machine could decide otherwise, one subcommand
each, and where an iteration's time goes.

    python benchmarks/levers.py draw               # the sampler's draw: multinomial, sample.draw and two others
    python benchmarks/levers.py decode-linears     # the sampler's products: MKL against oneDNN on packed weights
    python benchmarks/levers.py compiled-decode    # a decode step through torch.compile (not adopted here)
    python benchmarks/levers.py matmul-share       # how much of each stage is matrix products
    python benchmarks/levers.py draw --help        # a subcommand's flags

Each runs on the CPU at the default job's shape (iteration.py's Table 1: SmolLM2-135M-Instruct,
B = 4 prompts × G = 8, 24 new tokens, τ = 0.7), says in its docstring below what it measures, and
prints a line each, then one JSON line. What each gave, with its date, commit and command, is in
docs/performance.md, beside the levers settled for good, whose benchmarks left the tree with their
numbers (fused AdamW, the chunked log-probs, freed memory kept for reuse, the preallocated KV cache).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import StaticCache  # noqa: E402

import sample  # noqa: E402
from grpo.models import modeling  # noqa: E402
from grpo.models import builders, fast_decode, loading
from iteration import B, G, T, TAU, floor_once, iteration_stages, prompt_batch  # noqa: E402


def model_flags(p, reps_help, reps=3, threads=True):
    """A subcommand's flags for a benchmark on the default model: --model, --reps, --threads."""
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--reps", type=int, default=reps, help=f"{reps_help} (default {reps})")
    if threads:
        p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")


def default_job_batch(args):
    """What a lever's benchmark starts from: torch's threads set, and the tokenizer, the model (on the
    CPU) and the default job's prompt batch [N, P]."""
    torch.set_num_threads(args.threads)
    model_dir = args.model or builders.default_model_dir()
    tokenizer, model = loading.load_tokenizer(model_dir), loading.load_model(model_dir, "cpu")
    return tokenizer, model, prompt_batch(tokenizer, torch.device("cpu"), B, G)


# ----------------------------------------------------------------------------------------
# draw: the sampler's draw of one token per row

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


def run_draw(args):
    """The sampler's draw of one token per row from softmax(logits / τ): torch.multinomial against
    sample.draw (what sample.py uses: multinomial's own exponentials, made a batch at once) and two
    draws that need one random number per row or fewer passes.

        python benchmarks/levers.py draw                  # N = 32 rows × V = 49,152 (the default job's batch)
        python benchmarks/levers.py draw --rows 64 --threads 1

    - multinomial: `torch.multinomial(probs, 1)` (on a CPU it races one exponential per vocabulary
      entry, N × V random numbers a step, made one call at a time).
    - sample.draw: the same race with the same exponentials (float64 uniforms in the generator's
      order, -log1p(-u)) made by whole-tensor kernels: the same tokens as multinomial for a seed.
    - inverse CDF: one uniform per row, `searchsorted(cumsum(probs), u)`.
    - Gumbel-max: `argmax(logits / τ + Gumbel noise)`, N × V random numbers but no softmax.

    Each is timed from the logits of a step (the softmax included where the draw needs it), median
    of --reps. All four are exact draws from the same distribution (tests/test_benchmarks.py); the
    last two consume the generator differently, so for one seed they give other tokens than the
    first two: adopting either would change every recorded run's completions (the default job's
    held-out numbers among them). Prints each one's milliseconds a step and the seconds an iteration
    of the default job spends on it (23 drawn steps: the sampler draws T = 24 tokens and needs no
    forward after the last), then one JSON line."""
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


# ----------------------------------------------------------------------------------------
# decode-linears: the sampler's products through MKL or through oneDNN on packed weights

def median_ms(f, reps=15):
    f()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        seconds.append(time.perf_counter() - start)
    return 1000 * statistics.median(seconds)


def run_decode_linears(args):
    """The sampler's products on a CPU: MKL's sgemm (F.linear, torch's default for float32) against
    oneDNN on weights packed once (fast_decode.decode_linears, what sample.py's rollout uses).

        python benchmarks/levers.py decode-linears        # SmolLM2-135M-Instruct, the default job's batch
        python benchmarks/levers.py decode-linears --threads 1

    - Packing: the seconds decode_linears takes to pack every weight of the model (each rollout pays
      them once, since the weights change every iteration).
    - The products alone: one decode step's products of the 30 layers at the decode step's n = 32
      rows (each weight once, cold, as in a step) and the LM head at 32 rows, milliseconds through
      each library (median of 15 after a warm-up).
    - The sampler: sample.sample_completions on the default job's batch (B = 4 prompts × G = 8, 24
      new tokens, τ = 0.7, EOS ignored), with fast_decode.ONEDNN_DECODE off and on, alternating, median
      of --reps each and of the paired differences; whether the two drew the same tokens, and the
      largest difference of their log π_old.
    Prints a line each, then one JSON line."""
    tokenizer, policy, (prompt_ids, prompt_mask) = default_job_batch(args)
    rows = B * G
    layers = [m for layer in policy.model.layers for m in layer.modules() if type(m) is torch.nn.Linear]
    head = policy.get_output_embeddings()
    inputs = {d: torch.randn(rows, d) for d in {m.in_features for m in layers}}
    results = {"threads": args.threads, "products_ms": {}}
    with torch.inference_mode():
        for on in (False, True):
            fast_decode.ONEDNN_DECODE = on
            start = time.perf_counter()
            with fast_decode.decode_linears(policy, rows):
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
            fast_decode.ONEDNN_DECODE = on
            start = time.perf_counter()
            with fast_decode.decode_linears(policy, rows):
                outputs[on] = sample.sample_completions(policy, prompt_ids, prompt_mask, T, TAU, [],
                                                        tokenizer.pad_token_id, torch.Generator().manual_seed(rep))
            if rep:
                seconds[on].append(time.perf_counter() - start)
    fast_decode.ONEDNN_DECODE = True
    same = torch.equal(outputs[False]["completion_ids"], outputs[True]["completion_ids"])
    diff = (outputs[False]["old_logprobs"] - outputs[True]["old_logprobs"]).abs().max().item()
    saved = [a - b for a, b in zip(seconds[False], seconds[True])]
    results["sampler_s"] = {"mkl": statistics.median(seconds[False]), "onednn": statistics.median(seconds[True])}
    results.update(saved_s=statistics.median(saved), rounds_faster=sum(d > 0 for d in saved), same_tokens=same,
                   max_logprob_diff=diff, runs_s={"mkl": seconds[False], "onednn": seconds[True]})
    print(f"sampler, {B} × {G} rows × {T} tokens (packing included): MKL {results['sampler_s']['mkl']:.2f} s, "
          f"oneDNN {results['sampler_s']['onednn']:.2f} s (median of {args.reps}); saved {results['saved_s']:.2f} s "
          f"(median of the paired differences, faster in {results['rounds_faster']} of {args.reps}); same tokens: "
          f"{same}; largest log π_old difference {diff:.1e}")
    print(json.dumps(results))


# ----------------------------------------------------------------------------------------
# compiled-decode: a decode step through torch.compile against the eager one

@torch.inference_mode()
def decode(model, prompt_ids, prompt_mask, tokens=None, step_fn=None):
    """23 decode steps after one prefill; returns (logits [n, T, V], seconds of each step, tokens)."""
    out, cache, attention, positions = modeling.prefill(model, prompt_ids, prompt_mask)
    n, P = attention.shape
    if step_fn is not None:                                  # the prompt's keys and values, in a static cache
        static = StaticCache(config=model.config, max_cache_len=P + T)
        for layer, filled in zip(static.layers, cache.layers):
            layer.lazy_initialization(filled.keys, filled.values)
            layer.keys[:, :, :P], layer.values[:, :, :P] = filled.keys, filled.values
            layer.cumulative_length.fill_(P)
        full_mask = torch.cat([attention, attention.new_ones(n, T)], 1)              # [n, P + T]
    logits, seconds, drawn = [out[:, -1].float()], [], []
    generator, position = torch.Generator().manual_seed(0), positions[:, -1:] + 1
    for step in range(T - 1):
        token = tokens[:, step] if tokens is not None else sample.draw(torch.softmax(logits[-1] / TAU, -1), generator)
        drawn.append(token)
        start = time.perf_counter()
        if step_fn is None:
            attention = torch.cat([attention, attention.new_ones(n, 1)], 1)
            out = model(input_ids=token[:, None], attention_mask=attention, position_ids=position,
                        past_key_values=cache, use_cache=True).logits
        else:
            out = step_fn(token[:, None], full_mask, position, static, torch.tensor([P + step]))
        seconds.append(time.perf_counter() - start)
        position = position + 1
        logits.append(out[:, -1].float())
    return torch.stack(logits, 1), seconds, torch.stack(drawn, 1)


def run_compiled_decode(args):
    """A decode step compiled with torch.compile (a static-shape KV cache, in the manner of gpt-fast)
    against the eager step sample.py runs, on the default job's batch.

        python benchmarks/levers.py compiled-decode       # SmolLM2-135M-Instruct, B = 4 × G = 8, 24 tokens
        python benchmarks/levers.py compiled-decode --threads 1

    Both start from the same prefill (modeling.prefill, prefix sharing) and feed the same tokens
    (drawn by sample.draw from the eager run's logits at τ = 0.7), 23 decode steps each:
    - eager: the model's forward on transformers' DynamicCache, as sample.sample_completions runs it
      (without the preallocated cache, so both pay for their cache their own way);
    - compiled: the same forward through torch.compile(fullgraph=True, dynamic=False) on a
      transformers StaticCache holding the prompt's keys and values, with a fixed-width attention
      mask (the positions ahead of the step are masked by the causal rule), so every step has one
      shape.
    Compile time is the first compiled step's, with torch's compile caches in a fresh folder (a cold
    start, as a new machine's first run), and the first step of each later round (a new cache: a
    recompile would show there). Reports the median seconds a step of each (of --reps rounds), the
    largest logit difference and whether the argmax agrees everywhere, then one JSON line. Needs a
    C++ compiler on a CPU (inductor builds C++)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))   # read when compiling
    tokenizer, model, (prompt_ids, prompt_mask) = default_job_batch(args)

    def step(token, mask, position, cache, cache_position):
        return model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
                     cache_position=cache_position, use_cache=True).logits

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    eager_logits, _, tokens = decode(model, prompt_ids, prompt_mask)
    compiled_logits, first, _ = decode(model, prompt_ids, prompt_mask, tokens, compiled)
    compile_s = first[0]
    step_s, first_steps = {"eager": [], "compiled": []}, []
    for _ in range(args.reps):
        step_s["eager"] += decode(model, prompt_ids, prompt_mask, tokens)[1]
        step_s["compiled"] += decode(model, prompt_ids, prompt_mask, tokens, compiled)[1]
        first_steps.append(step_s["compiled"][-(T - 1)])          # a new cache each round: no recompile?
    diff = (compiled_logits - eager_logits).abs().max().item()
    same_argmax = torch.equal(compiled_logits.argmax(-1), eager_logits.argmax(-1))
    results = {"threads": args.threads, "compile_s": compile_s, "later_first_steps_s": first_steps,
               "same_argmax": same_argmax, "max_logit_diff": diff,
               "step_s": {k: statistics.median(v) for k, v in step_s.items()}}
    print(f"first compiled step (compiling, cold caches): {compile_s:.1f} s; the first step of each later "
          f"round: {', '.join(f'{s:.2f}' for s in first_steps)} s")
    for name, s in results["step_s"].items():
        print(f"{name:9s} {1000 * s:7.1f} ms a decode step, {s * (T - 1):5.2f} s an iteration's 23 steps "
              f"(median of {args.reps} rounds)")
    print(f"largest logit difference {diff:.1e}; the same argmax everywhere: {same_argmax}")
    print(json.dumps(results))


# ----------------------------------------------------------------------------------------
# matmul-share: how much of each stage is matrix products

PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_linear",
            "mkldnn::_linear_pointwise"}                     # the last: fast_decode.decode_linears


def profiled(fn):
    """(seconds, matmul self-CPU seconds, {other kernel: self-CPU seconds}) of fn() under torch.profiler."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    seconds = time.perf_counter() - start
    kernels = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    return seconds, sum(v for k, v in kernels.items() if k in PRODUCTS), {
        k: v for k, v in kernels.items() if k not in PRODUCTS}


def run_matmul_share(args):
    """How much of each stage of an iteration is matrix products, measured where they run: the share a
    code change that leaves the products alone can remove at most.

        python benchmarks/levers.py matmul-share          # SmolLM2-135M-Instruct, the default job's shape
        python benchmarks/levers.py matmul-share --reps 3

    On the default job's shape (iteration.py's Table 1: B = 4 × G = 8, 24 new tokens, τ = 0.7,
    β = 0.01), in this process: the project's sampler as sample.rollout runs it, the reference pass,
    and one update.train_policy step (forward, backward, AdamW), each under torch.profiler after a
    warm-up, median of --reps; and the naive floor (iteration.floor_once: generate, a reference
    forward, a forward + backward + AdamW step, unshared), median of --reps. For each stage: its
    seconds, the self CPU seconds of its matrix-product kernels (aten::mm, addmm, bmm, baddbmm and
    oneDNN's linear; attention's fused kernel is not counted), their share, and the four other
    kernels that took the most self time (of the last measured run). The last line: the iteration
    with every other cost at zero, over the naive floor, the lowest ratio to the naive floor these
    products allow at the rate they run here. Prints a table, then one JSON line."""
    model_dir = args.model or builders.default_model_dir()
    tokenizer = loading.load_tokenizer(model_dir)
    policy, ref = loading.load_model(model_dir, "cpu"), loading.load_model(model_dir, "cpu")
    prompt_ids, prompt_mask = prompt_batch(tokenizer, torch.device("cpu"), B, G)
    sampling, reference, update_step = iteration_stages(policy, ref, tokenizer, model_dir, prompt_ids, prompt_mask, G)
    out = {}
    stages = {"sampling": lambda: out.update(rollouts=sampling(0)),                 # each on the last's output
              "reference pass": lambda: out.update(ref=reference(out["rollouts"])),
              "update": lambda: update_step(out["rollouts"], out["ref"])}
    measured = {name: [] for name in stages}
    for rep in range(args.reps + 1):                                      # the first round warms up
        for name, fn in stages.items():
            result = profiled(fn)
            if rep:
                measured[name].append(result)
    floor_optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    floor = statistics.median(floor_once(policy, ref, floor_optimizer, prompt_ids, prompt_mask, torch.device("cpu"))
                              ["total"] for _ in range(args.reps))

    results = {}
    print(f"{'stage':16s} {'s':>7s} {'matmul s':>9s} {'share':>6s}   the other kernels that took the most")
    for name, runs in measured.items():
        seconds, matmul = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        others = sorted(runs[-1][2].items(), key=lambda kv: -kv[1])[:4]
        results[name] = {"seconds": seconds, "matmul_s": matmul, "top_other_s": dict(others)}
        print(f"{name:16s} {seconds:7.2f} {matmul:9.2f} {matmul / seconds:6.1%}   "
              + ", ".join(f"{k} {v:.2f} s" for k, v in others))
    total, matmul = sum(r["seconds"] for r in results.values()), sum(r["matmul_s"] for r in results.values())
    print(f"{'the three':16s} {total:7.2f} {matmul:9.2f} {matmul / total:6.1%}")
    print(f"naive floor {floor:.2f} s: the three stages over it {total / floor:.3f}; their matrix products alone "
          f"{matmul / floor:.3f}")
    print(json.dumps({"stages": results, "naive_floor_s": floor, "ratio": total / floor, "matmul_ratio": matmul / floor,
                      "threads": torch.get_num_threads()}))


# ----------------------------------------------------------------------------------------
# The command line

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    levers = p.add_subparsers(dest="lever", required=True, metavar="LEVER")

    def lever(name, run, help):
        sub = levers.add_parser(name, help=help, description=run.__doc__.split("\n\n")[0])
        sub.set_defaults(run=run)
        return sub

    d = lever("draw", run_draw, "the sampler's draw: torch.multinomial, sample.draw, inverse CDF, Gumbel-max")
    d.add_argument("--rows", type=int, default=32, help="N, rows drawn at once (default 32)")
    d.add_argument("--vocab", type=int, default=49152, help="V (default 49,152, SmolLM2's)")
    d.add_argument("--temperature", type=float, default=0.7, help="τ (default 0.7)")
    d.add_argument("--steps", type=int, default=23, help="drawn steps an iteration (default 23)")
    d.add_argument("--reps", type=int, default=50, help="timed draws of each (default 50)")
    d.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    model_flags(lever("decode-linears", run_decode_linears, "the sampler's products: MKL, or oneDNN on packed weights"),
                "timed sampler runs of each")
    model_flags(lever("compiled-decode", run_compiled_decode, "a decode step through torch.compile against eager"),
                "timed rounds of each")
    model_flags(lever("matmul-share", run_matmul_share, "each stage's share of matrix products, and the naive floor"),
                "measured runs of each stage and of the floor", reps=2, threads=False)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
