"""What one GRPO iteration costs, with and without prefix sharing, against the naive floor and
the compute floor.

    python benchmarks/iteration.py                  # both tables, SmolLM2-135M-Instruct
    python benchmarks/iteration.py --table 1        # the default job's shape only
    python benchmarks/iteration.py --table 2        # how the saving grows with G and the prompt
    python benchmarks/iteration.py --table 3        # the asynchronous loop, --staleness 0 and 1
    python benchmarks/iteration.py --model DIR      # any local checkpoint folder

Table 1, the default job's shape: B = 4 arithmetic chat prompts × G = 8, exactly 24 new tokens each
(EOS does not end a completion on either side), τ = 0.7, β = 0.01, μ = 1, one AdamW step.
- The project, twice: `python train.py` in a child process, exactly as a user runs it (sample →
  score → advantage → update, every stage file written, policy/ saved every --save-every
  iterations in the background), once as it is and once with --no-prefix-sharing. Each stage's
  seconds come from its iter_XXXX/metrics.json. The iteration time is taken over one save cycle
  after --warmup: the median iteration, plus the cycle's excess over that median spread over the
  cycle (what the save costs a run).
- The naive floor, in this process, with no framework around it: one `model.generate` call for the
  N rows (min_new_tokens = max_new_tokens), one reference forward and one policy forward +
  backward + AdamW step over the padded rows. Median of --floor-reps, half of them before the
  project's runs and half after.
- The sampler alone on the same batch, in this process: tokens per second of
  sample.sample_completions with and without sharing and of `model.generate` (median of
  --floor-reps each), and the seconds of the shared sampler and of the reference pass apart (train.py
  runs the reference pass in the update, beside the policy's forward, and times it there).
- With vLLM installed (./setup.sh --engine vllm), the engine too: `python train.py --engine vllm`
  (shared) as above, with its weight reload per iteration (perf/engine_sync_s), and in a child
  process the engine alone on the same batch: its start-up, tokens per second (median of
  --floor-reps) and weight reload. Without vLLM, one line says it was not measured.
- The compute floor: the iteration's matmul FLOPs, counted from the model's config and the shape
  as the code computes them (iteration_matmuls: sampling's prefill and decode steps, the reference
  forward, the update's forward and backward, attention and the LM head where it is applied),
  over the best rate torch.matmul sustains here on those same matmul shapes, measured in the same
  run. A second table gives each stage's seconds, GFLOP, the matmuls' seconds at their own shapes'
  rates, the floor's seconds, and the stage's ratio to the compute floor and to the naive floor.

Table 2, how the saving grows: one prompt of about 40, 200 or 800 tokens (the arithmetic question
after a filler passage) × G = 4, 8, 16 completions of 24 tokens. Each cell and path runs in its own
child process: the project's sampler, then one update.train_policy step (with the reference pass)
(forward, backward, AdamW); its seconds and the child's peak RSS (two copies of the model and
AdamW's state included). A child the kernel kills for memory shows as `killed`, with its RSS then.

Table 3, the asynchronous loop: the default job's shape as table 1's, `python train.py` with
--staleness 0 and --staleness 1 (on a CPU the threads split between the producer and the update,
--sample-threads 0: half each), alternating, --async-reps of each. Per run, the iteration's seconds
(the update's: the median over the save cycle plus the cycle's excess, as in table 1), the producer's
seconds per iteration (loading the version, sampling, scoring, writing the files) and the update's
own (its step and its publishing), and the share of the update's iteration spent waiting for the
producer (perf/wait_s). From K = 0's stage times: what two devices, one sampling and one updating,
would take an iteration, max(producer, update), against their sum on one.

Prints the tables, then one JSON line with everything measured.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import sample  # noqa: E402
import update  # noqa: E402
from grpo.disk import files  # noqa: E402
from grpo.models import builders, distributed, fast_decode, loading, modeling, vllm_engine  # noqa: E402
from grpo.rewards import prompting, tasks  # noqa: E402
from grpo.training import optim  # noqa: E402

B, G, T, TAU, BETA = 4, 8, 24, 0.7, 0.01
SCALING_G, SCALING_P = (4, 8, 16), (40, 200, 800)
FILLER = "The museum keeps its maps in a cool room, and visitors may look at them on Tuesdays. "


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--table", type=int, choices=[1, 2, 3], default=None, help="one table only (default: all)")
    p.add_argument("--floor-reps", type=int, default=4, help="measured repetitions of the floor (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="train.py iterations not measured (default 1)")
    p.add_argument("--save-every", type=int, default=5, help="train.py's --save-every, the cycle measured (5)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="table 1 also times train.py of another checkout (an earlier commit: `git worktree add\n"
                        "DIR REV`), alternating with this one's, twice each: the change's cost in one run")
    p.add_argument("--async-reps", type=int, default=2, help="table 3: runs of each K, alternating (default 2)")
    p.add_argument("--cell", nargs=3, type=int, metavar=("P", "G", "SHARE"), help=argparse.SUPPRESS)
    p.add_argument("--engine-rates", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def chat_prompt(tokenizer, record, length=None):
    """The record's chat prompt as token ids; with `length`, a filler passage before the question
    brings it to about that many tokens."""
    messages = record["messages"]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    if length and length > len(ids):
        filler = tokenizer(FILLER * length, add_special_tokens=False)["input_ids"][:length - len(ids) - 2]
        messages = [{**messages[-1], "content": tokenizer.decode(filler) + "\n\n" + messages[-1]["content"]}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    return list(ids)


def prompt_batch(tokenizer, device, num_prompts, group_size, length=None):
    train, _, _ = tasks.make_task("arithmetic", 0)
    ids, mask = prompting.left_pad([chat_prompt(tokenizer, r, length) for r in train[:num_prompts]],
                                  tokenizer.pad_token_id)
    return ids.repeat_interleave(group_size, 0).to(device), mask.repeat_interleave(group_size, 0).to(device)


def iteration_stages(policy, ref, tokenizer, model_dir, prompt_ids, prompt_mask, group_size, share=True):
    """An iteration's stages as train.py runs them, each a function of the one before:
    sampling(seed) → a rollouts dict (sample.sample_completions with the oneDNN LM head, as
    sample.rollout samples), and update_step(rollouts): one update.train_policy step (the reference
    pass beside the policy's forward, then backward and AdamW at lr 1e-6, advantages spread over
    −1..1). reference(rollouts) → log π_ref [N, T] is the reference pass alone, as sample.py runs it;
    update_step(rollouts, ref_logprobs) trains on those instead (--ref-logprobs rollouts), for the
    benchmarks that time the two apart. What they return are ordinary tensors (inference mode's
    outputs cloned), so the update can take them."""
    device, N = prompt_ids.device, prompt_ids.shape[0]
    uargs = update.parse_args(["--model", model_dir, "--rollouts", "-", "--advantages", "-", "--out", "-",
                               "--beta", str(BETA), "--temperature", str(TAU), "--old-logprobs", "sampler"]
                              + ([] if share else ["--no-prefix-sharing"]))
    optimizer = optim.adamw(policy, 1e-6)

    def sampling(seed):
        with fast_decode.decode_linears(policy, prompt_ids.shape[0]):
            columns = sample.sample_completions(
                policy, prompt_ids, prompt_mask, T, TAU, [], tokenizer.pad_token_id,
                torch.Generator(device=device).manual_seed(seed), share_prefix=share)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, **{k: v.clone() for k, v in columns.items()},
                "group_ids": torch.arange(N // group_size, device=device).repeat_interleave(group_size)}

    def reference(rollouts):
        return modeling.rollout_logprobs(ref, rollouts, TAU, 0, share_prefix=share).clone()        # [N, T]

    def update_step(rollouts, ref_logprobs=None):
        given = {} if ref_logprobs is None else {"ref_logprobs": ref_logprobs}
        rollouts = {k: v.cpu() for k, v in {**rollouts, **given}.items()}
        update.train_policy(policy, optimizer, rollouts, torch.linspace(-1, 1, N), uargs,
                            ref_model=ref if ref_logprobs is None else None)

    return sampling, reference, update_step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def floor_once(policy, ref, optimizer, prompt_ids, prompt_mask, device):
    """The same work with nothing around it: generate, reference forward, forward + backward + step."""
    times = {}
    t = time.perf_counter()
    with torch.inference_mode():
        seqs = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), do_sample=True,
                               temperature=TAU, top_k=0, top_p=1.0, max_new_tokens=T, min_new_tokens=T)
    sync(device)
    times["sample"] = time.perf_counter() - t
    seqs = seqs.clone()                                                   # [N, P + T], leave inference mode
    mask = torch.cat([prompt_mask.long(), torch.ones_like(seqs[:, prompt_ids.shape[1]:])], 1)
    t = time.perf_counter()
    with torch.inference_mode():
        ref_logits = ref(input_ids=seqs, attention_mask=mask, logits_to_keep=T + 1).logits[:, :-1]
        ref_logp = torch.log_softmax(ref_logits.float() / TAU, -1).gather(-1, seqs[:, -T:, None]).squeeze(-1)
    sync(device)
    times["reference"] = time.perf_counter() - t
    t = time.perf_counter()
    logits = policy(input_ids=seqs, attention_mask=mask, logits_to_keep=T + 1).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / TAU, -1).gather(-1, seqs[:, -T:, None]).squeeze(-1)
    advantages = torch.randn(seqs.shape[0], 1, device=device)
    x = ref_logp - logp
    loss = (-(torch.exp(logp - logp.detach()) * advantages) + BETA * (torch.exp(x) - x - 1)).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    times["update"] = time.perf_counter() - t
    times["total"] = sum(times.values())
    return times


# ----------------------------------------------------------------------------------------
# The compute floor: the iteration's matmul FLOPs at the best matmul rate this machine sustains

def iteration_matmuls(config, B, P, G, T):
    """Every matmul of one iteration (B distinct prompts of P tokens, G completions of T tokens each),
    as the code computes it: a list of (stage, kind, m, k, n, count), each an [m, k] × [k, n] product
    done `count` times, kind "layers" (q, k, v, o and the MLP), "lm_head" or "attention".

    The model calls, read from sample.sample_completions and modeling.completion_logprobs with prefix
    sharing: each stage prefills the B prompts once (logits_to_keep=1: the LM head at the last prompt
    token only), then
    - sampling draws token 0 from the prefill's logits, then runs T − 1 decode steps of the N = B·G
      rows, one token each, the step that feeds token t attending to P + t + 1 keys, with the LM head
      at that token (no forward after the last token: its logits would never be sampled from);
    - the reference pass and the update run the first T − 1 completion tokens of the N rows at once on
      the cache (the last prompt token's logits from the prefill score token 0), attending to all
      P + T − 1 keys through an explicit mask, with the LM head at those T − 1 positions;
    - the update's backward costs two matmuls of the forward's size for each of its matmuls (the
      input's and the weight's gradients; for attention dQ, dK, dV and dP), listed with their shapes.
    Attention counts every (query, key) pair it is given, per query head (grouped K/V heads are
    repeated or broadcast to all heads): 2·head_dim FLOPs for Q·Kᵀ and 2·head_dim for P·V, as in
    Chinchilla's FLOP count (Hoffmann et al. 2022, appendix F), which also takes the backward pass
    as twice the forward. The prefill runs with is_causal and no mask when no prompt is padded, and
    its kernel skips some key blocks past the diagonal; counting the full P × P square overstates the
    iteration by about 0.1 % here. Not counted: the embedding lookup (a gather) and the entropy's
    per-position dot product (2·V FLOPs a position); AdamW, softmax and the rest are not matmuls.
    """
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    H, KV, ffn = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    hd = getattr(config, "head_dim", None) or d // H
    weights = [(d, H * hd), (d, KV * hd), (d, KV * hd), (H * hd, d), (d, ffn), (d, ffn), (ffn, d)]  # [in, out]
    N = B * G

    def forward(stage, rows, new, keys, logits, backward=False):
        """One model call: `rows` rows of `new` tokens attending to `keys` keys, logits at `logits`
        positions a row."""
        m = rows * new
        gemms = [("layers", m, k, n, L) for k, n in weights] + [("lm_head", rows * logits, d, V, 1)]
        gemms += [("attention", new, hd, keys, rows * H * L), ("attention", new, keys, hd, rows * H * L)]
        if backward:                   # y = x·W: dx = dy·Wᵀ [m, n] × [n, k], dW = xᵀ·dy [k, m] × [m, n]
            gemms += [g for kind, m, k, n, c in gemms for g in ((kind, m, n, k, c), (kind, k, m, n, c))]
        return [(stage, *g) for g in gemms]

    matmuls = forward("sampling", B, P, P, 1)
    for t in range(T - 1):
        matmuls += forward("sampling", N, 1, P + t + 1, 1)
    for stage in ("reference", "update"):
        backward = stage == "update"
        matmuls += forward(stage, B, P, P, 1, backward) + forward(stage, N, T - 1, P + T - 1, T - 1, backward)
    return matmuls


def matmul_flops(config, B, P, G, T):
    """The iteration's matmul FLOPs by stage and kind: {stage: {kind: FLOPs}} (2·m·k·n a product)."""
    flops = {}
    for stage, kind, m, k, n, count in iteration_matmuls(config, B, P, G, T):
        by_kind = flops.setdefault(stage, {"layers": 0, "lm_head": 0, "attention": 0})
        by_kind[kind] += 2 * m * k * n * count
    return flops


def matmul_rates(shapes, device, seconds=0.05, windows=3):
    """GFLOP/s of torch.matmul on each (m, k, n): the best of `windows` back-to-back windows of at least
    `seconds` each (sustained: many calls in a row, as a forward pass makes them). The right-hand side
    is a Linear's weight [n, k] used transposed, the layout F.linear hands to the BLAS; float32, or
    bfloat16 on a GPU, where the forward passes run under bf16 autocast (modeling.autocast)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rates = {}
    for m, k, n in shapes:
        a, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)
        rates[(m, k, n)] = 2 * m * k * n / sustained_seconds(lambda: torch.matmul(a, w.t()), device, seconds,
                                                             windows) / 1e9
    return rates


def sustained_seconds(f, device, seconds=0.05, windows=3):
    """Seconds of one call of f, sustained: the best of `windows` back-to-back windows of at least
    `seconds` of calls each (the first call warms up and says how many calls fill a window)."""
    t = time.perf_counter()
    f()
    sync(device)
    calls = max(1, int(seconds / max(time.perf_counter() - t, 1e-9)))
    best = float("inf")
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        sync(device)
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def compute_floor(config, B, P, G, T, device):
    """The iteration's matmuls against the matmul rates measured here on their own shapes.

    The floor's rate is the best of the shapes, not a FLOP-weighted mean: the floor is the time the
    iteration's matmuls would take if all ran as fast as this machine runs the model's best-served
    shape, a bound the code could approach by batching its work into such shapes. Beside it,
    `matmul_s` is each stage's matmuls at their own shapes' rates, what this exact sequence of matmuls
    costs (attention's small batched products are not timed: counted at the best rate)."""
    matmuls = iteration_matmuls(config, B, P, G, T)
    rates = matmul_rates(sorted({(m, k, n) for _, kind, m, k, n, _ in matmuls if kind != "attention"}), device)
    best_shape = max(rates, key=rates.get)
    stages = {}
    for stage, kind, m, k, n, count in matmuls:
        s = stages.setdefault(stage, {"gflop": 0.0, "matmul_s": 0.0})
        s["gflop"] += 2 * m * k * n * count / 1e9
        s["matmul_s"] += 2 * m * k * n * count / 1e9 / rates.get((m, k, n), rates[best_shape])
    for s in stages.values():
        s["floor_s"] = s["gflop"] / rates[best_shape]
    return {"gflop_per_s": rates[best_shape], "best_shape": best_shape, "stages": stages,
            "rates": {"x".join(map(str, shape)): rate for shape, rate in rates.items()},
            "flops": matmul_flops(config, B, P, G, T)}


def sampler_rates(policy, ref, prompt_ids, prompt_mask, pad_id, reps, device):
    """Tokens per second of the project's sampler (shared, unshared) and of generate, same batch; and
    the median seconds of the shared sampler and of the shared reference pass on its completions (which
    train.py's update runs beside its forward, and times with it)."""
    seconds = {"shared": [], "unshared": [], "generate": [], "reference": []}
    for _ in range(reps):
        for name in ("shared", "unshared", "generate"):
            t = time.perf_counter()
            if name == "generate":
                with torch.inference_mode():
                    policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), do_sample=True,
                                    temperature=TAU, top_k=0, top_p=1.0, max_new_tokens=T, min_new_tokens=T)
            else:
                with fast_decode.decode_linears(policy, prompt_ids.shape[0]):         # as sample.rollout samples
                    columns = sample.sample_completions(
                        policy, prompt_ids, prompt_mask, T, TAU, [], pad_id,
                        torch.Generator(device=device).manual_seed(0), share_prefix=name == "shared")
            sync(device)
            seconds[name].append(time.perf_counter() - t)
            if name == "shared":
                rollouts = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                            "completion_ids": columns["completion_ids"], "completion_mask": columns["completion_mask"]}
                t = time.perf_counter()
                modeling.rollout_logprobs(ref, rollouts, TAU, 0, share_prefix=True)
                sync(device)
                seconds["reference"].append(time.perf_counter() - t)
    rates = {name: prompt_ids.shape[0] * T / statistics.median(seconds[name])
             for name in ("shared", "unshared", "generate")}
    return rates, {"sampling": statistics.median(seconds["shared"]),
                   "reference": statistics.median(seconds["reference"])}


def wait_with_peak_rss(proc):
    """Wait for a child process; its exit code and peak resident set in MB, polled from VmHWM in
    /proc/PID/status (the high-water mark of its own address space). Not the child's rusage: Linux
    carries the RSS of the process it was forked from (this one, holding the floor's models after
    table 1) across exec."""
    peak_kb = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as status:
                peak_kb = max([peak_kb] + [int(line.split()[1]) for line in status if line.startswith("VmHWM:")])
        except OSError:                  # exited between poll() and open()
            pass
        time.sleep(0.1)
    return proc.returncode, peak_kb / 1024


def run_train(argv, label="train.py", root=ROOT):
    """`python train.py ARGV` of the checkout at `root` in a child process as a user runs it, its stdout
    discarded; returns its peak RSS in MB (wait_with_peak_rss). Exits with the child's stderr if it fails."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(root, "train.py"), *argv], cwd=root,
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        code, peak_rss_mb = wait_with_peak_rss(proc)
        err.seek(0)
        if code != 0:
            sys.exit(f"{label} failed:\n{err.read()}")
    return peak_rss_mb


def run_async(args, model, run_dir, staleness):
    """train.py --staleness K in a child process over one save cycle: the update's iteration seconds,
    the producer's and the update's own seconds per iteration (medians), and the update's waiting share."""
    total = args.warmup + args.save_every + 1
    run_train(["--model", model, "--run-dir", run_dir, "--iterations", str(total), "--num-prompts", str(B),
               "--group-size", str(G), "--max-new-tokens", str(T), "--temperature", str(TAU), "--beta", str(BETA),
               "--epochs", "1", "--eval-every", "0", "--ignore-eos", "--save-every", str(args.save_every),
               "--device", args.device, "--staleness", str(staleness)])
    cycle = [files.read_json(os.path.join(run_dir, f"iter_{i:04d}", "metrics.json"))
             for i in range(args.warmup, args.warmup + args.save_every)]
    loop_s = statistics.median(m["perf/iteration_s"] for m in cycle)
    iteration_s = loop_s + max(statistics.mean(m["perf/iteration_s"] for m in cycle) - loop_s,
                               statistics.mean(m["perf/checkpoint_s"] for m in cycle))
    producer = ("perf/load_s", "perf/sample_s", "perf/score_s", "perf/io_s")
    return {"iteration_s": iteration_s,
            "producer_s": statistics.median(sum(m.get(k, 0.0) for k in producer) for m in cycle),
            "update_s": statistics.median(m["perf/update_s"] for m in cycle),
            "wait_share": statistics.median(m.get("perf/wait_s", 0.0) / m["perf/iteration_s"] for m in cycle)}


def table_3(args, model_dir):
    runs = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.async_reps):
            for K in runs:
                runs[K].append(run_async(args, model_dir, os.path.join(scratch, f"k{K}_{rep}"), K))
    result = {K: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for K, rs in runs.items()}
    sync = result[0]
    apart = {"sample, score, files": sync["producer_s"], "update": sync["update_s"]}
    pair_s = max(apart.values())
    print(f"\nTable 3. the asynchronous loop, model {model_dir}, device {args.device}, {torch.get_num_threads()} CPU "
          f"threads; the default job's shape, medians of {args.async_reps} runs of each K")
    print(f"{'K':>3s} {'iteration s':>12s} {'producer s':>11s} {'update s':>9s} {'update waits':>13s}")
    for K, r in result.items():
        print(f"{K:>3d} {r['iteration_s']:12.3f} {r['producer_s']:11.3f} {r['update_s']:9.3f} {r['wait_share']:13.1%}")
    print(f"K = 1 takes {result[1]['iteration_s'] / sync['iteration_s']:.2f}× K = 0's iteration here; two devices, "
          f"one sampling ({apart['sample, score, files']:.3f} s) and one updating ({apart['update']:.3f} s) at K = 0's "
          f"speeds, would take max = {pair_s:.3f} s against their sum {sum(apart.values()):.3f} s "
          f"({sum(apart.values()) / pair_s:.2f}× at most)")
    return {"runs": {str(K): rs for K, rs in runs.items()}, "medians": {str(K): r for K, r in result.items()},
            "pair_s": pair_s, "serial_s": sum(apart.values())}


def run_project(args, model, run_dir, share, root=ROOT, engine="sampler"):
    """train.py (of the checkout at `root`) in a child process; returns its iteration time, per-stage
    medians and peak RSS (and with --engine vllm, the engine's weight reload per iteration)."""
    total = args.warmup + args.save_every + 1          # one save cycle, then the last iteration (which always saves)
    peak_rss_mb = run_train(["--model", model, "--run-dir", run_dir, "--iterations", str(total), "--num-prompts",
                             str(B), "--group-size", str(G), "--max-new-tokens", str(T), "--temperature", str(TAU),
                             "--beta", str(BETA), "--epochs", "1", "--eval-every", "0", "--ignore-eos",
                             "--save-every", str(args.save_every), "--device", args.device,
                             *([] if engine == "sampler" else ["--engine", engine]),
                             *([] if share else ["--no-prefix-sharing"])], root=root)
    metrics = [files.read_json(os.path.join(run_dir, f"iter_{i:04d}", "metrics.json")) for i in range(total)]
    cycle = metrics[args.warmup:args.warmup + args.save_every]
    assert sum(m["iteration"] + 1 == args.save_every for m in cycle) == 1
    keys = {"sample": "perf/sample_s", "score": "perf/score_s", "update (with the reference pass)": "perf/update_s",
            "write stage files": "perf/io_s"}
    stages = {name: statistics.median(m[key] for m in cycle) for name, key in keys.items()}
    stages["other (advantage, metrics)"] = statistics.median(
        m["perf/iteration_s"] - m["perf/checkpoint_s"] - sum(m[k] for k in keys.values()) for m in cycle)
    loop_s = statistics.median(m["perf/iteration_s"] for m in cycle)
    excess = statistics.mean(m["perf/iteration_s"] for m in cycle) - loop_s
    stages["save policy/ (amortised)"] = max(excess, statistics.mean(m["perf/checkpoint_s"] for m in cycle))
    iteration_s = loop_s + stages["save policy/ (amortised)"]
    io_share = (stages["write stage files"] + stages["save policy/ (amortised)"]) / iteration_s
    sync = [m["perf/engine_sync_s"] for m in cycle if "perf/engine_sync_s" in m]
    return {"iteration_s": iteration_s, "stages_s": stages, "io_share": io_share, "peak_rss_mb": peak_rss_mb,
            **({"engine_sync_s": statistics.median(sync)} if sync else {})}


def engine_rates(model_dir, reps, device):
    """vLLM on table 1's batch, in this process (a child of the benchmark: the engine binds its
    threads): seconds to start the engine (model load and the first weight reload), tokens per second
    of its sampling (median of `reps`), and seconds of a weight reload (median)."""
    tokenizer = loading.load_tokenizer(model_dir)
    policy = loading.load_model(model_dir, device)
    prompt_ids, prompt_mask = prompt_batch(tokenizer, device, B, G)
    t = time.perf_counter()
    engine = vllm_engine.start(policy, model_dir, T, B * G)
    start_s = time.perf_counter() - t
    sampling, reload = [], []
    for rep in range(reps + 1):                            # the first draw warms the engine up
        t = time.perf_counter()
        engine.sample(prompt_ids, prompt_mask, G, [], tokenizer.pad_token_id,
                      torch.Generator(device=device).manual_seed(rep), max_new_tokens=T, temperature=TAU, ignore_eos=True)
        sampling.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.load_weights(policy)
        reload.append(time.perf_counter() - t)
    engine.close()
    print(json.dumps({"start_s": start_s, "tokens_per_s": B * G * T / statistics.median(sampling[1:]),
                      "reload_s": statistics.median(reload[1:])}))


def engine_table(args, model_dir, scratch):
    """With vLLM installed: the engine's rates (engine_rates, in a child) and train.py --engine vllm."""
    if not vllm_engine.installed():
        print("--engine vllm: not measured, vLLM is not installed here (./setup.sh --engine vllm)")
        return None
    child = subprocess.run([sys.executable, __file__, "--engine-rates", "--model", model_dir, "--device", args.device,
                            "--floor-reps", str(args.floor_reps)], capture_output=True, text=True, cwd=ROOT)
    if child.returncode != 0:
        sys.exit(f"the engine's rates failed:\n{child.stderr}")
    rates = json.loads(child.stdout.strip().splitlines()[-1])
    run = run_project(args, model_dir, os.path.join(scratch, "vllm"), True, engine="vllm")
    print(f"--engine vllm: iteration {run['iteration_s']:.3f} s (sample {run['stages_s']['sample']:.3f} s, the "
          f"policy's forward for π_old included; weight reload {run['engine_sync_s']:.3f} s an iteration); the "
          f"engine alone: start-up {rates['start_s']:.1f} s once, {rates['tokens_per_s']:.0f} tokens/s on this "
          f"batch, reload {rates['reload_s']:.3f} s; peak RSS {run['peak_rss_mb']:.0f} MB")
    return {"engine": rates, "train": run}


def table_1(args, model_dir, device):
    tokenizer = loading.load_tokenizer(model_dir)
    policy, ref = loading.load_model(model_dir, device), loading.load_model(model_dir, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    prompt_ids, prompt_mask = prompt_batch(tokenizer, device, B, G)

    def floor_runs(n):
        return [floor_once(policy, ref, optimizer, prompt_ids, prompt_mask, device) for _ in range(n)]

    # Half the floor's repetitions before the project's runs and half after, so that a machine that
    # slows down or speeds up over the minutes of the benchmark weighs on both sides alike.
    floor_runs(1)
    runs = floor_runs(args.floor_reps // 2)
    # The system's temporary folder: a benchmark killed midway leaves nothing in the repository.
    with tempfile.TemporaryDirectory() as scratch:
        project = {name: run_project(args, model_dir, os.path.join(scratch, name), share)
                   for name, share in (("shared", True), ("unshared", False))}
        baseline = args.baseline and against_baseline(args, model_dir, scratch)
        vllm_runs = engine_table(args, model_dir, scratch)
    runs += floor_runs(args.floor_reps - args.floor_reps // 2)
    floor = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rates, in_process = sampler_rates(policy, ref, prompt_ids, prompt_mask, tokenizer.pad_token_id,
                                      args.floor_reps, device)
    floor_c = compute_floor(policy.config, B, prompt_ids.shape[1], G, T, device)

    print(f"\nTable 1. model {model_dir}, device {device}, torch threads {torch.get_num_threads()}; B={B} × G={G}, "
          f"prompts of {prompt_ids.shape[1]} tokens (padded), {T} new tokens; a save every {args.save_every} "
          f"iterations after {args.warmup} warm-up; floor median of {args.floor_reps}")
    print(f"{'stage':34s} {'shared s':>9s} {'unshared s':>10s} {'floor s':>9s}")
    floor_of = {"sample": floor["sample"], "update (with the reference pass)": floor["update"] + floor["reference"]}
    for name in project["shared"]["stages_s"]:
        shown = f"{floor_of[name]:9.3f}" if name in floor_of else ""
        print(f"{name:34s} {project['shared']['stages_s'][name]:9.3f} {project['unshared']['stages_s'][name]:10.3f} "
              f"{shown:>9s}")
    print(f"{'iteration':34s} {project['shared']['iteration_s']:9.3f} {project['unshared']['iteration_s']:10.3f} "
          f"{floor['total']:9.3f}")
    ratios = {name: p["iteration_s"] / floor["total"] for name, p in project.items()}
    print(f"ratio to the floor: shared {ratios['shared']:.3f}, unshared {ratios['unshared']:.3f}; file I/O "
          f"{project['shared']['io_share']:.1%} of the shared iteration; sampler tokens/s on this batch: shared "
          f"{rates['shared']:.0f}, unshared {rates['unshared']:.0f}, generate {rates['generate']:.0f}; peak RSS "
          f"{project['shared']['peak_rss_mb']:.0f} MB shared, {project['unshared']['peak_rss_mb']:.0f} MB unshared")
    print_compute_floor(project["shared"], in_process, floor_c, floor)
    if baseline:
        print_baseline(baseline, args.baseline)
    return {"project": project, "baseline": baseline, "vllm": vllm_runs, "floor_s": floor, "ratio_to_floor": ratios, "sampler_tokens_per_s": rates,
            "prompt_tokens": prompt_ids.shape[1], "in_process_s": in_process, "compute_floor": floor_c}


def against_baseline(args, model_dir, scratch):
    """The shared path of this checkout's train.py and of --baseline's, alternating (baseline, this,
    baseline, this), so that a machine whose speed drifts over the minutes weighs on both alike:
    {"baseline": [run, run], "this": [run, run]} of run_project's results."""
    runs = {"baseline": [], "this": []}
    for rep in range(2):
        for name, root in (("baseline", os.path.abspath(args.baseline)), ("this", ROOT)):
            runs[name].append(run_project(args, model_dir, os.path.join(scratch, f"{name}_{rep}"), True, root))
    return runs


def print_baseline(runs, baseline_dir):
    """Each alternating run's iteration seconds, their means, and this checkout's over the baseline's."""
    commit = subprocess.run(["git", "-C", baseline_dir, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    mean = {name: statistics.mean(r["iteration_s"] for r in rs) for name, rs in runs.items()}
    print(f"\nAgainst the baseline {baseline_dir} (commit {commit}), the shared path, runs alternating:")
    for name, rs in runs.items():
        stages = ", ".join(f"{stage} {statistics.mean(r['stages_s'][stage] for r in rs):.3f}"
                           for stage in rs[0]["stages_s"] if not stage.startswith(("score", "write", "other")))
        each = ", ".join(f"{r['iteration_s']:.3f}" for r in rs)
        print(f"  {name:8s} iteration s {each} (mean {mean[name]:.3f}; {stages})")
    print(f"  this / baseline: {mean['this'] / mean['baseline']:.3f}")


def print_compute_floor(project, in_process, floor_c, naive):
    """The shared iteration's stages against the compute floor and the naive floor. train.py times the
    reference pass with the update, which runs it beside its forward; the rows "sampling" and
    "reference pass" are the sampler and the reference pass timed apart in this process."""
    rate, stages = floor_c["gflop_per_s"], floor_c["stages"]
    gflop = sum(s["gflop"] for s in stages.values())
    print(f"\nThe shared iteration against its compute floor: {gflop:,.0f} GFLOP of matmuls at the best rate "
          f"measured on the model's own matmul shapes, {rate:.0f} GFLOP/s ({'×'.join(map(str, floor_c['best_shape']))}"
          f", m×k×n), is {gflop / rate:.2f} s; `matmul s` is each stage's matmuls at their own shapes' rates")
    print(f"{'stage':34s} {'s':>7s} {'GFLOP':>7s} {'matmul s':>8s} {'floor s':>7s} {'× floor':>7s} {'× naive':>7s}")

    def row(name, seconds, of, naive_s=None):
        g, m = sum(stages[k]["gflop"] for k in of), sum(stages[k]["matmul_s"] for k in of)
        ratio = f"{seconds * rate / g:7.2f}" if g else f"{'-':>7s}"
        vs_naive = f"{seconds / naive_s:7.3f}" if naive_s else f"{'-':>7s}"
        print(f"{name:34s} {seconds:7.3f} {g:7.1f} {m:8.3f} {g / rate:7.3f} {ratio} {vs_naive}")

    row("  sampling (in this process)", in_process["sampling"], ["sampling"], naive["sample"])
    row("  reference pass (in this process)", in_process["reference"], ["reference"], naive["reference"])
    of = {"sample": (["sampling"], naive["sample"]),
          "update (with the reference pass)": (["reference", "update"], naive["update"] + naive["reference"])}
    for name, seconds in project["stages_s"].items():
        row(name, seconds, *of.get(name, ([], None)))
    row("iteration", project["iteration_s"], list(stages), naive["total"])


def cell(model_dir, device, length, group_size, share):
    """One cell of table 2 in this (child) process: sample, then one update step (with the reference pass)."""
    tokenizer = loading.load_tokenizer(model_dir)
    policy, ref = loading.load_model(model_dir, device), loading.load_model(model_dir, device)
    prompt_ids, prompt_mask = prompt_batch(tokenizer, device, 1, group_size, length)
    sampling, _, update_step = iteration_stages(policy, ref, tokenizer, model_dir, prompt_ids, prompt_mask,
                                                group_size, share)
    times = {}
    t = time.perf_counter()
    rollouts = sampling(0)
    sync(device)
    times["sample"] = time.perf_counter() - t
    t = time.perf_counter()
    update_step(rollouts)
    sync(device)
    times["update"] = time.perf_counter() - t
    print(json.dumps({"prompt_tokens": prompt_ids.shape[1], **times}))


def table_2(args, model_dir):
    results = []
    for length in SCALING_P:
        for group_size in SCALING_G:
            row = {"G": group_size}
            for share in (True, False):
                argv = [sys.executable, os.path.abspath(__file__), "--model", model_dir, "--device", args.device,
                        "--cell", str(length), str(group_size), str(int(share))]
                with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
                    proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, text=True)
                    code, peak_rss_mb = wait_with_peak_rss(proc)
                    out.seek(0), err.seek(0)
                    if code == -signal.SIGKILL:      # the kernel's OOM killer: this cell does not fit here
                        row[share] = {"sample": None, "update": None, "peak_rss_mb": peak_rss_mb, "killed": True}
                        continue
                    if code != 0:
                        sys.exit(f"cell {length} × {group_size} failed:\n{err.read()}")
                    row[share] = {**json.loads(out.read().strip().splitlines()[-1]), "peak_rss_mb": peak_rss_mb}
            row["P"] = next((r["prompt_tokens"] for r in (row[True], row[False]) if "prompt_tokens" in r), length)
            results.append(row)
            print_scaling_row(row, first=len(results) == 1)
    return [{"P": r["P"], "G": r["G"], "shared": r[True], "unshared": r[False]} for r in results]


def print_scaling_row(row, first):
    if first:
        print(f"\nTable 2. one prompt × G completions of {T} tokens; seconds of sampling (with the reference "
              f"pass) and of one update step, and peak RSS of the process")
        print(f"{'P':>5s} {'G':>3s} | {'sample s':>17s} | {'update s':>17s} | {'total s':>17s} | {'peak MB':>13s}")
        print(f"{'':9s} | {'shared  unshared':>17s} | {'shared  unshared':>17s} | {'shared  unshared  ×':>17s} | "
              f"{'shared unsh.':>13s}")
    s, u = row[True], row[False]
    total_s, total_u = (None if r.get("killed") else r["sample"] + r["update"] for r in (s, u))
    ratio = f"{total_u / total_s:4.1f}" if total_s and total_u else "   -"

    def secs(x, width):                  # a path killed for memory: `killed`, and its RSS at the kill
        return f"{x:{width}.2f}" if x is not None else f"{'killed':>{width}s}"
    print(f"{row['P']:5d} {row['G']:3d} | {secs(s['sample'], 7)} {secs(u['sample'], 9)} | {secs(s['update'], 7)} "
          f"{secs(u['update'], 9)} | {secs(total_s, 6)} {secs(total_u, 7)} {ratio} | "
          f"{s['peak_rss_mb']:6.0f} {u['peak_rss_mb']:6.0f}")


def main():
    args = parse_args()
    model_dir = args.model or builders.default_model_dir()
    device = distributed.pick_device(args.device)
    if args.cell:
        return cell(model_dir, device, *args.cell[:2], bool(args.cell[2]))
    if args.engine_rates:
        return engine_rates(model_dir, args.floor_reps, device)
    result = {"device": str(device), "model": model_dir}
    if args.table in (None, 1):
        result["table_1"] = table_1(args, model_dir, device)
    if args.table in (None, 2):
        result["table_2"] = table_2(args, model_dir)
    if args.table in (None, 3):
        result["table_3"] = table_3(args, model_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
