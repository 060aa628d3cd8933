"""Every stage and the loop under `torchrun --nproc_per_node 2` (gloo on the CPU), against one process."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, cli, write_jsonl
from safetensors.torch import load_file

from grpo.models import distributed

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(2, 3), (10, 7), (9, 1), (1, 1), (4, 4)]]


def torchrun(script, *args, timeout=240):
    """`torchrun --standalone --nproc_per_node 2 script args...`, as a user types it."""
    return subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", script, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def files(models, tmp_path_factory):
    """5 prompts × G = 4 sampled by two processes (rank 0 gets 3 groups, rank 1 gets 2), scored, advantages."""
    d = tmp_path_factory.mktemp("dist")
    prompts = write_jsonl(d / "prompts.jsonl", PROMPTS)
    sample_args = ["--model", models["policy"], "--prompts", prompts, "--group-size", 4, "--max-new-tokens", 16,
                   "--temperature", 0.9, "--ref-model", models["ref"], "--seed", 5]
    ok(torchrun("sample.py", *sample_args, "--out", d / "s2"))
    rewards = d / "r.safetensors"
    assert cli("score.py", "--rollouts", d / "s2" / "rollouts.safetensors", "--samples", d / "s2" / "samples.jsonl",
               "--reward", "tests/length_reward.py:char_count", "--out", rewards).code == 0
    assert cli("advantage.py", "--rewards", rewards, "--out", d / "a.safetensors").code == 0
    return {"dir": d, "prompts": prompts, "sample_args": sample_args, "rollouts": d / "s2" / "rollouts.safetensors",
            "samples": d / "s2" / "samples.jsonl", "advantages": d / "a.safetensors"}


def test_sample_shards_whole_groups_with_a_seed_per_rank(files):
    """Rank r's groups are exactly one process's draw for that share (--start, --num-prompts) with the
    seed distributed.rank_seed(seed, r); the rows come back in group order with one padding."""
    d = files["dir"]
    both = load_file(files["rollouts"])
    shares = [(0, 3), (3, 2)]                                   # shard_slice(5, r, 2)
    parts = []
    for rank, (start, count) in enumerate(shares):
        out = d / f"one_{rank}"
        assert cli("sample.py", *files["sample_args"][:-1], distributed.rank_seed(5, rank), "--start", start,
                   "--num-prompts", count, "--out", out).code == 0
        parts.append(load_file(out / "rollouts.safetensors"))
    assert both["group_ids"].tolist() == [g for g in range(5) for _ in range(4)]
    assert both["prompt_ids"].shape[1] == max(p["prompt_ids"].shape[1] for p in parts)
    assert both["completion_ids"].shape[1] == max(p["completion_ids"].shape[1] for p in parts)
    rows = 0
    for part in parts:
        n, P, T = part["group_ids"].numel(), part["prompt_ids"].shape[1], part["completion_ids"].shape[1]
        here = slice(rows, rows + n)
        assert torch.equal(both["prompt_ids"][here, -P:], part["prompt_ids"])
        assert not both["prompt_mask"][here, :-P].any()             # extra left padding only
        for key in ("completion_ids", "completion_mask", "truncated"):
            assert torch.equal(both[key][here, :T] if both[key].dim() == 2 else both[key][here], part[key]), key
        for key in ("old_logprobs", "ref_logprobs"):                # torchrun runs one thread per process
            torch.testing.assert_close(both[key][here, :T], part[key], atol=2e-5, rtol=0)
        rows += n
    samples = [json.loads(line) for line in open(files["samples"])]
    assert [s["group"] for s in samples] == both["group_ids"].tolist()
    assert [s["answer"] for s in samples[::4]] == [p["answer"] for p in PROMPTS]


def test_score_under_torchrun_writes_what_one_process_writes(files, tmp_path):
    (tmp_path / "holes.py").write_text(
        "def holes(prompts, completions, **k):\n"
        "    lengths = [len(c if isinstance(c, str) else c[0]['content']) for c in completions]\n"
        "    return [None if n % 3 == 0 else float('nan') if n % 3 == 1 else float(n) for n in lengths]\n")
    args = ["--rollouts", files["rollouts"], "--samples", files["samples"], "--reward", f"{tmp_path}/holes.py:holes",
            "--on-reward-error", "skip"]              # None: the reward does not apply; NaN: skipped as an error
    ok(torchrun("score.py", *args, "--out", tmp_path / "two.safetensors"))
    assert cli("score.py", *args, "--out", tmp_path / "one.safetensors").code == 0
    one, two = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=0, atol=0, equal_nan=True)
    assert 0 < int(two["skipped"].sum()) < 20                  # rows skipped on both ranks' shares


@pytest.mark.parametrize("loss_agg, fsdp", [("seq", False), ("token", False), ("dr_grpo", False), ("token", True),
                                            ("seq", True)])
def test_update_under_torchrun_takes_the_one_process_step(models, files, tmp_path, loss_agg, fsdp):
    """Same files → same loss, grad_norm (1e-5), weights and AdamW state after 4 steps, two ranks sharing
    each prompt's prefix against one process that does not. Minibatches of
    6 and micro-batches of 2 split 3/3 (and the last minibatch 1/1) across the ranks; with --fsdp
    the second run continues from the first's optimizer state."""
    args = ["--rollouts", files["rollouts"], "--advantages", files["advantages"], "--lr", 1e-4, "--loss-agg", loss_agg,
            "--minibatch-size", 6, "--micro-batch-size", 2, "--epochs", 2 if fsdp else 1]
    start = models["policy"]
    if fsdp:                                                   # a checkpoint that holds optimizer.safetensors
        assert cli("update.py", "--model", start, *args, "--out", tmp_path / "start").code == 0
        start = tmp_path / "start"
        args.append("--allow-mismatch")                        # it did not sample the rollouts: deliberately
    ok(torchrun("update.py", "--model", start, *args, "--out", tmp_path / "two", *(["--fsdp"] if fsdp else [])))
    # One process on the unshared path: the prefix sharing of the two ranks is checked against it too.
    assert cli("update.py", "--model", start, *args, "--out", tmp_path / "one", "--no-prefix-sharing").code == 0
    one, two = (json.load(open(tmp_path / name / "metrics.json")) for name in ("one", "two"))
    assert one["optimizer_steps"] == two["optimizer_steps"] >= 4
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], abs=1e-5)
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert max_diff(load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)) < 1e-5, name
    moved = max_diff(load_file(tmp_path / "two" / "model.safetensors"), load_file(os.path.join(start, "model.safetensors")))
    assert moved > 1e-4                                        # the steps did change the weights


def test_lora_under_torchrun_takes_the_one_process_step(models, files, tmp_path):
    """DDP over a LoRA policy: the same adapters and AdamW state as one process, after 4 steps."""
    args = ["--model", models["policy"], "--rollouts", files["rollouts"], "--advantages", files["advantages"],
            "--lr", 1e-3, "--lora-r", 4, "--minibatch-size", 6, "--micro-batch-size", 2]
    ok(torchrun("update.py", *args, "--out", tmp_path / "two"))
    assert cli("update.py", *args, "--out", tmp_path / "one", "--no-prefix-sharing").code == 0
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        assert max_diff(load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)) < 1e-5, name
    assert max(t.abs().max().item() for k, t in load_file(tmp_path / "two" / "adapter_model.safetensors").items()
               if "lora_B" in k) > 1e-4                         # the adapters did move
    r = torchrun("update.py", *args, "--out", tmp_path / "fsdp", "--fsdp")
    assert r.returncode != 0 and "update.py: error: --lora-r with --fsdp" in r.stderr


def test_a_failing_rank_stops_the_others_with_its_error(files, tmp_path):
    (tmp_path / "rank_reward.py").write_text(
        "import os\ndef flaky(prompts, completions, **k):\n"
        "    if os.environ['RANK'] == '1':\n        raise ValueError('rank 1 cannot parse')\n"
        "    return [1.0] * len(completions)\n")
    r = torchrun("score.py", "--rollouts", files["rollouts"], "--samples", files["samples"], "--reward",
                 f"{tmp_path}/rank_reward.py:flaky", "--out", tmp_path / "r.safetensors", timeout=120)
    assert r.returncode != 0
    assert "score.py: error (rank 1 of 2): reward 'flaky' raised ValueError: rank 1 cannot parse" in r.stderr
    assert not (tmp_path / "r.safetensors").exists()


def test_train_under_torchrun_resumes_exactly_and_writes_one_process_files(tmp_path):
    """2 iterations with FSDP resumed to 3 with DDP give the weights of 3 straight (1e-6); the run folder
    holds the files a one-process run writes, with the same keys and shapes."""
    base = ["--config", "tiny", "--eval-every", 2, "--eval-prompts", 4, "--save-every", 1]
    ok(torchrun("train.py", *base, "--iterations", 3, "--run-dir", tmp_path / "straight"))
    ok(torchrun("train.py", *base, "--iterations", 2, "--fsdp", "--run-dir", tmp_path / "resumed"))
    ok(torchrun("train.py", "--resume", "--iterations", 3, "--run-dir", tmp_path / "resumed"))
    assert max_diff(load_file(tmp_path / "straight" / "policy" / "model.safetensors"),
                    load_file(tmp_path / "resumed" / "policy" / "model.safetensors")) < 1e-6
    assert cli("train.py", *base, "--iterations", 3, "--run-dir", tmp_path / "one").code == 0
    listing = {name: sorted(os.path.relpath(os.path.join(d, f), tmp_path / name)
                            for d, _, fs in os.walk(tmp_path / name) for f in fs if "tfevents" not in f)
               for name in ("one", "straight")}
    assert listing["one"] == listing["straight"]
    for it in ("iter_0000", "iter_0002"):
        for f in ("rollouts", "rewards", "advantages"):
            one = load_file(tmp_path / "one" / it / f"{f}.safetensors")
            two = load_file(tmp_path / "straight" / it / f"{f}.safetensors")
            assert {k: (v.dtype, v.shape[0]) for k, v in one.items()} == {k: (v.dtype, v.shape[0]) for k, v in two.items()}
        metrics = [json.load(open(tmp_path / name / it / "metrics.json")) for name in ("one", "straight")]
        assert metrics[0].keys() == metrics[1].keys()


def test_staleness_under_torchrun_is_refused_in_one_line(tmp_path):
    r = torchrun("train.py", "--config", "tiny", "--staleness", 1, "--run-dir", tmp_path / "run", timeout=120)
    assert r.returncode != 0
    assert "--staleness 1 runs one producer beside one update process, not under torchrun" in r.stderr
    assert not (tmp_path / "run").exists()
