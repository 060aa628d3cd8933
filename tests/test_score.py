"""score.py and the built-in rule reward: exact answers, user functions, a reward model, weights, errors."""

import json
import os

import pytest
import torch
from conftest import assert_user_error, cli, write_jsonl
from safetensors.torch import load_file

from grpo.disk import checkpoints
from grpo.models import builders
from grpo.rewards import tasks


@pytest.mark.parametrize("completion, answer, reward", [
    ("The sum is 5.", "5", 1.0),
    ("2 + 3 = 5", "5", 1.0),                 # the last number counts
    ("5, no wait, 6", "5", 0.0),
    ("It is 05.0", "5", 1.0),                # canonical comparison, not string equality
    ("The total is 1,234.", "1234", 1.0),    # thousands separators
    ("1,2,3", "3", 1.0),                     # a list is not one number
    ("-3", "-3", 1.0),
    ("3", "-3", 0.0),
    ("no number here", "5", 0.0),
    ("17", None, None),                      # a record without an answer: the reward does not apply (as math)
    ("1" * 100_000, "1" * 100_000, 1.0),     # long numbers compare as strings, no int() conversion
])
def test_exact_answer(completion, answer, reward):
    assert tasks.exact_answer(["q"], [completion], answer=[answer]) == [reward]


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_builtin_user_functions_and_weights(rollout_dir, tmp_path, monkeypatch):
    samples = rows(rollout_dir / "samples.jsonl")
    # Make some completions right, so exact_answer is not all zeros.
    for s in samples[::3]:
        s["completion"] = f"so the answer is {s['answer']}"
    samples_file = tmp_path / "samples.jsonl"
    samples_file.write_text("".join(json.dumps(s) + "\n" for s in samples))
    (tmp_path / "length_reward_mod.py").write_text(
        "def length(prompts, completions, completion_ids, group, **fields):\n"
        "    return [len(ids) / 10 + g for ids, g in zip(completion_ids, group)]\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rewards_file.py").write_text(
        "def has_answer_field(prompts, completions, answer, **fields):\n"
        "    return [float(len(a)) for a in answer]\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rewards.safetensors"
    r = cli("score.py", "--rollouts", rollout_dir / "rollouts.safetensors", "--samples", samples_file,
            "--reward", "exact_answer", "length_reward_mod:length", "--reward", "sub/rewards_file.py:has_answer_field",
            "--reward-weights", 2.0, 0.5, -1.0, "--out", out, "--allow-mismatch")   # completions edited above
    assert r.code == 0, r.err
    got = load_file(out)
    assert set(got) == {"rewards", "group_ids", "reward/exact_answer", "reward/length", "reward/has_answer_field",
                        "lengths"}
    rollouts = load_file(rollout_dir / "rollouts.safetensors")
    assert torch.equal(got["lengths"], rollouts["completion_mask"].sum(-1))
    rollouts = load_file(rollout_dir / "rollouts.safetensors")
    assert torch.equal(got["group_ids"], rollouts["group_ids"])
    exact = torch.tensor([float(i % 3 == 0) for i in range(16)])
    length = rollouts["completion_mask"].sum(1) / 10 + rollouts["group_ids"]
    answer_len = torch.tensor([float(len(s["answer"])) for s in samples])
    torch.testing.assert_close(got["reward/exact_answer"], exact)
    torch.testing.assert_close(got["reward/length"], length.float())
    torch.testing.assert_close(got["rewards"], 2.0 * exact + 0.5 * length.float() - answer_len)
    assert got["rewards"].dtype == torch.float32


def test_reward_model_folder(rollout_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = builders.char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    rm_dir = tmp_path / "my_rm"
    checkpoints.save_checkpoint(LlamaForSequenceClassification(config), tok, str(rm_dir))
    out = tmp_path / "rewards.safetensors"
    r = cli("score.py", "--rollouts", rollout_dir / "rollouts.safetensors", "--samples",
            rollout_dir / "samples.jsonl", "--reward", rm_dir, "--out", out, "--micro-batch-size", 5)
    assert r.code == 0, r.err
    got = load_file(out)["reward/my_rm"]
    # Each row scored alone, with no padding: the batched, padded scores must agree.
    model = LlamaForSequenceClassification.from_pretrained(rm_dir).eval()
    samples = rows(rollout_dir / "samples.jsonl")
    for i, s in enumerate(samples):
        if "messages" in s:
            text = tok.apply_chat_template(s["messages"] + [{"role": "assistant", "content": s["completion"]}],
                                           tokenize=False)
        else:
            text = s["prompt"] + s["completion"]
        with torch.no_grad():
            expected = model(**tok(text, return_tensors="pt")).logits[0, 0]
        assert got[i].item() == pytest.approx(expected.item(), abs=1e-4), i
    assert got.std() > 0


def test_reward_errors(rollout_dir, tmp_path, monkeypatch):
    (tmp_path / "bad_rewards_mod.py").write_text(
        "def boom(prompts, completions, **k):\n    raise ValueError('cannot parse')\n"
        "def short(prompts, completions, **k):\n    return [1.0]\n"
        "def nans(prompts, completions, **k):\n    return [float('nan') if i in (1, 7) else 1.0 for i in range(len(completions))]\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rewards.safetensors"
    base = ["--rollouts", rollout_dir / "rollouts.safetensors", "--samples", rollout_dir / "samples.jsonl", "--out", out]
    assert_user_error(cli("score.py", *base, "--reward", "no_such_reward"), "no_such_reward", "unknown reward")
    assert_user_error(cli("score.py", *base, "--reward", "bad_rewards_mod:boom"), "boom", "ValueError", "cannot parse")
    assert_user_error(cli("score.py", *base, "--reward", "bad_rewards_mod:short"), "short", "1 values", "16")
    assert_user_error(cli("score.py", *base, "--reward", "bad_rewards_mod:nans"), "nans", "rows 1, 7")
    assert_user_error(cli("score.py", *base, "--reward", "bad_rewards_mod:missing"), "no function 'missing'")
    assert_user_error(cli("score.py", *base, "--reward", "nofile.py:f"), "nofile.py")
    assert_user_error(cli("score.py", *base, "--reward", "exact_answer", "--reward-weights", 1, 2), "--reward-weights")
    half = tmp_path / "half.jsonl"
    half.write_text("".join(open(rollout_dir / "samples.jsonl").readlines()[:8]))
    assert_user_error(cli("score.py", "--rollouts", rollout_dir / "rollouts.safetensors", "--samples", half,
                          "--out", out, "--reward", "exact_answer"), "half.jsonl", "8 rows", "16")
    assert not out.exists()


def test_minimal_hand_written_rollouts(rollout_dir, tmp_path):
    # score.py needs only group_ids from the rollouts; a file written by hand with just that works.
    from safetensors.torch import save_file

    minimal = tmp_path / "minimal.safetensors"
    save_file({"group_ids": torch.arange(4).repeat_interleave(4)}, str(minimal))
    out = tmp_path / "rewards.safetensors"
    r = cli("score.py", "--rollouts", minimal, "--samples", rollout_dir / "samples.jsonl",
            "--reward", "exact_answer", "--out", out)
    assert r.code == 0, r.err
    assert load_file(out)["rewards"].shape == (16,)


def test_trl_reward_functions_on_conversational_rows(tmp_path, monkeypatch):
    """TRL's documented accuracy and format rewards (tests/rewards_for_tests.py) on chat rows written by
    hand: completions come as [{"role": "assistant", ...}], the weighted sum uses the rewards that apply
    (TRL's nansum), and a row to which none applies is skipped."""
    monkeypatch.chdir(os.path.dirname(os.path.dirname(__file__)))
    from safetensors.torch import save_file

    rollouts = tmp_path / "rollouts.safetensors"
    save_file({"group_ids": torch.arange(2).repeat_interleave(4)}, str(rollouts))
    chat = [{"role": "user", "content": "What is 5 + 7?"}]
    solutions = ["The answer is 12", "(no number)"]
    completions = ["12.", "13", "x", "It is 12", "5.", "a", "7.", "b"]
    write_jsonl(tmp_path / "samples.jsonl", [
        {"group": i // 4, "prompt": "user: What is 5 + 7?\n", "completion": c, "messages": chat,
         "solution": solutions[i // 4]} for i, c in enumerate(completions)])
    out = tmp_path / "rewards.safetensors"
    base = ["--rollouts", rollouts, "--samples", tmp_path / "samples.jsonl", "--out", out]
    r = cli("score.py", *base, "--reward", "tests.rewards_for_tests:accuracy_reward",
            "tests.rewards_for_tests:format_reward", "--reward-weights", 1.0, 0.5)
    assert r.code == 0, r.err
    got = load_file(out)
    nan = float("nan")
    torch.testing.assert_close(got["reward/accuracy_reward"], torch.tensor([1.0, 0, 0, 1] + [nan] * 4),
                               equal_nan=True)
    assert got["reward/format_reward"].tolist() == [1, 0, 0, 0, 1, 0, 1, 0]
    assert got["rewards"].tolist() == [1.5, 0, 0, 1, 0.5, 0, 0.5, 0]
    assert "skipped" not in got
    r = cli("score.py", *base, "--reward", "tests.rewards_for_tests:accuracy_reward")
    assert r.code == 0, r.err
    got = load_file(out)
    assert got["skipped"].tolist() == [False] * 4 + [True] * 4
    assert got["rewards"].tolist() == [1, 0, 0, 1, 0, 0, 0, 0]
    assert cli("advantage.py", "--rewards", out, "--out", tmp_path / "a.safetensors").code == 0
    A = load_file(tmp_path / "a.safetensors")["advantages"]
    assert A[4:].tolist() == [0.0] * 4 and A[:4].sum().abs() < 1e-6 and A[0] > 0 > A[1]


def test_chat_rows_reach_rewards_as_trl_passes_them(rollout_dir, tmp_path, monkeypatch):
    """In rollout_dir, group 2's record is a chat ("messages"); the others are strings."""
    (tmp_path / "shapes_mod.py").write_text(
        "def shapes(prompts, completions, messages=None, **k):\n"
        "    out = []\n"
        "    for p, c, m in zip(prompts, completions, messages):\n"
        "        if isinstance(c, str):\n"
        "            out.append(0.0 if isinstance(p, str) and m is None else -1.0)\n"
        "        else:\n"
        "            ok = p == m and len(c) == 1 and c[0]['role'] == 'assistant' and isinstance(c[0]['content'], str)\n"
        "            out.append(1.0 if ok else -1.0)\n"
        "    return out\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.safetensors"
    r = cli("score.py", "--rollouts", rollout_dir / "rollouts.safetensors", "--samples",
            rollout_dir / "samples.jsonl", "--reward", "shapes_mod:shapes", "--out", out)
    assert r.code == 0, r.err
    assert load_file(out)["rewards"].tolist() == [0.0] * 8 + [1.0] * 4 + [0.0] * 4


def test_a_reward_may_return_a_numpy_array_or_a_tensor():
    import numpy as np

    import score

    for values in (np.array([1.0, 0.5]), torch.tensor([1.0, 0.5])):
        r, bad = score.call_reward("f", lambda prompts, completions, **k: values, ["a", "b"], ["x", "y"], {})
        assert r.tolist() == [1.0, 0.5] and not bad.any()
