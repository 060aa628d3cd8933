"""The checks to run the day a GPU is lent: one command, a few minutes, one JSON line.

    python benchmarks/gpu_check.py                 # on a machine with one CUDA GPU and no network
    python benchmarks/gpu_check.py --small         # the same checks on the tiny model (a CPU, seconds)

1. The stage tests that do not pin a device (--tests, pytest's selection), on the GPU: every stage
   loads its models with --device auto, which picks CUDA.
2. The default job for --iterations iterations (bf16 autocast in every forward; log π_old recomputed
   by the update, --old-logprobs recompute, the default on a GPU): its seconds per iteration and
   the first minibatch's on-policy check (diag/logprob_diff_max, diag/logprob_diff_mean,
   diag/outside_clip_on_policy: how far the sampler's bf16 log-probs are from the update's).
3. benchmarks/iteration.py --table 1: the iteration against the naive floor and the compute floor,
   and the sampler's tokens per second against `generate` on the same batch (and vLLM's, installed).
4. The vLLM engine, where it is installed: its tests (tests/test_vllm.py) and the default job with
   --engine vllm (the engine's log-probs against the trainer's π_old: diag/rollout_is_diff_*). The
   lent GPU machines' image has no vLLM; there this part says so in one line.

Each part runs in its own child process with a deadline (--part-timeout), so one that hangs or fails
is reported as such and the others still run. The last line printed is the JSON of all four.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = ["tests/test_sample.py", "tests/test_score.py", "tests/test_advantage.py", "tests/test_update.py",
         "tests/test_variants.py", "tests/test_prefix_sharing.py", "tests/test_sampling.py"]


def child(argv, timeout):
    """A command in a child process: (exit code or "timeout", seconds, stdout, stderr)."""
    t = time.perf_counter()
    try:
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return r.returncode, time.perf_counter() - t, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:        # its output comes as bytes whatever text= asked
        text = [(x or b"").decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
        return "timeout", time.perf_counter() - t, *text


def environment():
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": gpu,
            "bf16": bool(gpu) and torch.cuda.is_bf16_supported()}


def stage_tests(selection, timeout):
    code, seconds, out, err = child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
                                    timeout)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", out)}
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
    return {"exit": code, "seconds": round(seconds, 1), **counts, "failed_tests": failed}


def default_job(iterations, flags, timeout):
    from grpo.disk import files

    with tempfile.TemporaryDirectory() as run_dir:
        code, seconds, out, err = child([sys.executable, "train.py", "--run-dir", run_dir, "--iterations",
                                         str(iterations), "--eval-every", "0", *flags], timeout)
        result = {"exit": code, "seconds": round(seconds, 1)}
        if code != 0:
            return {**result, "error": err.strip().splitlines()[-1:]}
        metrics = [files.read_json(os.path.join(run_dir, f"iter_{i:04d}", "metrics.json")) for i in range(iterations)]
        update_args = files.load_tensors(os.path.join(run_dir, "policy", "optimizer.safetensors"),
                                         ("optimizer/1", {}))[1]
    keys = ("diag/logprob_diff_max", "diag/logprob_diff_mean", "diag/outside_clip_on_policy", "losses/kl",
            "charts/reward_mean", "perf/sample_s", "perf/update_s", "perf/tokens_per_s", "perf/engine_sync_s",
            "diag/rollout_is_diff_max", "diag/rollout_is_diff_mean")
    return {**result, "iteration_s_median": statistics.median(m["perf/iteration_s"] for m in metrics),
            "old_logprobs": update_args["old_logprobs"],
            **{k: [round(m[k], 6) if isinstance(m[k], float) else m[k] for m in metrics] for k in keys
               if k in metrics[0]}}


def engine(selection, iterations, flags, timeout):
    """Part 4: tests/test_vllm.py and the default job under --engine vllm, where vLLM is installed."""
    from grpo.models import vllm_engine

    if not vllm_engine.installed():
        print("vLLM is not installed here (./setup.sh --engine vllm): the engine was not checked")
        return "not installed"
    return {"tests": stage_tests(selection, timeout),
            "default_job": default_job(iterations, [*flags, "--engine", "vllm"], timeout)}


def iteration_table(flags, timeout):
    code, seconds, out, err = child([sys.executable, "benchmarks/iteration.py", "--table", "1", *flags], timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if code != 0 or not lines:
        return {"exit": code, "seconds": round(seconds, 1), "error": err.strip().splitlines()[-3:]}
    table = json.loads(lines[-1])
    return {"exit": code, "seconds": round(seconds, 1), **table}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true",
                   help="the tiny model and settings (seconds on a CPU): to check the script itself")
    p.add_argument("--tests", nargs="*", default=None, help="pytest's selection (default: the stage tests)")
    p.add_argument("--engine-tests", nargs="*", default=["tests/test_vllm.py"],
                   help="pytest's selection for part 4 (default: tests/test_vllm.py)")
    p.add_argument("--iterations", type=int, default=None, help="of the default job (default 4; --small 2)")
    p.add_argument("--part-timeout", type=int, default=300, help="seconds each part may take (default 300)")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from grpo.models import builders

    iterations = args.iterations or (2 if args.small else 4)
    job_flags, table_flags = [], ["--floor-reps", "2", "--save-every", "2"]
    tmp = tempfile.mkdtemp()
    if args.small:
        tiny = builders.make_tiny_llama(os.path.join(tmp, "tiny"), num_heads=2)   # heads vLLM's CPU path takes
        job_flags = ["--config", "tiny", "--model", tiny, "--max-new-tokens", "8"]
        table_flags += ["--model", tiny]
    try:
        result = {"environment": environment(),
                  "tests": stage_tests(TESTS if args.tests is None else args.tests, args.part_timeout),
                  "default_job": default_job(iterations, job_flags, args.part_timeout),
                  "iteration_table_1": iteration_table(table_flags, args.part_timeout),
                  "engine": engine(args.engine_tests, iterations, job_flags, args.part_timeout)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
