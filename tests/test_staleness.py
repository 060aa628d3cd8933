"""train.py --staleness K: the producer process beside the update, on the fixed schedule of versions
max(0, k − K). A run reproduces itself to the bit, and resumes to the same policy after kill -9 of
either process; rollouts of the wrong version are refused."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import ROOT, assert_user_error, cli, kill_then_resume, replay_iteration
from grpo.cli import StageError
from grpo.loop import staleness

RUN = ["train.py", "--config", "tiny", "--iterations", "7", "--save-every", "3", "--eval-every", "0",
       "--staleness", "1"]


def same_files(a, b, names):
    for name in names:
        x, y = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
        assert x.keys() == y.keys(), name
        for k in x:
            assert torch.equal(x[k], y[k]), (name, k)


def outputs_of(run_dir):
    return ["policy/model.safetensors", "policy/optimizer.safetensors",
            *(f"iter_{i:04d}/{f}.safetensors" for i in range(7) for f in ("rollouts", "advantages"))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stale") / "straight"
    r = subprocess.run([sys.executable, *RUN, "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return run_dir


def test_each_iteration_is_sampled_by_version_i_minus_k_and_the_run_reproduces_itself(straight, tmp_path):
    for i in range(7):
        with safe_open(straight / f"iter_{i:04d}" / "rollouts.safetensors", framework="pt") as f:
            meta = f.metadata()
            assert "sampler_logprobs" in f.keys()              # the behaviour policy's, for π_prox/π_behav
        assert json.loads(meta["policy_version"]) == max(0, i - 1)
        metrics = json.loads((straight / f"iter_{i:04d}" / "metrics.json").read_text())
        assert metrics["charts/staleness"] == (0 if i == 0 else 1)
    config = json.loads((straight / "config.json").read_text())["config"]
    assert (config["old_logprobs"], config["rollout_is"]) == ("recompute", "tis")    # the decoupled objective
    # published/ keeps what the producer could still ask for; the last save links what a resume needs.
    assert sorted(os.listdir(straight / "published")) == ["policy_0006", "policy_0007"]
    assert os.listdir(straight / "checkpoints" / "iter_0006" / "published") == ["policy_0005"]
    again = tmp_path / "again"
    r = subprocess.run([sys.executable, *RUN, "--run-dir", str(again)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    same_files(straight, again, outputs_of(straight))


def test_a_kept_iteration_replays_with_the_stage_scripts_alone(straight, tmp_path):
    # iteration 3 follows the save after 3 updates (kept): sampled by version 2, which that save links.
    script = (straight / "iter_0003" / "replay.sh").read_text()
    assert str(straight / "checkpoints" / "iter_0003" / "published" / "policy_0002") in script
    assert "--old-logprobs recompute" in script and "--rollout-is tis" in script
    producer_threads = int(re.search(r"advantage ran on (\d+) thread", script).group(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(producer_threads)      # as the run: a CPU's sums depend on the thread count
    try:
        out = replay_iteration(straight / "iter_0003", tmp_path / "replay")
    finally:
        torch.set_num_threads(threads)
    for name in ("rollouts.safetensors", "advantages.safetensors"):
        x, y = load_file(straight / "iter_0003" / name), load_file(out / name)
        for k in y:          # sample.py alone writes no copy of old_logprobs as sampler_logprobs
            assert torch.equal(x[k], y[k]), (name, k)


def test_kill_9_of_the_update_process_then_resume_gives_the_same_run(straight, tmp_path):
    killed = tmp_path / "killed"
    # the first kill before any save, the second after the save at 3, each while the producer works
    finished = kill_then_resume(RUN, killed, [killed / "iter_0002" / "produced.json",
                                              killed / "iter_0005" / "rollouts.safetensors"])
    assert finished.returncode == 0, finished.stderr
    same_files(straight, killed, outputs_of(straight))


def producer_pid(parent):
    """The spawned producer among `parent`'s children."""
    for _ in range(2000):
        for task in os.listdir(f"/proc/{parent}/task"):
            for pid in open(f"/proc/{parent}/task/{task}/children").read().split():
                if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
                    return int(pid)
        time.sleep(0.01)
    raise AssertionError("no producer process")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_producer_stops_the_run_in_one_line_and_resume_finishes_it(straight, tmp_path):
    run_dir = tmp_path / "producer_killed"
    proc = subprocess.Popen([sys.executable, *RUN, "--run-dir", str(run_dir)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pid = producer_pid(proc.pid)
    marker = run_dir / "iter_0004" / "produced.json"
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode != 0
    assert "producer process" in err and "exit code -9" in err and "--resume" in err
    assert "Traceback" not in err
    r = subprocess.run([sys.executable, *RUN, "--run-dir", str(run_dir), "--resume"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    same_files(straight, run_dir, outputs_of(straight))


def test_the_update_refuses_rollouts_of_another_version_or_run(tmp_path):
    ok = {"policy_version": 2, "args": {"model": str(tmp_path / "published" / "policy_0002")}}
    staleness.check_version("r", ok, 3, 1, str(tmp_path / "published" / "policy_0002"))
    with pytest.raises(StageError, match="sampled by policy version 1 .*version 2"):
        staleness.check_version("r", {**ok, "policy_version": 1}, 3, 1, str(tmp_path / "published" / "policy_0002"))
    with pytest.raises(StageError, match="this run's version 2"):
        staleness.check_version("r", {**ok, "args": {"model": "/elsewhere/published/policy_0002"}}, 3, 1,
                                str(tmp_path / "published" / "policy_0002"))


def test_what_the_producer_cannot_run_yet_is_refused_in_one_line(tmp_path):
    for flags, fragment in [(["--algo", "ppo"], "--algo ppo"), (["--fsdp"], "--fsdp")]:
        r = cli("train.py", "--config", "tiny", "--staleness", 1, *flags, "--run-dir", tmp_path / "x")
        assert_user_error(r, "--staleness 1", fragment)
        assert not (tmp_path / "x").exists()


def test_the_decoupled_loss_equals_a_hand_computation_on_three_tokens():
    import math

    import update

    # π_θ, π_prox (the policy at the update's start) and π_behav (the stale sampler) of three tokens, A = 1.
    theta, prox, behav = (torch.log(torch.tensor([p])) for p in ([0.5, 0.3, 0.9], [0.4, 0.3, 0.6], [0.2, 0.6, 0.6]))
    mask, A = torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 1)
    # ρ = θ/prox = 1.25, 1, 1.5 → clipped at 1.2 where A > 0: min(ρA, clip(ρ)A) = 1.2, 1, 1.2;
    # w = prox/behav = 2, 0.5, 1 (tis, C = 2 leaves them); ℓ = −w·that = −2.4, −0.5, −1.2; seq mean −4.1/3.
    pg, ratio, _ = update.ppo_clip(theta, prox, A, mask, update.Clip(0.2, 0.2))
    w = update.rollout_is_weights(prox, behav, "tis", 2.0)
    loss_t, _, _ = update.token_loss(w * pg, theta, None, beta=0.0)
    loss = update.aggregate(loss_t, mask, "seq", 1, 3, 3)
    assert torch.allclose(ratio, torch.tensor([[1.25, 1.0, 1.5]]))
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0]]))
    assert math.isclose(loss.item(), -4.1 / 3, rel_tol=1e-6)
    # plain PPO against the stale sampler (π_old = π_behav) clips a different set: ρ = 2.5, 0.5, 1.5
    stale, _, clipped = update.ppo_clip(theta, behav, A, mask, update.Clip(0.2, 0.2))
    assert torch.allclose(stale, -torch.tensor([[1.2, 0.5, 1.2]])) and clipped["high"].tolist() == [[True, False, True]]


def test_a_lora_run_publishes_its_adapters_alone_and_staleness_2_samples_two_versions_behind(tmp_path):
    run_dir = tmp_path / "lora"
    threads = torch.get_num_threads()
    r = cli("train.py", "--config", "tiny", "--iterations", 4, "--eval-every", 0, "--staleness", 2, "--lora-r", 4,
            "--run-dir", run_dir)
    assert r.code == 0, r.err
    assert torch.get_num_threads() == threads        # the run in this process gave its threads back
    published = sorted(os.listdir(run_dir / "published"))
    assert published == ["policy_0002", "policy_0003", "policy_0004"]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(run_dir / "published" / "policy_0004"))
    assert not (run_dir / "published" / "policy_0004" / "model.safetensors").exists()
    versions = []
    for i in range(4):
        with safe_open(run_dir / f"iter_{i:04d}" / "rollouts.safetensors", framework="pt") as f:
            versions.append(json.loads(f.metadata()["policy_version"]))
    assert versions == [0, 0, 0, 1]
    assert [json.loads((run_dir / f"iter_{i:04d}" / "metrics.json").read_text())["charts/staleness"]
            for i in range(4)] == [0, 1, 2, 2]


def test_a_users_error_in_the_producer_is_its_line_and_the_updates(tmp_path):
    rewards = tmp_path / "flaky_reward.py"
    rewards.write_text("calls = 0\n"
                       "def flaky(prompts, completions, **kw):\n"
                       "    global calls\n"
                       "    calls += 1\n"
                       "    if calls == 3:\n"
                       "        raise ValueError('the third batch cannot be parsed')\n"
                       "    return [0.5] * len(completions)\n")
    r = subprocess.run([sys.executable, "train.py", "--config", "tiny", "--iterations", "5", "--eval-every", "0",
                        "--staleness", "1", "--reward", f"{rewards}:flaky", "--run-dir", str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert "train.py: error (the producer process): reward 'flaky' raised ValueError: the third batch" in lines[0]
    assert "the producer process (sample → score → advantage) ended with exit code 2" in lines[1]
