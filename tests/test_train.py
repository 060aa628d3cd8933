"""train.py end to end: the tiny configuration learns, its run folder is complete, resume is exact
(also after SIGKILL), and an iteration replays stage by stage from its files."""

import json
import math
import os
import shutil
import sys
import time

import pytest
import torch
from conftest import ROOT, assert_user_error, cli, kill_then_resume, replay_iteration
from safetensors import safe_open
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`python train.py --config tiny` at its default length (30 iterations, checkpoints every 10)."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    r = cli("train.py", "--config", "tiny", "--run-dir", run_dir)
    assert r.code == 0, r.err
    return run_dir, r


def iteration_metrics(run_dir):
    return [json.loads((run_dir / f"iter_{i:04d}" / "metrics.json").read_text()) for i in range(30)]


def test_tiny_config_learns(tiny_run):
    run_dir, _ = tiny_run
    rewards = [m["charts/reward_mean"] for m in iteration_metrics(run_dir)]
    # The reward (char_class) lies in [0, 1]: the last three iterations must beat the first three by 0.25.
    assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= 0.25, rewards
    before = [json.loads(line)["reward"] for line in open(run_dir / "eval" / "iter_0000.jsonl")]
    after = [json.loads(line)["reward"] for line in open(run_dir / "eval" / "iter_0030.jsonl")]
    assert sum(after) / len(after) > sum(before) / len(before) + 0.25


def test_run_directory_layout_and_metrics(tiny_run):
    run_dir, result = tiny_run
    assert json.loads((run_dir / "config.json").read_text())["config"]["task"] == "char_classes"
    for name in ["prompts.jsonl", "rollouts.safetensors", "samples.jsonl", "rewards.safetensors",
                 "advantages.safetensors", "metrics.json"]:
        assert (run_dir / "iter_0029" / name).is_file(), name
    assert len(open(run_dir / "iter_0029" / "samples.jsonl").readlines()) == 64       # B = 8 × G = 8
    for name in ["model.safetensors", "config.json", "optimizer.safetensors", "train_state.json", "tokenizer.json"]:
        assert (run_dir / "policy" / name).is_file(), name
    assert json.loads((run_dir / "policy" / "train_state.json").read_text())["iteration"] == 30
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["iter_0010", "iter_0020"]
    assert sorted(os.listdir(run_dir / "eval")) == ["iter_0000.jsonl", "iter_0010.jsonl", "iter_0020.jsonl",
                                                    "iter_0030.jsonl"]
    m = iteration_metrics(run_dir)[5]
    for key in ["charts/reward_mean", "charts/reward_std", "charts/frac_zero_std", "charts/completion_len",
                "charts/truncated_frac", "losses/loss", "losses/policy_loss", "losses/kl", "losses/clip_frac",
                "losses/entropy", "losses/grad_norm", "losses/ratio_mean", "perf/sample_s", "perf/update_s",
                "perf/tokens_per_s"]:
        assert isinstance(m[key], float), key
    assert "held-out reward after 30 iterations" in result.out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb")).Reload()
    tags = events.Tags()
    assert {"charts/reward_mean", "losses/kl", "eval/reward_mean", "perf/iteration_s"} <= set(tags["scalars"])
    assert [e.step for e in events.Scalars("charts/reward_mean")] == list(range(30))
    assert "samples/text_summary" in tags["tensors"]


def assert_same_weights(dir_a, dir_b):
    a, b = load_file(dir_a / "model.safetensors"), load_file(dir_b / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


def test_resume_gives_the_same_weights(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    resumed = tmp_path / "resumed"
    assert cli("train.py", "--config", "tiny", "--run-dir", resumed, "--iterations", 7).code == 0
    r = cli("train.py", "--config", "tiny", "--run-dir", resumed, "--iterations", 10, "--resume")
    assert r.code == 0, r.err
    # checkpoints/iter_0010 of the straight run is the policy after 10 iterations.
    assert_same_weights(run_dir / "checkpoints" / "iter_0010", resumed / "policy")
    assert load_file(run_dir / "iter_0009" / "rollouts.safetensors")["completion_ids"].equal(
        load_file(resumed / "iter_0009" / "rollouts.safetensors")["completion_ids"])


def test_resume_after_sigkill(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    killed = tmp_path / "killed"
    # Kill twice, before the first save and after the second (at 6), then let a third process finish.
    finished = kill_then_resume(["train.py", "--config", "tiny", "--iterations", "10", "--save-every", "3"], killed,
                                [killed / "iter_0002" / "rollouts.safetensors", killed / "iter_0006" / "prompts.jsonl"])
    assert finished.returncode == 0, finished.stderr
    assert_same_weights(run_dir / "checkpoints" / "iter_0010", killed / "policy")
    assert all((killed / f"iter_{i:04d}" / "metrics.json").is_file() for i in range(10))


def test_replay_an_iteration_stage_by_stage(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    it = run_dir / "iter_0010"
    out = replay_iteration(it, tmp_path / "replay")
    for name in ["rollouts", "rewards", "advantages"]:
        original, again = load_file(it / f"{name}.safetensors"), load_file(out / f"{name}.safetensors")
        assert original.keys() == again.keys()
        for k in original:
            assert torch.equal(original[k], again[k]), (name, k)
    metrics = json.loads((it / "metrics.json").read_text())
    replayed = json.loads((out / "policy" / "metrics.json").read_text())
    assert replayed["loss"] == metrics["losses/loss"] and replayed["grad_norm"] == metrics["losses/grad_norm"]


def test_run_dir_is_never_overwritten_and_resume_keeps_the_config(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    assert_user_error(cli("train.py", "--config", "tiny", "--run-dir", run_dir), "already holds a run", "--resume")
    assert_user_error(cli("train.py", "--run-dir", run_dir, "--resume", "--lr", 1), "--lr")
    assert_user_error(cli("train.py", "--run-dir", run_dir, "--resume", "--iterations", 20), "30", "--iterations 20")
    # A stage flag a stage would refuse is refused before the run folder exists.
    for flags, fragment in [(["--estimator", "ppo"], "--estimator"), (["--loss-agg", "mean"], "--loss-agg"),
                            (["--overlong-buffer", 100], "--overlong-buffer"), (["--dual-clip", 0.5], "--dual-clip")]:
        fresh = tmp_path / "fresh"
        assert_user_error(cli("train.py", "--config", "tiny", "--run-dir", fresh, *flags), fragment)
        assert not fresh.exists()


def test_policy_folder_is_what_update_py_writes(tiny_run):
    run_dir, _ = tiny_run
    metrics = json.loads((run_dir / "policy" / "metrics.json").read_text())
    last = json.loads((run_dir / "iter_0029" / "metrics.json").read_text())
    for key in ["loss", "policy_loss", "kl", "clip_frac", "ratio_mean", "ratio_max", "entropy", "grad_norm", "tokens"]:
        assert metrics[key] == last[f"losses/{key}"], key


def test_a_slow_background_save_holds_the_weights_it_was_given(tmp_path, monkeypatch):
    """The save after iteration 1 writes from the live weights in a thread; here it is held back a
    second before writing, while the next iteration samples and updates. The kept checkpoint must
    still be the policy after one iteration: the update waits for the save before changing them."""
    from grpo.disk import checkpoints

    flags = ["--config", "tiny", "--save-every", 1, "--eval-every", 0]
    assert cli("train.py", *flags, "--iterations", 1, "--run-dir", tmp_path / "one").code == 0
    real_save_file = checkpoints.save_file

    def slow_save_file(tensors, path, metadata=None):
        time.sleep(1.0)
        real_save_file(tensors, path, metadata)

    monkeypatch.setattr(checkpoints, "save_file", slow_save_file)
    r = cli("train.py", *flags, "--iterations", 3, "--run-dir", tmp_path / "three")
    assert r.code == 0, r.err
    assert_same_weights(tmp_path / "one" / "policy", tmp_path / "three" / "checkpoints" / "iter_0001")


def test_a_field_reaches_every_stage_with_a_flag_of_its_name(tmp_path):
    import train

    _, cfg, _ = train.parse_args(["--config", "tiny", "--micro-batch-size", "5", "--eps", "0.01",
                                  "--reward", "char_class", "tests/length_reward.py:char_count",
                                  "--reward-weights", "1", "0.5", "--max-grad-norm", "0.3", "--weight-decay", "0.1",
                                  "--run-dir", str(tmp_path / "r")])
    paths = {"model": "m", "ref_model": None, "critic": None}
    stage = {script: train.stage_args(script, cfg, "it", 0, 0, paths, []) for script in train.STAGES}
    assert [stage[s].micro_batch_size for s in ("sample.py", "score.py", "update.py")] == [5, 5, 5]
    assert stage["advantage.py"].eps == 0.01 and stage["update.py"].temperature == cfg.temperature
    assert stage["score.py"].reward == ["char_class", os.path.abspath("tests/length_reward.py") + ":char_count"]
    assert stage["score.py"].reward_weights == [1.0, 0.5]
    assert stage["update.py"].max_grad_norm == 0.3 and stage["update.py"].weight_decay == 0.1
    # Without --reward the task's reward, each weighted 1 by score.py's own default.
    _, cfg, _ = train.parse_args(["--config", "tiny", "--run-dir", str(tmp_path / "r")])
    assert train.stage_args("score.py", cfg, "it", 0, 0, paths, []).reward_weights == [1.0]
    r = cli("train.py", "--config", "tiny", "--run-dir", tmp_path / "w", "--reward-weights", 1, 2)
    assert_user_error(r, "--reward-weights has 2 values for 1")


def test_config_file_starts_a_run_from_json(tiny_run, tmp_path):
    import train

    run_dir, _ = tiny_run
    # A run's config.json as it is, flags on top: the same configuration but the flag.
    _, cfg, run = train.parse_args(["--config-file", str(run_dir / "config.json"), "--iterations", "3"])
    saved = json.loads((run_dir / "config.json").read_text())["config"]
    assert vars(cfg) == {**saved, "iterations": 3} and run == os.path.join("runs", "config")
    # The fields alone, some of them: the rest from the default configuration; the old name of --reward.
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"model": "tiny", "task": "char_classes", "rewards": ["char_class"], "lr": 0.002}))
    _, cfg, run = train.parse_args(["--config-file", str(path)])
    assert (cfg.model, cfg.lr, cfg.reward, cfg.group_size) == ("tiny", 0.002, ["char_class"], 8)
    assert run == os.path.join("runs", "mine")
    # An earlier version's --ratio-level and --dual-clip: today's --policy-loss.
    for old, loss in [({"ratio_level": "sequence", "dual_clip": None}, "gspo"), ({"ratio_level": "token"}, "ppo"),
                      ({"ratio_level": "token", "dual_clip": 3.0}, "dual_clip")]:
        path.write_text(json.dumps({"model": "tiny", "task": "char_classes", **old}))
        assert train.parse_args(["--config-file", str(path)])[1].policy_loss == loss
    path.write_text(json.dumps({"model": "tiny", "learning_rate": 0.1}))
    assert_user_error(cli("train.py", "--config-file", path), str(path), "learning_rate")
    path.write_text("[1, 2]")
    assert_user_error(cli("train.py", "--config-file", path), str(path), "JSON object")
    assert_user_error(cli("train.py", "--config-file", path, "--config", "tiny"), "--config-file")


def test_held_out_answers_do_not_depend_on_the_micro_batch(models):
    from conftest import PROMPTS

    from grpo.loop import evaluation
    from grpo.models import loading

    model, tok = loading.load_model(models["policy"], "cpu"), loading.load_tokenizer(models["policy"])
    records = PROMPTS * 2                                       # prompts of different lengths, 8 rows
    lengths_seen = []

    def score(rows, rollouts):
        lengths_seen.append(rollouts["completion_ids"].shape[1])
        return rollouts["completion_mask"].sum(-1).float(), {}, torch.zeros(len(rows), dtype=torch.bool)
    whole = evaluation.greedy_answers(model, tok, records, score, 12)
    passes = evaluation.greedy_answers(model, tok, records, score, 12, micro_batch_size=3)
    assert whole[1] == passes[1] and torch.equal(whole[2], passes[2]) and torch.equal(whole[4], passes[4])
    assert lengths_seen[0] == lengths_seen[1]


def test_prompt_files_replace_the_tasks_records(tmp_path):
    from conftest import write_jsonl

    train_file = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{c}:", "char_class": c, "mine": k}
                                                        for k, c in enumerate(["digits", "lower", "upper"] * 2)])
    chat = [{"prompt": [{"role": "user", "content": "digits:"}], "char_class": "digits", "held": k} for k in range(3)]
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat)
    run = tmp_path / "run"
    r = cli("train.py", "--config", "tiny", "--run-dir", run, "--iterations", 2, "--num-prompts", 4,
            "--prompts", train_file, "--eval-prompts-file", eval_file, "--eval-every", 2)
    assert r.code == 0, r.err
    seen = [json.loads(line)["mine"] for i in range(2) for line in open(run / f"iter_{i:04d}" / "prompts.jsonl")]
    assert sorted(seen[:6]) == list(range(6))                 # the first pass over the file: each record once
    held = [json.loads(line) for line in open(run / "eval" / "iter_0002.jsonl")]
    assert [row["held"] for row in held] == [0, 1, 2] and all("digits:" in row["prompt"] for row in held)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}, {"question": "no prompt"}])
    r = cli("train.py", "--config", "tiny", "--run-dir", tmp_path / "b", "--prompts", bad)
    assert_user_error(r, str(bad), "line 2", "'prompt'")
    assert not (tmp_path / "b").exists()


def test_a_run_on_a_prompt_file_resumes_exactly(tmp_path):
    from conftest import write_jsonl

    prompts = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{c}:", "char_class": c}
                                                     for c in ["digits", "lower", "upper", "digits", "lower"]])
    flags = ["--config", "tiny", "--prompts", prompts, "--num-prompts", 3, "--eval-every", 0, "--save-every", 1]
    assert cli("train.py", *flags, "--run-dir", tmp_path / "straight", "--iterations", 4).code == 0
    assert cli("train.py", *flags, "--run-dir", tmp_path / "resumed", "--iterations", 2).code == 0
    r = cli("train.py", *flags, "--run-dir", tmp_path / "resumed", "--iterations", 4, "--resume")
    assert r.code == 0, r.err
    assert_same_weights(tmp_path / "straight" / "policy", tmp_path / "resumed" / "policy")
    for i in range(4):       # iterations 2 and 3 cross the file's first pass (5 records, 3 per iteration)
        assert (tmp_path / "straight" / f"iter_{i:04d}" / "prompts.jsonl").read_text() == \
            (tmp_path / "resumed" / f"iter_{i:04d}" / "prompts.jsonl").read_text()


def test_trl_shaped_rewards_on_chat_prompts_in_a_run(tmp_path):
    """A run on chat prompts with TRL's two documented reward shapes: the records whose solution holds no
    number get None from accuracy_reward; with that reward alone their rows are skipped (advantage 0,
    counted in charts/skipped_rewards), with format_reward beside it they are not."""
    from conftest import write_jsonl

    records = [{"prompt": [{"role": "user", "content": f"{c}:"}], "solution": sol}
               for c, sol in [("digits", "7"), ("lower", "none"), ("upper", "3"), ("digits", "none")]]
    prompts = write_jsonl(tmp_path / "chat.jsonl", records)
    base = ["--config", "tiny", "--prompts", prompts, "--eval-prompts-file", prompts, "--iterations", 1,
            "--num-prompts", 4, "--eval-every", 0]
    r = cli("train.py", *base, "--run-dir", tmp_path / "acc", "--reward", "tests.rewards_for_tests:accuracy_reward")
    assert r.code == 0, r.err
    it = tmp_path / "acc" / "iter_0000"
    rewards, advantages = load_file(it / "rewards.safetensors"), load_file(it / "advantages.safetensors")
    samples = [json.loads(line) for line in open(it / "samples.jsonl")]
    no_number = torch.tensor([s["solution"] == "none" for s in samples])
    assert all(s["messages"] == [{"role": "user", "content": s["prompt"].split("user: ")[1].split("\n")[0]}]
               for s in samples)
    assert torch.equal(rewards["skipped"], no_number) and no_number.sum() == 16
    assert torch.equal(advantages["advantages"][no_number], torch.zeros(16))
    metrics = json.load(open(it / "metrics.json"))
    assert metrics["charts/skipped_rewards"] == 16
    r = cli("train.py", *base, "--run-dir", tmp_path / "both", "--reward", "tests.rewards_for_tests:accuracy_reward",
            "tests.rewards_for_tests:format_reward", "--reward-weights", 1, 0.5)
    assert r.code == 0, r.err
    assert "skipped" not in load_file(tmp_path / "both" / "iter_0000" / "rewards.safetensors")


def test_compare_runs_sees_a_changed_number_and_not_a_timing(tiny_run, tmp_path):
    """tests/compare_runs.py, the check that a refactoring changed no number: a copy of a run is the
    same; one tensor value moved by one ulp and one metric changed are differences; a timing is not."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import compare_runs

    run_dir, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    assert compare_runs.differences(run_dir, copy) == []
    metrics = json.loads((copy / "iter_0003" / "metrics.json").read_text())
    metrics["perf/iteration_s"] += 1.0
    (copy / "iter_0003" / "metrics.json").write_text(json.dumps(metrics))
    assert compare_runs.differences(run_dir, copy) == []
    metrics["charts/reward_mean"] += 1e-9
    (copy / "iter_0003" / "metrics.json").write_text(json.dumps(metrics))
    path = copy / "iter_0004" / "advantages.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["advantages"][0] = torch.nextafter(tensors["advantages"][0], torch.tensor(math.inf))
    save_file(tensors, str(path), metadata=meta)
    assert sorted(compare_runs.differences(run_dir, copy)) == [
        "iter_0003/metrics.json: differs ['charts/reward_mean']", "iter_0004/advantages.safetensors: tensor advantages differs"]
