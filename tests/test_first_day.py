"""A researcher's first day: every setting is checked before anything is touched, failed runs leave
nothing behind, a flag is honoured everywhere, and the outputs carry what a user looks for.

The cases, each a test below:
- silently wrong results: `--beta -1` and `--clip-eps -0.5` are errors; `--prompts FILE` without
  `--eval-prompts-file` holds out a seeded slice of FILE (said in the log and config.json), never
  another task's prompts; `--reward a --reward b` keeps both;
- a flag honoured in one place only: `--on-reward-error skip` in the held-out evaluation too, with
  the reward weights of training;
- late, messy or missing errors: a failed run leaves no run folder, so the corrected command runs
  as given, and a resume that fails to start leaves the run as it was; `--lr -1`, `--num-prompts
  0`, `--eval-prompts 0` with evaluation on, and `"group_size": "4"` in a --config-file are one line each; `--group-size
  1` with a group estimator is caught before any folder or model; a reward that takes a field the
  records lack is named before the first iteration; line numbers count from 1 in every message;
- what users look for: samples.jsonl carries each completion's reward, each function's reward and
  the advantage; the held-out evaluation shows progress; TensorBoard's samples show the user's
  question and every completion with its reward;
- every numeric setting of every stage and of train.py, out of its range, is one line naming the
  flag, with nothing written.
"""

import json
import os

import pytest
import torch
from conftest import ROOT, assert_user_error, cli, write_jsonl

import advantage
import sample
import score
import train
import update
from grpo.disk import run_log
from grpo.loop import configs, evaluation
from grpo.models import loading

STAGES = {"sample.py": (sample, ["--model", "m", "--prompts", "p"]),
          "score.py": (score, ["--rollouts", "r", "--samples", "s", "--reward", "char_class"]),
          "advantage.py": (advantage, ["--rewards", "r"]),
          "update.py": (update, ["--model", "m", "--rollouts", "r", "--advantages", "a"])}
# Numeric flags that take any value: seeds.
ANY_VALUE = {"seed"}


def outside(rule, kind):
    """A value outside the rule's range, of the flag's type."""
    if rule.lo is None and rule.hi is None:
        return "inf"
    if rule.hi is not None and kind is float:
        return str(rule.hi + 1)
    return str(rule.lo if rule.lo_open else rule.lo - 1)


def test_every_numeric_flag_of_every_stage_has_a_rule():
    for script, (stage, _) in STAGES.items():
        for action in stage.build_parser()._actions:
            if action.type in (int, float) and action.dest not in ANY_VALUE:
                assert action.dest in stage.RULES, (script, action.dest)
    run_flags = [a for a in configs.parser("", [])._actions if a.type in (int, float)]
    assert {a.dest for a in run_flags} - ANY_VALUE == set(configs.RULES)


@pytest.mark.parametrize("script", STAGES)
def test_a_stage_stops_on_any_setting_out_of_range_before_reading_or_writing(script, tmp_path):
    stage, required = STAGES[script]
    kinds = {a.dest: a.type for a in stage.build_parser()._actions}
    for name, rule in stage.RULES.items():
        flag = "--" + name.replace("_", "-")
        out = tmp_path / f"out_{name}"
        r = cli(script, *required, "--out", out, flag, outside(rule, kinds[name]))
        assert_user_error(r, flag, str(rule))
        assert not out.exists()


def test_a_run_stops_on_any_setting_out_of_range_before_its_folder_exists(tmp_path):
    checked = {**configs.RULES, **{name: rule for stage, _ in STAGES.values() for name, rule in stage.RULES.items()
                                if name in train.FLAGS}}
    kinds = {**{a.dest: a.type for a in configs.parser("", [])._actions},
             **{name: action.type for name, (action, _) in train.FLAGS.items()}}
    assert {"lr", "beta", "clip_eps", "num_prompts", "eval_prompts", "group_size"} <= set(checked)
    for name, rule in checked.items():
        flag = "--" + name.replace("_", "-")
        run_dir = tmp_path / name
        r = cli("train.py", "--config", "tiny", flag, outside(rule, kinds[name]), "--run-dir", run_dir)
        assert_user_error(r, flag)
        assert not run_dir.exists(), name
    for argv, fragment in [(["--beta", "-1"], "--beta must be ≥ 0, got -1"),
                           (["--clip-eps", "-0.5"], "--clip-eps must be in (0, 1], got -0.5"),
                           (["--lr", "-1"], "--lr must be in [0, 1], got -1"), (["--lr", "2"], "--lr must be in [0, 1], got 2"),
                           (["--num-prompts", "0"], "--num-prompts must be ≥ 1, got 0"),
                           (["--eval-prompts", "0"], "--eval-prompts 0 with --eval-every 10"),
                           (["--group-size", "1"], "--group-size 1: --estimator grpo compares")]:
        r = cli("train.py", "--config", "tiny", *argv, "--run-dir", tmp_path / "named")
        assert_user_error(r, fragment)
    assert not (tmp_path / "named").exists()


def test_a_config_file_value_of_the_wrong_type_is_named(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"group_size": "4"}))
    r = cli("train.py", "--config-file", path, "--run-dir", tmp_path / "r")
    assert_user_error(r, str(path), "'group_size' must be an integer, got '4'")
    path.write_text(json.dumps({"reward": "char_class"}))
    assert_user_error(cli("train.py", "--config-file", path, "--run-dir", tmp_path / "r"),
                      "'reward' must be a list of strings, got 'char_class'")
    path.write_text(json.dumps({"lr": 1, "model": "tiny", "task": "char_classes", "iterations": 1,
                                "eval_every": 0, "max_new_tokens": 4}))          # an int is a number
    assert cli("train.py", "--config-file", path, "--run-dir", tmp_path / "r").code == 0
    assert not os.path.exists(tmp_path / "never")


def test_repeated_rewards_append_and_a_weight_count_error_says_why(tmp_path):
    run_dir = tmp_path / "r"
    r = cli("train.py", "--config", "tiny", "--iterations", 1, "--eval-every", 0, "--run-dir", run_dir,
            "--reward", "char_class", "--reward", f"{ROOT}/tests/length_reward.py:char_count",
            "--reward-weights", 1, "--reward-weights", 0.01)
    assert r.code == 0, r.err
    row = json.loads(open(run_dir / "iter_0000" / "samples.jsonl").readline())
    assert set(row["rewards"]) == {"char_class", "char_count"}
    assert row["reward"] == pytest.approx(row["rewards"]["char_class"] + 0.01 * row["rewards"]["char_count"])
    r = cli("train.py", "--config", "tiny", "--run-dir", tmp_path / "w", "--reward", "char_class",
            "--reward", f"{ROOT}/tests/length_reward.py:char_count", "--reward-weights", 1)
    assert_user_error(r, "--reward-weights has 1 values for 2 --reward functions (char_class, ",
                      "one weight per function")


def chat_records(n, field="answer"):
    return [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"What is {i} plus 1?"}], field: str(i + 1)}
            for i in range(n)]


def test_a_prompt_file_alone_holds_out_a_seeded_slice_of_itself(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(20))
    run_dir = tmp_path / "r"
    r = cli("train.py", "--model", "tiny", "--prompts", prompts, "--reward", "exact_answer", "--iterations", 1,
            "--max-new-tokens", 4, "--eval-prompts", 5, "--run-dir", run_dir)
    assert r.code == 0, r.err
    assert f"held out 5 records of {prompts} for evaluation" in r.err
    lines = json.loads((run_dir / "config.json").read_text())["held_out"]["lines"]
    assert len(lines) == 5 and all(1 <= n <= 20 for n in lines)
    evaluated = [json.loads(row)["answer"] for row in open(run_dir / "eval" / "iter_0000.jsonl")]
    assert evaluated == [str(n) for n in lines]                 # record on line n asks for n − 1 plus 1
    trained = {json.loads(row)["answer"] for row in open(run_dir / "iter_0000" / "prompts.jsonl")}
    assert not trained & set(evaluated)
    r = cli("train.py", "--model", "tiny", "--prompts", prompts, "--eval-prompts", 20, "--run-dir", tmp_path / "x")
    assert_user_error(r, "would leave none to train on", "--eval-prompts-file")


def test_skip_is_honoured_in_the_held_out_evaluation_with_the_weights_of_training(tmp_path):
    records = chat_records(12)
    for record in records[::2]:
        record["solution"] = "oops"                 # the reward below raises on these rows
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    held_out = write_jsonl(tmp_path / "e.jsonl", [{**r, "split": "held-out"} for r in records])
    reward = tmp_path / "fragile.py"
    reward.write_text("def fragile(prompts, completions, solution, **kw):\n"
                      "    if any(s == 'oops' for s in solution):\n        raise ValueError('cannot read')\n"
                      "    return [1.0] * len(completions)\n")
    argv = ["--model", "tiny", "--prompts", prompts, "--eval-prompts-file", held_out, "--reward", f"{reward}:fragile",
            "--iterations", 1, "--max-new-tokens", 4, "--eval-prompts", 4]
    r = cli("train.py", *argv, "--run-dir", tmp_path / "fail")
    assert_user_error(r, "reward", "fragile", "raised ValueError: cannot read", "--on-reward-error skip")
    assert not (tmp_path / "fail").exists()                   # failed at iteration 0's evaluation: nothing left
    (tmp_path / "mine").mkdir()                               # a folder the user made for the run, empty
    assert_user_error(cli("train.py", *argv, "--run-dir", tmp_path / "mine"), "raised ValueError: cannot read")
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())   # kept, and as it was
    r = cli("train.py", *argv, "--on-reward-error", "skip", "--run-dir", tmp_path / "fail")
    assert r.code == 0, r.err                                 # the corrected command runs as given
    metrics = json.loads((tmp_path / "fail" / "iter_0000" / "metrics.json").read_text())
    assert metrics["eval/skipped_rewards"] == 4 and metrics["eval/reward_mean"] is None


def test_a_resume_that_fails_to_start_leaves_the_run_as_it_was(tmp_path):
    reward = tmp_path / "mine.py"
    reward.write_text("def mine(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    run_dir = tmp_path / "r"
    argv = ["--config", "tiny", "--reward", f"{reward}:mine", "--eval-every", 0, "--run-dir", run_dir]
    assert cli("train.py", *argv, "--iterations", 3).code == 0
    state = run_dir / "policy" / "train_state.json"
    state.write_text(json.dumps({"iteration": 2, "bad_steps": 0}))     # as if killed after saving at 2
    before = sorted(os.listdir(run_dir)), (run_dir / "iter_0002" / "metrics.json").read_text()
    reward.unlink()
    r = cli("train.py", *argv, "--iterations", 4, "--resume")
    assert_user_error(r, "mine.py")
    assert (sorted(os.listdir(run_dir)), (run_dir / "iter_0002" / "metrics.json").read_text()) == before


def test_a_reward_that_needs_a_field_the_records_lack_is_named_before_sampling(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(8, field="answer"))
    reward = tmp_path / "acc.py"
    reward.write_text("def accuracy(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n")
    r = cli("train.py", "--model", "tiny", "--prompts", prompts, "--reward", f"{reward}:accuracy",
            "--eval-every", 0, "--run-dir", tmp_path / "r")
    assert_user_error(r, "takes the field 'solution', which no record of", str(prompts),
                      "answer, completion_ids, group, messages")
    assert not (tmp_path / "r").exists()
    reward.write_text("def accuracy(completions, **kwargs):\n    return [float(s in c[0]['content']) "
                      "for c, s in zip(completions, kwargs.get('solution'))]\n")      # a field it reads itself
    r = cli("train.py", "--model", "tiny", "--prompts", prompts, "--reward", f"{reward}:accuracy",
            "--eval-every", 0, "--run-dir", tmp_path / "r")
    assert_user_error(r, "raised TypeError", "its fields: answer, completion_ids, group, messages")
    assert not (tmp_path / "r").exists()


def test_line_numbers_count_from_one(tmp_path, models):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": 3}\n')                    # the bad record is on line 3
    r = cli("train.py", "--config", "tiny", "--prompts", path, "--run-dir", tmp_path / "r")
    assert_user_error(r, f"{path}, line 3: needs 'prompt'")
    r = cli("sample.py", "--model", models["policy"], "--prompts", path, "--out", tmp_path / "o")
    assert_user_error(r, f"{path}, line 3: needs 'prompt'")
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert_user_error(cli("sample.py", "--model", models["policy"], "--prompts", path, "--out", tmp_path / "o"),
                      f"{path}, line 2: not valid JSON")


def test_samples_carry_rewards_and_advantages_after_an_iteration(tmp_path):
    run_dir = tmp_path / "r"
    assert cli("train.py", "--config", "tiny", "--iterations", 1, "--eval-every", 0, "--run-dir", run_dir).code == 0
    rows = [json.loads(line) for line in open(run_dir / "iter_0000" / "samples.jsonl")]
    from safetensors.torch import load_file

    rewards = load_file(run_dir / "iter_0000" / "rewards.safetensors")
    adv = load_file(run_dir / "iter_0000" / "advantages.safetensors")
    assert [r["reward"] for r in rows] == pytest.approx(rewards["rewards"].tolist())
    assert [r["rewards"]["char_class"] for r in rows] == pytest.approx(rewards["reward/char_class"].tolist())
    assert [r["advantage"] for r in rows] == pytest.approx(adv["advantages"].tolist())
    # score.py on that file (a replay) does not hand the stages' outputs to reward functions as fields
    seen = tmp_path / "seen.py"
    seen.write_text("import json\ndef fields(prompts, completions, **kw):\n"
                    f"    open({str(tmp_path / 'f.json')!r}, 'w').write(json.dumps(sorted(kw)))\n"
                    "    return [0.0] * len(completions)\n")
    r = cli("score.py", "--rollouts", run_dir / "iter_0000" / "rollouts.safetensors", "--samples",
            run_dir / "iter_0000" / "samples.jsonl", "--reward", f"{seen}:fields", "--out", tmp_path / "r.st")
    assert r.code == 0, r.err
    assert json.loads((tmp_path / "f.json").read_text()) == ["char_class", "completion_ids", "group"]


def test_the_held_out_evaluation_shows_progress(models, monkeypatch):
    ticks = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n = total, 0

        def update(self, k):
            self.n += k
            ticks.append(k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(evaluation, "tqdm", Bar)
    tok = loading.load_tokenizer(models["policy"])
    policy = loading.load_model(models["policy"], "cpu")
    records = [{"prompt": "1+1="}, {"prompt": "2+2="}, {"prompt": "3+3="}]
    score_fn = lambda rows, rollouts: (torch.zeros(len(rows)), {}, torch.zeros(len(rows), dtype=torch.bool))  # noqa: E731
    evaluation.greedy_answers(policy, tok, records, score_fn, max_new_tokens=5, micro_batch_size=2)
    assert sum(ticks) == 2 * 5 and ticks.count(1) >= 2                   # a tick per decoding step


def test_tensorboard_samples_show_the_users_question_and_every_completion_with_its_reward():
    rows = [{"group": g, "prompt": "<|im_start|>system ... <|im_start|>assistant\n", "completion": f"c{g}{k}",
             "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"question {g}"}],
             "reward": None if k == 1 else float(k)} for g in range(5) for k in range(2)]
    text = run_log.samples_text(rows, group_size=2)
    assert "question 0" in text and "question 3" in text and "question 4" not in text
    assert "<|im_start|>" not in text
    assert "reward 0.000: 'c00'" in text and "reward skipped: 'c01'" in text


def test_the_default_tasks_held_out_questions_do_not_depend_on_the_seed():
    """Runs of different seeds are compared on the same held-out questions (seed 0's draw, which the
    default job has always used), and no seed trains on them."""
    import random

    from grpo.rewards import tasks

    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(pairs)
    expected = [f"What is {a} plus {b}? Answer in one short sentence." for a, b in pairs[:48]]
    for seed in (0, 1, 7):
        train_records, held_out, _ = tasks.make_task("arithmetic", seed)
        assert [r["messages"][0]["content"] for r in held_out] == expected
        assert not {r["answer"] + r["messages"][0]["content"] for r in train_records} & {
            r["answer"] + r["messages"][0]["content"] for r in held_out}
    assert tasks.make_task("arithmetic", 0)[0][0]["messages"][0]["content"].endswith(
        f"{pairs[48][0]} plus {pairs[48][1]}? Answer in one short sentence.")     # seed 0's training order kept
    assert tasks.make_task("arithmetic", 1)[0][:5] != tasks.make_task("arithmetic", 0)[0][:5]
