"""Shared fixtures: tiny Llama checkpoints built from a config, a prompt file, and `cli()`, which
runs a stage's command line (argparse, error handling, exit code) inside the test process so the
suite does not pay transformers' import time for every call."""

import contextlib
import io
import json
import os
import runpy
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpo.models import builders  # noqa: E402

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@dataclass
class Result:
    code: int
    out: str
    err: str


def cli(script, *args):
    """`python script args...` run in-process; returns exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = [script, *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
    return Result(code, out.getvalue(), err.getvalue())


def assert_user_error(result, *fragments):
    """A user's mistake: non-zero exit, one line on stderr naming the problem, no traceback."""
    assert result.code != 0, result
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert "Traceback" not in result.err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


PROMPTS = [
    {"prompt": "What is 2 + 3?", "answer": "5", "id": "a"},
    {"prompt": "Add the numbers 10 and 7, then tell me the sum.", "answer": "17", "id": "b"},
    {"messages": [{"role": "user", "content": "9+1?"}], "answer": "10", "id": "c"},
    {"prompt": "1+1=", "answer": "2", "id": "d"},
]


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "policy": builders.make_tiny_llama(str(root / "policy"), seed=0),
        "ref": builders.make_tiny_llama(str(root / "ref"), seed=1),
    }


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "prompts.jsonl", PROMPTS)


@pytest.fixture(scope="session")
def rollout_dir(models, prompts_file, tmp_path_factory):
    """One sample.py run shared by the tests that read its files: B=4, G=4, τ=0.7, with a reference."""
    out = tmp_path_factory.mktemp("it0")
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", out,
            "--group-size", 4, "--num-prompts", 4, "--max-new-tokens", 40, "--temperature", 0.7,
            "--seed", 3, "--ref-model", models["ref"], "--micro-batch-size", 6)
    assert r.code == 0, r.err
    return out


def replay_iteration(it_dir, out):
    """Run the stage commands of it_dir/replay.sh in-process, writing to `out`; returns out."""
    default = f"${{OUT:-replay/{os.path.basename(it_dir)}}}"
    for line in open(os.path.join(it_dir, "replay.sh")).read().splitlines():
        if line.startswith("python "):
            argv = shlex.split(line.replace(default, str(out)))
            r = cli(argv[1], *argv[2:])
            assert r.code == 0, (argv[1], r.err)
    return out


def kill_then_resume(argv, run_dir, markers):
    """`python argv --run-dir run_dir`, SIGKILLed as soon as each marker file exists (resumed after the
    first kill), then resumed once more to the end; returns the finishing process."""
    argv = [sys.executable, *argv, "--run-dir", str(run_dir)]
    for marker in markers:
        proc = subprocess.Popen(argv + (["--resume"] if os.path.exists(run_dir) else []), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while not os.path.exists(marker) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, f"the run ended before {marker} appeared"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.run(argv + ["--resume"], cwd=ROOT, capture_output=True, text=True)


def token_loss_terms(logp, old, ref, adv, mask, *, beta, clip_eps, clip_eps_high, policy_loss="ppo", dual_clip=None,
                     kl_estimator="k3", is_weight=None):
    """ℓ_t and its terms as update.py:micro_batch_loss composes them from the policy loss of --policy-loss,
    the importance weight and update.py:token_loss, on hand-made tensors [n, T] (advantages [n])."""
    import update
    loss_fn = update.POLICY_LOSSES[policy_loss][0]
    pg_loss, ratio, clipped = loss_fn(logp, old, adv[:, None], mask, update.Clip(clip_eps, clip_eps_high, dual_clip))
    if is_weight is not None:
        pg_loss = is_weight * pg_loss
    loss, kl, penalty = update.token_loss(pg_loss, logp, ref, beta=beta, kl_estimator=kl_estimator)
    return loss, {"pg_loss": pg_loss, "ratio": ratio, "kl": kl, "kl_penalty": penalty, "clipped_low": clipped["low"],
                  "clipped_high": clipped["high"], "dual_clipped": clipped.get("dual")}
