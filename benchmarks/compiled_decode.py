"""A decode step compiled with torch.compile (a static-shape KV cache, in the manner of gpt-fast)
against the eager step sample.py runs, on the default job's batch.

    python benchmarks/compiled_decode.py            # SmolLM2-135M-Instruct, B = 4 × G = 8, 24 tokens
    python benchmarks/compiled_decode.py --threads 1

Both start from the same prefill (modeling.prefill, prefix sharing) and feed the same tokens (drawn
by sample.draw from the eager run's logits at τ = 0.7), 23 decode steps each:
- eager: the model's forward on transformers' DynamicCache, as sample.sample_completions runs it
  (without the preallocated cache, so both pay for their cache their own way);
- compiled: the same forward through torch.compile(fullgraph=True, dynamic=False) on a
  transformers StaticCache holding the prompt's keys and values, with a fixed-width attention mask
  (the positions ahead of the step are masked by the causal rule), so every step has one shape.
Compile time is the first compiled step's, with torch's compile caches in a fresh folder (a cold
start, as a new machine's first run), and the first step of each later round (a new cache: a
recompile would show there). Reports
the median seconds a step of each (of --reps rounds), the largest logit difference and whether the
argmax agrees everywhere, then one JSON line. Needs a C++ compiler on a CPU (inductor builds C++).
"""

import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))   # a cold start

import torch  # noqa: E402
from transformers import StaticCache  # noqa: E402

import sample  # noqa: E402
from grpo import modeling  # noqa: E402
from iteration import T, TAU, lever_setup  # noqa: E402


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


def main(argv=None):
    args, tokenizer, model, (prompt_ids, prompt_mask) = lever_setup(__doc__.split("\n\n")[0], argv,
                                                                    "timed rounds of each")

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


if __name__ == "__main__":
    main()
