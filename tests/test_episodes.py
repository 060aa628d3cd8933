"""Multi-turn episodes (sample.py --env): the ids the update reads are the ids the policy drew and the
environment's reply as tokenized once, turn by turn; the same seed plays the same episodes; the
update's recomputed log-probs are the sampler's on the policy's tokens; the built-in calculator; and
the tiny configuration learns to call a tool on a task it cannot solve without it."""

import json
import os

import pytest
import torch
from conftest import ROOT, assert_user_error, cli, write_jsonl

import sample
from grpo.disk import files
from grpo.loop import configs
from grpo.models import loading, modeling
from grpo.rewards import environments

ENVS = os.path.join(ROOT, "tests", "envs_for_tests.py")
PROMPTS = [{"prompt": "digits:", "char_class": "digits"},
           {"messages": [{"role": "user", "content": "hi"}], "char_class": "lower"}]


def play(models, tmp_path, name="out", seed=1, *flags):
    prompts = write_jsonl(tmp_path / "episodes.jsonl", PROMPTS)
    out = tmp_path / name
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts, "--out", out, "--group-size", 6,
            "--max-new-tokens", 60, "--env", f"{ENVS}:Scripted", "--max-turns", 3, "--seed", seed, *flags)
    assert r.code == 0, r.err
    tensors, _, _ = files.load_tensors(str(out / "rollouts.safetensors"), files.ROLLOUTS)
    return tensors, files.read_jsonl(str(out / "samples.jsonl"))


def test_the_trainers_ids_are_the_policys_and_the_environments_as_tokenized_once(models, tmp_path):
    tensors, samples = play(models, tmp_path)
    tokenizer = loading.load_tokenizer(models["policy"])
    eos = [tokenizer.eos_token_id]
    three = 0
    for b, s in enumerate(samples):
        ids, policy = [], []                  # what the environment saw and said, laid end to end
        for k, turn in enumerate(s["seen"]):
            ids += turn
            policy += [True] * len(turn)
            if 2 * k + 1 < len(s["turns"]):      # the reply to turn k, tokenized once
                eos_text = tokenizer.decode(turn[-1:]) if turn[-1] in eos else ""
                text = environments.reply_text(tokenizer, "messages" in s, "user", f"ok{k + 1}", eos_text)
                reply = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += reply
                policy += [False] * len(reply)
        mask = tensors["completion_mask"][b]
        # An episode the budget cut ends with a turn the environment was never given: the policy's.
        rest = int(mask.sum()) - len(ids)
        assert tensors["completion_ids"][b][mask].tolist()[:len(ids)] == ids
        assert tensors["loss_mask"][b][mask].tolist() == policy + [True] * rest
        assert rest == 0 or bool(tensors["truncated"][b])
        assert [t["content"] for t in s["turns"][::2]][:len(s["seen"])] == [
            tokenizer.decode(t, skip_special_tokens=True) for t in s["seen"]]
        three += len(s["seen"]) == 3
        assert bool(tensors["truncated"][b]) == (len(s["seen"]) < 3)     # only a full episode ends itself
    assert three >= 3, "too few rows played all three turns to test anything"
    assert (tensors["old_logprobs"][~tensors["loss_mask"]] == 0).all()


def test_a_seed_plays_the_same_episodes(models, tmp_path):
    a, sa = play(models, tmp_path, "a", 1)
    b, sb = play(models, tmp_path, "b", 1)
    _, sc = play(models, tmp_path, "c", 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and sa == sb
    assert [s["turns"] for s in sa] != [s["turns"] for s in sc]            # the seed does draw them


def test_the_updates_recomputed_logprobs_are_the_samplers_on_the_policys_tokens(models, tmp_path):
    tensors, _ = play(models, tmp_path, "out", 1, "--top-k", 20)
    policy = loading.load_model(models["policy"], "cpu")
    recomputed = modeling.rollout_logprobs(policy, tensors, 1.0, 0, True)                 # [N, T]
    mask = tensors["loss_mask"]
    assert mask.sum() > 100 and (~mask & tensors["completion_mask"]).sum() > 20
    torch.testing.assert_close(recomputed[mask], tensors["old_logprobs"][mask], atol=2e-5, rtol=0)
    assert (tensors["sampler_logprobs"][~mask] == 0).all() and (tensors["sampler_logprobs"][mask] < 0).any()


def scripted_turns(turns):
    """sample_episodes' sample_turn for hand-made turns: the k-th call gives each live row turns[k][row],
    a list of ids whose last is 9 when the turn ended (EOS id 9), cut at the row's room as the sampler
    cuts it; `calls` keeps the rooms each call was given."""
    calls = []

    def sample_turn(ids, mask, rooms):
        calls.append(rooms.tolist())
        rows = [r[:room] for r, room in zip(turns[len(calls) - 1], rooms.tolist())]
        T = max(len(r) for r in rows)
        return {"completion_ids": torch.tensor([r + [0] * (T - len(r)) for r in rows]),
                "completion_mask": torch.tensor([[True] * len(r) + [False] * (T - len(r)) for r in rows]),
                "old_logprobs": torch.tensor([[-0.5] * T] * len(rows)),
                "truncated": torch.tensor([r[-1] != 9 for r in rows])}
    return sample_turn, calls


class Echo:
    """Replies "ab" (two ids of the tokenizer below) to every turn; `role` None writes it in-line."""

    def __init__(self, role="user"):
        self.role, self.texts = role, []

    def reset(self, record):
        pass

    def step(self, text, token_ids):
        self.texts.append(text)
        return "ab"


class Tokens:
    pad_token_id, chat_template = 0, None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(ch) for ch in text]}


def test_an_episode_ends_by_its_environment_its_budget_or_its_turns_by_hand():
    prompt_ids, prompt_mask = torch.tensor([[5], [5], [5]]), torch.tensor([[True], [True], [True]])
    # Row 0 ends its turns with EOS (9) and runs out of turns; row 1 runs out of the budget of 10 in its
    # second turn (the sampler stops it at its room, 5); row 2's second reply would leave no room.
    turns = [[[1, 9], [2, 3, 9], [4, 4, 4, 9]], [[1, 9], [2] * 7, [6, 9]], [[1, 9]]]
    sample_turn, budgets = scripted_turns(turns)
    columns, histories = environments.sample_episodes(prompt_ids, prompt_mask, [Echo(), Echo(), Echo()],
                                                [False] * 3, Tokens(), [9], 10, 3, sample_turn)
    a, b = ord("a"), ord("b")
    assert budgets == [[10, 10, 10], [6, 5, 4], [2]]      # each live row's room of the budget
    assert columns["completion_ids"].tolist() == [[1, 9, a, b, 1, 9, a, b, 1, 9],
                                                 [2, 3, 9, a, b, 2, 2, 2, 2, 2],
                                                 [4, 4, 4, 9, a, b, 6, 9, 0, 0]]
    assert columns["loss_mask"].int().tolist() == [[1, 1, 0, 0, 1, 1, 0, 0, 1, 1],
                                                   [1, 1, 1, 0, 0, 1, 1, 1, 1, 1],
                                                   [1, 1, 1, 1, 0, 0, 1, 1, 0, 0]]
    assert columns["completion_mask"].sum(-1).tolist() == [10, 10, 8]
    # Row 0: its third turn's reply is dropped (no fourth turn); row 1: cut by the budget; row 2: its
    # reply would leave no room for a turn.
    assert columns["truncated"].tolist() == [True, True, True]
    assert [len(h) for h in histories] == [5, 3, 3]
    assert histories[0][1] == {"role": "user", "content": "ab"}
    assert (columns["old_logprobs"][columns["loss_mask"]] == -0.5).all()
    assert (columns["old_logprobs"][~columns["loss_mask"]] == 0).all()


@pytest.mark.parametrize("expression, value", [("347*58", "20126"), ("(12 + 3) * -2", "-30"), ("7/2", "3.5"),
                                               ("1/3", "0.333333"), ("1,234 × 2", "2468"), ("2.5*4", "10"),
                                               ("-2/3", "-0.666667"), ("100000000000000000000/3",
                                               "33333333333333333333.333333"), ("0.0000004", "0")])
def test_the_calculator_by_hand(expression, value):
    assert environments.calculate(expression) == value


@pytest.mark.parametrize("expression", ["2**400", "__import__('os')", "x + 1", "1/0", "9" * 101, "[1]",
                                        "1 if 1 else 2", "1e999", "1e308*100/3", "0x10", "1_000", "2 ^ 3"])
def test_the_calculator_evaluates_nothing_but_arithmetic(expression):
    with pytest.raises(environments.ToolError):
        environments.calculate(expression)


def test_the_tool_helper_answers_the_first_call_and_ends_on_a_turn_without_one():
    env = environments.Calculator()
    env.reset({"answer": "20126"})
    assert env.stop == ["</calc>"]
    assert env.step("Let me compute <calc>347 * 58</calc>", [1, 2]) == "<result>20126</result>"
    assert env.step("<calc>2**9</calc> and <calc>1+1</calc>", [3]) == \
        "<result>error: only numbers, + - * / and parentheses</result>"
    assert env.step("The answer is 20126.", [4]) is None
    assert env.fields() == {"tool_calls": 2}


def test_a_reply_in_a_chat_is_the_templates_text_between_two_assistant_turns():
    from grpo.models import builders

    tokenizer = builders.char_tokenizer()                     # "{role}: {content}\n" per message
    assert environments.reply_text(tokenizer, True, "user", "7", "") == "\nuser: 7\nassistant: "
    assert environments.reply_text(tokenizer, False, "user", "7", "") == "7"     # a string prompt
    # A template whose assistant turn ends with the EOS the policy wrote: the EOS is not written twice.
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}<eos>{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    assert environments.reply_text(tokenizer, True, "tool", "7", "<eos>") == "<s>tool\n7<eos><s>assistant\n"
    assert environments.reply_text(tokenizer, True, "tool", "7", "") == "<eos><s>tool\n7<eos><s>assistant\n"


def test_an_in_line_environment_writes_into_the_policys_message():
    prompt_ids, prompt_mask = torch.tensor([[5]]), torch.tensor([[True]])
    env = Echo(role=None)
    sample_turn, _ = scripted_turns([[[1, 9]], [[2, 9]], [[3, 9]]])
    columns, histories = environments.sample_episodes(prompt_ids, prompt_mask, [env], [True], Tokens(), [9], 20, 3,
                                                      sample_turn)
    a, b = ord("a"), ord("b")
    assert columns["completion_ids"].tolist() == [[1, 9, a, b, 2, 9, a, b, 3, 9]]
    assert columns["loss_mask"].int().tolist() == [[1, 1, 0, 0, 1, 1, 0, 0, 1, 1]]
    assert histories == [[{"role": "assistant", "content": "1 9ab2 9ab3 9"}]]      # one message, no template
    assert env.texts == ["1 9", "2 9", "3 9"]


def byte_tokenizer():
    """A byte-level BPE without merges: one token a byte, so "÷" is two tokens, as in SmolLM2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.mark.parametrize("text, stop", [("3 ÷", "÷"), ("x = 1 </calc>", "</calc>"), ("a =", "="), ("a =(", "=")])
def test_a_turn_ends_at_the_token_that_completes_a_stop_string(text, stop):
    tokenizer = byte_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ends = environments.turn_ends(tokenizer, [stop, "</never>"])
    drawn = [torch.tensor([i]) for i in ids]
    fired = [bool(ends(drawn[:k], torch.tensor([99]))) for k in range(1, len(ids) + 1)]
    complete = [stop in tokenizer.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    assert fired == complete and any(fired)
    assert bool(ends(drawn[:2], torch.tensor([2]))) and not environments.turn_ends(tokenizer, [])(
        drawn[:1], torch.tensor([2]))                                         # its room ends a row too
    assert environments.up_to_stop(text, [stop, "</never>"]) == text[:text.index(stop) + len(stop)]


def test_episode_metrics_average_each_number_the_environment_gives():
    from grpo.loop import diagnostics
    rows = [{"prompt": "p", "secret": 3, "turns": [{"role": "assistant"}, {"role": "user"}, {"role": "assistant"}],
             "guesses": 2, "solved": True},
            {"prompt": "p", "secret": 3, "turns": [{"role": "assistant"}], "guesses": None, "solved": False}]
    assert diagnostics.episode_metrics(rows, [{"prompt": "p", "secret": 3}]) == {
        "env/policy_turns": 1.5, "env/guesses": 2.0, "env/solved": 0.5}
    assert diagnostics.episode_metrics([{"prompt": "p", "completion": "c"}], []) == {}


def test_score_passes_the_turns_and_the_environments_fields_to_rewards(models, tmp_path):
    _, samples = play(models, tmp_path)
    r = cli("score.py", "--rollouts", tmp_path / "out" / "rollouts.safetensors", "--samples",
            tmp_path / "out" / "samples.jsonl", "--reward", f"{ROOT}/tests/rewards_for_tests.py:turns_and_seen",
            "--out", tmp_path / "rewards.safetensors")
    assert r.code == 0, r.err
    rewards, _, _ = files.load_tensors(str(tmp_path / "rewards.safetensors"), files.REWARDS)
    assert rewards["rewards"].tolist() == [float(len(s["turns"]) * 10 + len(s["seen"])) for s in samples]


@pytest.mark.parametrize("flags, fragment", [
    (["--env", "calculator", "--engine", "vllm"], "--env runs episodes with the project's sampler"),
    (["--env", "abacus"], "--env 'abacus': unknown environment"),
    (["--env", f"{ENVS}:Missing"], "has no class or function 'Missing'"),
    (["--env", f"{ENVS}:NoStep"], "without step()"),
    (["--env", "calculator", "--max-turns", "0"], "--max-turns"),
])
def test_a_bad_environment_stops_in_one_line_before_anything_is_written(models, tmp_path, flags, fragment):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts, "--out", tmp_path / "out", *flags)
    assert_user_error(r, fragment)
    assert not (tmp_path / "out").exists()


def test_an_environments_field_may_not_take_a_records_name(models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts, "--out", tmp_path / "out",
            "--env", f"{ENVS}:TakesAName", "--max-new-tokens", 4)
    assert_user_error(r, "'char_class'", "rename them")
    assert not (tmp_path / "out" / "rollouts.safetensors").exists()


def test_the_tiny_configuration_learns_to_call_a_tool_it_cannot_answer_without(tmp_path):
    """The tiny task with its class hidden: the reply to a turn ending in '?' names it, and only an answer
    after it scores. The random model ends ~14% of its first turns with '?'; the run must call in most.
    (Rewarding the answer whatever came before, the tiny model learns to write letters and digits first,
    which makes '?' rarer: its calls fell from 14% to 0 by iteration 19 at seed 0.)"""
    import random
    rng = random.Random(0)
    classes = [rng.choice(["digits", "lower", "upper"]) for _ in range(200)]
    prompts = write_jsonl(tmp_path / "hidden.jsonl", [{"prompt": "class:", "char_class": c} for c in classes])
    run = tmp_path / "run"
    r = cli("train.py", "--config", "tiny", "--run-dir", run, "--prompts", prompts, "--env", f"{ENVS}:Hint",
            "--reward", f"{ENVS}:hinted_class", "--max-turns", 2, "--max-new-tokens", 16, "--iterations", 20,
            "--eval-every", 0)
    assert r.code == 0, r.err

    def calls(i):
        rows = files.read_jsonl(str(run / f"iter_{i:04d}" / "samples.jsonl"))
        return sum(s["tool_calls"] > 0 for s in rows) / len(rows), sum(s["reward"] for s in rows) / len(rows)
    (first_calls, first_reward), last = calls(0), [calls(i) for i in range(16, 20)]
    assert first_calls < 0.3                                   # 0.14 at seed 0
    assert sum(c for c, _ in last) / 4 > 0.6                   # 0.84 (iterations 16 to 19)
    assert sum(r for _, r in last) / 4 > 2 * first_reward      # 0.18 against 0.013


def test_a_run_loads_its_environment_file_once(tmp_path):
    """train.py checks --env SPEC before anything is written and samples with it at every iteration and
    evaluation: the file is imported once in the process, and one environment made for the check."""
    log = tmp_path / "imports.log"
    env_file = tmp_path / "counting_env.py"
    env_file.write_text(f"open({str(log)!r}, 'a').write('import\\n')\n"
                        f"from envs_for_tests import Hint\n\n\n"
                        f"class Counted(Hint):\n"
                        f"    def __init__(self):\n"
                        f"        open({str(log)!r}, 'a').write('env\\n')\n")
    prompts = write_jsonl(tmp_path / "hidden.jsonl", [{"prompt": "class:", "char_class": "digits"}] * 8)
    r = cli("train.py", "--config", "tiny", "--run-dir", tmp_path / "run", "--prompts", prompts, "--env",
            f"{env_file}:Counted", "--reward", f"{ENVS}:hinted_class", "--max-turns", 2, "--max-new-tokens", 8,
            "--iterations", 2, "--num-prompts", 2, "--group-size", 4, "--eval-every", 0)
    assert r.code == 0, r.err
    lines = log.read_text().splitlines()
    # One import, one environment for the contract's check and one for the reward's field names, then 8 per
    # iteration (2 prompts × G = 4).
    assert lines.count("import") == 1 and lines.count("env") == 2 + 2 * 8, lines


def test_an_edited_environment_file_is_loaded_anew_and_a_run_stores_its_absolute_path(tmp_path, monkeypatch):
    env_file = tmp_path / "edited_env.py"
    env_file.write_text("class Env:\n    word = 'first'\n    def reset(self, record): pass\n"
                        "    def step(self, text, token_ids): return None\n")
    monkeypatch.chdir(tmp_path)
    first = environments.load_env("edited_env.py:Env")[1]
    assert environments.load_env("edited_env.py:Env")[1] is first            # cached while the file is as it was
    env_file.write_text(env_file.read_text().replace("'first'", "'second'"))
    os.utime(env_file, (1, os.stat(env_file).st_mtime + 10))
    assert environments.load_env("edited_env.py:Env")[1].word == "second"
    assert configs.absolute_paths({"env": "edited_env.py:Env"})["env"] == f"{env_file}:Env"
    assert configs.absolute_paths({"env": "calculator"})["env"] == "calculator"


def test_the_example_environment_plays_its_game_by_hand():
    import importlib.util
    spec = importlib.util.spec_from_file_location("guess_number", os.path.join(ROOT, "examples", "guess_number.py"))
    guess = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guess)
    env = guess.GuessNumber()
    env.reset({"secret": 37})
    assert [env.step("Is it 50?", []), env.step("no idea", []), env.step("25", []), env.step("37!", [])] == \
        ["lower", "Reply with one number.", "higher", None]
    assert env.fields() == {"guesses": 3, "solved": True}
    assert guess.solved(None, [None, None], guesses=[3, 1], solved=[True, False]) == [0.8, 0.0]
    docs = open(os.path.join(ROOT, "docs", "environments.md")).read()
    assert "class GuessNumber:" in docs and "(38 lines with its reward)" in docs
    assert len(open(os.path.join(ROOT, "examples", "guess_number.py")).read().splitlines()) == 38


def test_episodes_with_and_without_prefix_sharing_are_the_same(models, tmp_path):
    """The prompt of a group is prefilled once for its rows in the first turn (micro-batches of 5 cut the
    groups of 6); without sharing, the same episodes and log-probs within 1e-5."""
    shared, s_samples = play(models, tmp_path, "shared", 1, "--micro-batch-size", 5)
    plain, p_samples = play(models, tmp_path, "plain", 1, "--micro-batch-size", 5, "--no-prefix-sharing")
    for key in ("completion_ids", "completion_mask", "loss_mask", "truncated"):
        assert torch.equal(shared[key], plain[key]), key
    torch.testing.assert_close(shared["old_logprobs"], plain["old_logprobs"], atol=1e-5, rtol=0)
    assert s_samples == p_samples and (~shared["loss_mask"] & shared["completion_mask"]).any()
