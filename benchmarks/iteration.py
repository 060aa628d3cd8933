"""What one GRPO iteration of this project costs, against the bare floor for the same work.

    python benchmarks/iteration.py                    # SmolLM2-135M-Instruct (the default model)
    python benchmarks/iteration.py --model DIR        # any local checkpoint folder

The configuration is fixed: B = 2 prompts × G = 8 completions, exactly 32 new tokens each (EOS does
not end a completion on either side), τ = 0.7, β = 0.01, μ = 1, one AdamW step per iteration.

- The project: `python train.py` at that configuration, in a child process, exactly as a user runs
  it (sample → score → advantage → update, every stage file written, policy/ saved every
  --save-every iterations, in the background). Each stage's seconds come from its
  iter_XXXX/metrics.json. The iteration time is taken over one whole save cycle after --warmup
  (--save-every iterations, one of which saves): the median iteration, plus the cycle's excess over
  save_every medians spread over the cycle, which is what the save costs a run (the slower
  iterations while the saver's thread writes, and any wait for it before an update).
- The floor, in this process, with no framework around it: one `model.generate` call for the 16
  completions (min_new_tokens = max_new_tokens = 32), one reference forward, one policy forward +
  backward + AdamW step on the same tokens. Median over the same number of repetitions, half of
  them run before the project's run and half after.

Prints a table, then one JSON line with iteration_s, floor_s, ratio_to_floor, io_share,
peak_rss_mb (the project's process) and the per-stage numbers.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from grpo import builders, distributed, files, modeling, tasks  # noqa: E402

B, G, T, TAU, BETA = 2, 8, 32, 0.7, 0.01


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--floor-reps", type=int, default=6, help="measured repetitions of the floor (default 6)")
    p.add_argument("--warmup", type=int, default=2,
                   help="iterations not measured (default 2: the first two allocate AdamW's state and buffers)")
    p.add_argument("--save-every", type=int, default=10, help="train.py's --save-every (default 10, its default)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    return p.parse_args()


def run_project(args, model, run_dir):
    """train.py in a child process; returns (its iteration metrics, its peak RSS in MB)."""
    total = args.warmup + args.save_every + 1          # one save cycle, then the last iteration (which always saves)
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model, "--run-dir", run_dir,
            "--iterations", str(total), "--num-prompts", str(B), "--group-size", str(G), "--max-new-tokens", str(T),
            "--temperature", str(TAU), "--beta", str(BETA), "--epochs", "1", "--eval-every", "0", "--ignore-eos",
            "--save-every", str(args.save_every), "--device", args.device]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"train.py failed:\n{stderr}")
    metrics = [files.read_json(os.path.join(run_dir, f"iter_{i:04d}", "metrics.json")) for i in range(total)]
    return metrics, usage.ru_maxrss / 1024


def prompt_batch(tokenizer, device):
    train, _, _ = tasks.make_task("arithmetic", 0)
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in train[:B]]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].repeat_interleave(G, 0).to(device), enc["attention_mask"].repeat_interleave(G, 0).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def floor_once(policy, ref, optimizer, prompt_ids, prompt_mask, device):
    """The same work with nothing around it: generate, reference forward, forward + backward + step."""
    times = {}
    t = time.perf_counter()
    with torch.inference_mode():
        seqs = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=TAU,
                               top_k=0, top_p=1.0, max_new_tokens=T, min_new_tokens=T)
    sync(device)
    times["sample"] = time.perf_counter() - t
    seqs = seqs.clone()                                                   # [N, P + T], leave inference mode
    mask = torch.cat([prompt_mask, torch.ones_like(seqs[:, prompt_ids.shape[1]:])], 1)
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


def main():
    args = parse_args()
    model_dir = args.model or builders.default_model_dir()
    device = distributed.pick_device(args.device)

    tokenizer = modeling.load_tokenizer(model_dir)
    policy, ref = modeling.load_model(model_dir, device), modeling.load_model(model_dir, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    prompt_ids, prompt_mask = prompt_batch(tokenizer, device)

    def floor_runs(n):
        return [floor_once(policy, ref, optimizer, prompt_ids, prompt_mask, device) for _ in range(n)]

    # Half the floor's repetitions before the project's run and half after, so that a machine that
    # slows down or speeds up over the minutes of the benchmark weighs on both sides alike.
    floor_runs(args.warmup)
    runs = floor_runs(args.floor_reps // 2)
    with tempfile.TemporaryDirectory(dir=ROOT) as scratch:
        metrics, peak_rss_mb = run_project(args, model_dir, os.path.join(scratch, "run"))
    runs += floor_runs(args.floor_reps - args.floor_reps // 2)
    floor = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    floor_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    cycle = metrics[args.warmup:args.warmup + args.save_every]          # one save cycle
    assert sum(m["iteration"] + 1 == args.save_every for m in cycle) == 1
    keys = {"sample": "perf/sample_s", "score": "perf/score_s", "update": "perf/update_s", "write stage files": "perf/io_s"}
    project = {name: statistics.median(m[key] for m in cycle) for name, key in keys.items()}
    project["other (advantage, metrics)"] = statistics.median(
        m["perf/iteration_s"] - m["perf/checkpoint_s"] - sum(m[k] for k in keys.values()) for m in cycle)
    loop_s = statistics.median(m["perf/iteration_s"] for m in cycle)
    # What the save adds to the cycle, spread over it; never less than the main thread's own part.
    excess = statistics.mean(m["perf/iteration_s"] for m in cycle) - loop_s
    project["save policy/ (amortised)"] = max(excess, statistics.mean(m["perf/checkpoint_s"] for m in cycle))
    iteration_s = loop_s + project["save policy/ (amortised)"]
    checkpoint_s = next(m["perf/checkpoint_s"] for m in cycle if m["iteration"] + 1 == args.save_every)

    tokens = B * G * T
    io_s = project["write stage files"] + project["save policy/ (amortised)"]
    print(f"model {model_dir}, device {device}, torch threads {torch.get_num_threads()}; B={B} × G={G}, {T} tokens "
          f"each; {args.save_every}-iteration save cycle after {args.warmup} warm-up, floor median of {args.floor_reps}")
    print(f"{'stage':32s} {'project s':>10s} {'floor s':>10s}")
    floor_of = {"sample": floor["sample"], "update": floor["update"]}
    for name, seconds in project.items():
        shown = f"{floor_of[name]:10.3f}" if name in floor_of else f"{'':10s}"
        print(f"{name:32s} {seconds:10.3f} {shown}")
    print(f"{'reference pass (in sample)':32s} {'':10s} {floor['reference']:10.3f}")
    print(f"{'iteration':32s} {iteration_s:10.3f} {floor['total']:10.3f}")
    print(f"ratio to floor {iteration_s / floor['total']:.3f}; file I/O {io_s / iteration_s:.1%} of the iteration "
          f"(a save every {args.save_every} iterations: {checkpoint_s:.2f} s on the main thread, the rest in the "
          f"background); sampling "
          f"{tokens / project['sample']:.0f} tok/s (floor {tokens / floor['sample']:.0f}); peak RSS "
          f"{peak_rss_mb:.0f} MB (floor process {floor_rss_mb:.0f} MB)")
    print(json.dumps({
        "iteration_s": round(iteration_s, 4), "floor_s": round(floor["total"], 4),
        "ratio_to_floor": round(iteration_s / floor["total"], 4), "io_share": round(io_s / iteration_s, 4),
        "peak_rss_mb": round(peak_rss_mb), "floor_peak_rss_mb": round(floor_rss_mb),
        "checkpoint_s": round(checkpoint_s, 3), "save_every": args.save_every,
        "tokens_per_s": round(tokens / project["sample"], 1), "floor_tokens_per_s": round(tokens / floor["sample"], 1),
        "stages_s": {k: round(v, 4) for k, v in project.items()}, "floor_stages_s": {k: round(v, 4) for k, v in floor.items()},
        "device": str(device), "model": model_dir,
    }))


if __name__ == "__main__":
    main()
