"""sample.py: the rollouts contract, log-probs against an unpadded recomputation, masks, seeds, errors."""

import json
import os

import torch
from conftest import PROMPTS, assert_user_error, cli, write_jsonl
from safetensors import safe_open
from safetensors.torch import load_file

from grpo.models import builders, loading


def test_rollouts_contract(rollout_dir):
    r = load_file(rollout_dir / "rollouts.safetensors")
    N = 16
    expected = {"prompt_ids": torch.int64, "prompt_mask": torch.bool, "completion_ids": torch.int64,
                "completion_mask": torch.bool, "group_ids": torch.int64, "old_logprobs": torch.float32,
                "ref_logprobs": torch.float32, "truncated": torch.bool}
    assert set(r) == set(expected)
    for key, dtype in expected.items():
        assert r[key].dtype == dtype, key
        assert r[key].shape[0] == N, key
    T = r["completion_ids"].shape[1]
    assert T <= 40 and r["old_logprobs"].shape == (N, T)
    assert r["group_ids"].tolist() == [g for g in range(4) for _ in range(4)]
    # Left padding: the last prompt column is real for every row, padding only on the left.
    pm = r["prompt_mask"]
    assert pm[:, -1].all()
    assert torch.equal(pm, pm.long().cummax(1).values.bool())
    # Rows of a group share the prompt.
    assert torch.equal(r["prompt_ids"][0], r["prompt_ids"][3])
    with safe_open(rollout_dir / "rollouts.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["schema"] == "rollouts/1"
    args = json.loads(meta["args"])
    assert args["group_size"] == 4 and args["temperature"] == 0.7 and args["max_new_tokens"] == 40


def test_masks_end_at_the_first_eos(models, rollout_dir):
    r = load_file(rollout_dir / "rollouts.safetensors")
    eos = loading.load_tokenizer(models["policy"]).eos_token_id
    pad = loading.load_tokenizer(models["policy"]).pad_token_id
    ended = 0
    for ids, mask, truncated in zip(r["completion_ids"], r["completion_mask"], r["truncated"]):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()        # a prefix
        assert (ids[length:] == pad).all()
        eos_at = (ids[:length] == eos).nonzero().flatten().tolist()
        if truncated:
            assert eos_at == [] and length == 40
        else:
            assert eos_at == [length - 1]                             # the first EOS, and it is included
            ended += 1
    assert 0 < ended < len(r["truncated"])                            # the test saw both kinds of row
    assert (r["old_logprobs"][~r["completion_mask"]] == 0).all()
    assert (r["ref_logprobs"][~r["completion_mask"]] == 0).all()


def test_pad_token_sampled_before_eos_stays_in_the_mask(models, rollout_dir):
    # The tiny model samples <pad> as an ordinary token now and then. A mask derived from the pad
    # id would be false there; the contract says it is true up to the first EOS.
    r = load_file(rollout_dir / "rollouts.safetensors")
    tok = loading.load_tokenizer(models["policy"])
    assert tok.pad_token_id != tok.eos_token_id
    sampled_pad = (r["completion_ids"] == tok.pad_token_id) & r["completion_mask"]
    assert sampled_pad.any(), "pick a seed under which <pad> is sampled inside a completion"
    row, col = sampled_pad.nonzero()[0].tolist()
    assert r["completion_mask"][row, :col + 1].all() and col + 1 < r["completion_mask"][row].sum()


def test_logprobs_match_unpadded_row_by_row_recomputation(models, rollout_dir):
    r = load_file(rollout_dir / "rollouts.safetensors")
    assert r["prompt_mask"].sum(1).unique().numel() > 1                 # prompts of several lengths: padding
    for key, model_dir in (("old_logprobs", models["policy"]), ("ref_logprobs", models["ref"])):
        model = loading.load_model(model_dir, "cpu")
        for i in range(r["group_ids"].numel()):
            prompt = r["prompt_ids"][i][r["prompt_mask"][i]][None]
            completion = r["completion_ids"][i][r["completion_mask"][i]][None]
            with torch.no_grad():
                logits = model(torch.cat([prompt, completion], 1)).logits[0, prompt.shape[1] - 1:-1]
            expected = torch.log_softmax(logits / 0.7, -1).gather(-1, completion[0, :, None]).squeeze(-1)
            got = r[key][i][r["completion_mask"][i]]
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=0, msg=f"{key} row {i}")


def test_samples_jsonl(models, rollout_dir):
    rows = [json.loads(line) for line in open(rollout_dir / "samples.jsonl")]
    assert len(rows) == 16
    tok = loading.load_tokenizer(models["policy"])
    r = load_file(rollout_dir / "rollouts.safetensors")
    for i, row in enumerate(rows):
        g = i // 4
        assert row["group"] == g and row["answer"] == PROMPTS[g]["answer"] and row["id"] == PROMPTS[g]["id"]
        ids = r["completion_ids"][i][r["completion_mask"][i]]
        assert row["completion"] == tok.decode(ids, skip_special_tokens=True)
    assert rows[0]["prompt"] == PROMPTS[0]["prompt"]
    # A chat record is rendered with the chat template and the generation prompt; its messages travel along.
    assert rows[8]["prompt"] == "user: 9+1?\nassistant: "
    assert rows[8]["messages"] == PROMPTS[2]["messages"]


def test_same_seed_same_samples_other_seed_different(models, prompts_file, tmp_path):
    def run(seed, out):
        r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", out,
                "--group-size", 2, "--num-prompts", 2, "--start", 1, "--max-new-tokens", 12, "--seed", seed)
        assert r.code == 0, r.err
        return load_file(out / "rollouts.safetensors")

    a, b, c = run(1, tmp_path / "a"), run(1, tmp_path / "b"), run(2, tmp_path / "c")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["completion_ids"], c["completion_ids"][:, :a["completion_ids"].shape[1]])
    assert "ref_logprobs" not in a                                   # no --ref-model, no reference
    assert json.loads(open(tmp_path / "a" / "samples.jsonl").readline())["id"] == "b"   # --start 1


def test_bad_prompt_files(models, tmp_path):
    out = tmp_path / "out"

    def run(path, *extra):
        return cli("sample.py", "--model", models["policy"], "--prompts", path, "--out", out,
                   "--group-size", 2, "--max-new-tokens", 4, *extra)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert_user_error(run(empty), "empty.jsonl", "no records")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert_user_error(run(broken), "broken.jsonl", "line 2", "not valid JSON")
    bad_chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": "hello"}])
    assert_user_error(run(bad_chat), "chat.jsonl", "line 1", "'messages'")
    neither = write_jsonl(tmp_path / "neither.jsonl", [{"prompt": "ok"}, {"question": "no prompt"}])
    assert_user_error(run(neither), "neither.jsonl", "line 2", "'prompt'", "'messages'")
    too_long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 600}])
    assert_user_error(run(too_long), "long.jsonl", "line 1", "600 tokens")
    few = write_jsonl(tmp_path / "few.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert_user_error(run(few, "--num-prompts", 3), "few.jsonl", "--num-prompts 3")
    assert_user_error(cli("sample.py", "--model", tmp_path / "nomodel", "--prompts", few, "--out", out),
                      "nomodel", "no such model folder")
    os.makedirs(tmp_path / "notamodel")
    assert_user_error(cli("sample.py", "--model", tmp_path / "notamodel", "--prompts", few, "--out", out),
                      "notamodel", "config.json")
    assert_user_error(run(few, "--temperature", 0), "--temperature")
    assert not out.exists()


def test_tokenizer_without_pad_token_is_handled(tmp_path, prompts_file):
    tok = builders.char_tokenizer()
    tok.pad_token = None
    model_dir = builders.make_tiny_llama(str(tmp_path / "nopad"), tokenizer=tok)
    r = cli("sample.py", "--model", model_dir, "--prompts", prompts_file, "--out", tmp_path / "o",
            "--group-size", 2, "--num-prompts", 2, "--max-new-tokens", 6)
    assert r.code == 0, r.err
    rollouts = load_file(tmp_path / "o" / "rollouts.safetensors")
    assert rollouts["prompt_mask"].sum(1).tolist() == [14, 14, 47, 47]   # "What is 2 + 3?" and the longer one


def test_prompt_as_a_list_of_chat_turns_is_rendered_like_messages(models):
    from grpo.models import loading
    from grpo.rewards import prompting

    tok = loading.load_tokenizer(models["policy"])
    chat = [{"role": "user", "content": "9+1?"}]
    as_messages = prompting.render_prompts([{"messages": chat}], tok, "p", None)
    as_prompt = prompting.render_prompts([{"prompt": chat}], tok, "p", None)
    assert as_messages == as_prompt and as_prompt[0][0] != "9+1?"
    # samples.jsonl keeps the text the model saw as "prompt" and the turns as "messages" in either style.
    row = prompting.sample_row({"prompt": chat, "answer": "10"}, 0, as_prompt[0][0], "ten")
    assert row == {"group": 0, "prompt": as_prompt[0][0], "completion": "ten", "answer": "10", "messages": chat}
    assert prompting.sample_row({"prompt": "1+1=", "answer": "2"}, 1, "1+1=", "2") == {
        "group": 1, "prompt": "1+1=", "completion": "2", "answer": "2"}
