"""The sampler's knobs: top-k, top-p and min-p after τ, against hand-computed distributions; a token
outside the top k is never drawn; --top-k 1 at any τ is greedy decoding; the log-probs stay the
model's at τ; the knobs are recorded in the rollouts' metadata."""

import json
import math

import pytest
import torch
from conftest import cli
from safetensors import safe_open
from transformers import GenerationConfig

import sample
from grpo.models import fast_decode, loading, modeling
from grpo.rewards import prompting


def probs(z):
    return z.softmax(-1)[0].tolist()


def test_truncation_against_hand_computed_distributions():
    z = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log() / 1.0             # logits at τ: p = 0.5, 0.3, 0.15, 0.05
    assert probs(sample.truncate(z)) == pytest.approx([0.5, 0.3, 0.15, 0.05])
    # top-p 0.9: 0.5 + 0.3 = 0.8 < 0.9, so the third joins (0.95 ≥ 0.9); renormalised by 0.95.
    assert probs(sample.truncate(z, top_p=0.9)) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert probs(sample.truncate(z, top_p=0.8)) == pytest.approx([0.625, 0.375, 0.0, 0.0])   # 0.8 reaches 0.8
    assert probs(sample.truncate(z, top_p=0.4)) == pytest.approx([1.0, 0.0, 0.0, 0.0])
    # min-p 0.2: tokens below 0.2 × 0.5 = 0.1 go: only 0.05.
    assert probs(sample.truncate(z, min_p=0.2)) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert probs(sample.truncate(z, min_p=0.7)) == pytest.approx([1.0, 0.0, 0.0, 0.0])      # 0.3 < 0.35
    # top-k 3, then top-p 0.8 of what is left (0.5, 0.3, 0.15 renormalised: 0.526 + 0.316 = 0.842 ≥ 0.8).
    assert probs(sample.truncate(z, top_k=3, top_p=0.8)) == pytest.approx([0.625, 0.375, 0.0, 0.0])
    # min-p after top-p: of 0.5/0.95, 0.3/0.95, 0.15/0.95, min-p 0.4 leaves out the last (0.158 < 0.211).
    assert probs(sample.truncate(z, top_p=0.9, min_p=0.4)) == pytest.approx([0.625, 0.375, 0.0, 0.0])


@pytest.fixture(scope="module")
def tiny(models):
    tok = loading.load_tokenizer(models["policy"])
    policy = loading.load_model(models["policy"], "cpu")
    ids, mask = prompting.left_pad([tok(t)["input_ids"] for t in ["1+1=", "What is 2 + 3?", "abc"]], tok.pad_token_id)
    return tok, policy, ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)


COLUMNS = ("completion_ids", "completion_mask", "old_logprobs", "truncated")


def draw(tiny, temperature, seed=0, columns=COLUMNS, **knobs):
    tok, policy, ids, mask = tiny
    out = sample.sample_completions(policy, ids, mask, 12, temperature, loading.eos_token_ids(tok, policy),
                                    tok.pad_token_id, torch.Generator().manual_seed(seed), **knobs)
    return tuple(out[k] for k in columns)


def test_a_token_outside_the_top_k_is_never_drawn_and_log_probs_stay_the_models(tiny):
    tok, policy, ids, mask = tiny
    completion_ids, completion_mask, logp, _ = draw(tiny, 1.5, top_k=3)
    with torch.no_grad():
        logits, cut_ids, cut_mask = modeling.completion_outputs(policy, ids, mask, completion_ids.clone(),
                                                                completion_mask.clone())
    rank = (logits > logits.gather(-1, cut_ids[..., None])).sum(-1)              # [n, T] tokens above it
    assert rank[cut_mask].max().item() <= 2 and rank[cut_mask].float().mean() > 0.3   # top 3, not only the first
    # log π_old is log_softmax(logits / τ) of the whole vocabulary, not of the three kept tokens
    full = modeling.logprobs_from_logits(logits, cut_ids, 1.5)
    torch.testing.assert_close(logp[:, :cut_ids.shape[1]][cut_mask], full[cut_mask], atol=1e-5, rtol=0)
    assert logp[completion_mask].exp().max() < 1 and (logp[completion_mask] < math.log(0.99)).all()


@pytest.mark.parametrize("knobs", [dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2),
                                   dict(top_k=5, top_p=0.9, min_p=0.05)])
def test_sampler_logprobs_are_those_of_the_truncated_distribution_each_token_was_drawn_from(tiny, knobs):
    """log q(o_t) with q = softmax(truncate(logits / τ)), recomputed by hand from a full forward's
    logits: above log π_old by −log of the kept mass, 0 for a token kept alone; absent untruncated."""
    tok, policy, ids, mask = tiny
    columns = ("completion_ids", "completion_mask", "old_logprobs", "sampler_logprobs")
    completion_ids, completion_mask, old, sampler_logp = draw(tiny, 1.3, columns=columns, **knobs)
    with torch.no_grad():
        logits, cut_ids, cut_mask = modeling.completion_outputs(policy, ids, mask, completion_ids.clone(),
                                                                completion_mask.clone())
    z = sample.truncate(logits.float() / 1.3, **knobs)                                    # [n, T, V]
    q = z.softmax(-1).gather(-1, cut_ids[..., None]).squeeze(-1)                         # [n, T]
    kept = (logits.float() / 1.3).softmax(-1).masked_fill(z == -torch.inf, 0.0).sum(-1)  # mass kept, [n, T]
    T = cut_ids.shape[1]
    torch.testing.assert_close(sampler_logp[:, :T][cut_mask], q.log()[cut_mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(sampler_logp[:, :T][cut_mask], (old[:, :T] - kept.log())[cut_mask], atol=2e-5, rtol=0)
    assert (sampler_logp[completion_mask] >= old[completion_mask] - 1e-6).all()
    assert (sampler_logp[~completion_mask] == 0).all()
    assert "sampler_logprobs" not in sample.sample_completions(
        policy, ids, mask, 4, 1.3, [], tok.pad_token_id, torch.Generator().manual_seed(0))


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(tiny):
    z = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert probs(sample.truncate(z, top_k=4)) == probs(sample.truncate(z, top_k=100)) == probs(z)
    vocab = tiny[1].config.vocab_size
    assert torch.equal(draw(tiny, 1.0, top_k=vocab + 1000)[0], draw(tiny, 1.0)[0])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_top_k_one_is_greedy_decoding_at_any_temperature(tiny, temperature):
    tok, policy, ids, mask = tiny
    completion_ids, completion_mask, _, _ = draw(tiny, temperature, seed=int(temperature * 10), top_k=1)
    config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=loading.eos_token_ids(tok, policy),
                              pad_token_id=tok.pad_token_id)
    greedy = policy.generate(input_ids=ids, attention_mask=mask.long(), generation_config=config)[:, ids.shape[1]:]
    for row in range(len(ids)):
        ours = completion_ids[row][completion_mask[row]].tolist()
        assert greedy[row, :len(ours)].tolist() == ours, row


def test_the_knobs_are_recorded_and_checked(models, prompts_file, tmp_path):
    out = tmp_path / "o"
    r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", out, "--group-size", 2,
            "--num-prompts", 2, "--max-new-tokens", 4, "--top-k", 5, "--top-p", 0.9, "--min-p", 0.05)
    assert r.code == 0, r.err
    with safe_open(str(out / "rollouts.safetensors"), framework="pt") as f:
        args = json.loads(f.metadata()["args"])
    assert (args["top_k"], args["top_p"], args["min_p"]) == (5, 0.9, 0.05)
    for flag, value in [("--top-p", 0), ("--top-p", 1.5), ("--min-p", -0.1), ("--top-k", -1)]:
        r = cli("sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", tmp_path / "x",
                flag, value)
        assert r.code == 2 and flag in r.err and not (tmp_path / "x").exists()


def test_the_packed_onednn_products_give_the_same_logits_and_draws_and_are_removed_after(tiny, monkeypatch):
    """fast_decode.decode_linears (sample.rollout's CPU products): every plain linear of the model, the
    LM head included, within float32 rounding of F.linear at the decode step's rows and at a
    prefill's, the same completions for a seed, and nn.Linear's own forward again after the block."""
    tok, policy, ids, mask = tiny
    linears = [m for m in policy.modules() if type(m) is torch.nn.Linear]
    assert policy.get_output_embeddings() in linears and len(linears) > 1
    x = {m: torch.randn(5, 3, m.in_features, generator=torch.Generator().manual_seed(0)) for m in linears}
    with torch.inference_mode():
        plain = {m: m(x[m]) for m in linears}
        with fast_decode.decode_linears(policy, 24):
            assert all("forward" in vars(m) for m in linears)                # the lever is on for this model
            fast = {m: m(x[m]) for m in linears}
            drawn = draw(tiny, 1.0)
    assert not any("forward" in vars(m) for m in linears)
    for m in linears:
        torch.testing.assert_close(fast[m], plain[m], rtol=1e-5, atol=1e-5)
    plain_drawn = draw(tiny, 1.0)
    assert torch.equal(drawn[0], plain_drawn[0])
    torch.testing.assert_close(drawn[2], plain_drawn[2], rtol=0, atol=1e-5)
    head = policy.get_output_embeddings()
    with fast_decode.decode_linears(policy, 24):
        packed = head.forward
        with fast_decode.decode_linears(policy, 24):                    # a nested block leaves them be
            assert head.forward is packed
        assert head.forward is packed
        with torch.inference_mode():
            assert head(torch.zeros(0, head.in_features)).shape == (0, head.out_features)
        x = torch.randn(2, head.in_features, requires_grad=True)     # with gradients: nn.Linear's own
        head(x).square().sum().backward()
    grads = x.grad, head.weight.grad
    x.grad, head.weight.grad = None, None
    head(x).square().sum().backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], head.weight.grad)
    assert not any("forward" in vars(m) for m in linears)
    monkeypatch.setattr(fast_decode, "ONEDNN_DECODE", False)
    with fast_decode.decode_linears(policy, 24):
        assert not any("forward" in vars(m) for m in linears)


def test_the_draw_is_torch_multinomials_token_for_token_and_leaves_the_generator_where_it_does():
    """sample.draw on a CPU makes multinomial's exponentials a batch at once: for the same seed the
    same tokens as torch.multinomial(probs, 1), and the generator advanced by as much, on flat,
    peaked, truncated (zero-probability) and column-major rows; a NaN row is an error, as
    multinomial's is."""
    logits = torch.randn(6, 16, 5000, generator=torch.Generator().manual_seed(1))
    logits = logits * torch.tensor([0.1, 1.0, 3.0, 10.0, 30.0, 1.0])[:, None, None]       # flat to one-hot
    logits[5, :, 100:] = -torch.inf                                                     # truncated rows
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for z in logits:
        probs = z.softmax(-1)                                                           # [16, 5000]
        assert torch.equal(sample.draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(-1))
    probs = logits[2].softmax(-1).T.contiguous().T                                    # column-major [16, 5000]
    assert torch.equal(sample.draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(-1))
    assert torch.equal(ours.get_state(), theirs.get_state())
    drawn = torch.stack([sample.draw(logits[1].softmax(-1), ours) for _ in range(200)])   # [200, 16]
    assert drawn.unique().numel() > 100                                # a flat row is not always argmax
    with pytest.raises(ValueError, match="nan"):
        sample.draw(torch.full((2, 5), torch.nan), ours)


@pytest.mark.parametrize("share_prefix", [True, False])
def test_the_preallocated_kv_cache_draws_what_the_concatenating_one_draws(tiny, monkeypatch, share_prefix):
    """The sampler's cache (grpo/models/fast_decode.py) holds its keys and values in buffers made once; the
    completions, masks and log π_old are bit for bit those of transformers' DynamicLayer, which
    concatenates at every step, and every layer of the sampler's cache is a PreallocatedLayer."""
    from grpo.models import fast_decode
    made = []
    monkeypatch.setattr(fast_decode, "preallocate", lambda cache, room, real=fast_decode.preallocate:
                        made.append(real(cache, room)) or made[-1])
    fast = draw(tiny, 1.0, share_prefix=share_prefix)
    assert made and all(type(layer) is fast_decode.PreallocatedLayer for layer in made[0].layers)
    monkeypatch.setattr(fast_decode, "preallocate", lambda cache, room: cache)
    plain = draw(tiny, 1.0, share_prefix=share_prefix)
    for a, b in zip(fast, plain):
        assert torch.equal(a, b)


def test_a_preallocated_layer_grows_past_its_room_and_follows_a_reorder():
    """PreallocatedLayer.update past its room, after a crop, after a reorder (new key tensors) and
    after a batch select of the first rows (a view at the buffer's own address) returns what
    DynamicLayer's concatenation returns."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from grpo.models.fast_decode import PreallocatedLayer
    g = torch.Generator().manual_seed(0)
    step = lambda n=4: (torch.randn(n, 2, 1, 8, generator=g), torch.randn(n, 2, 1, 8, generator=g))  # noqa: E731
    plain = DynamicLayer()
    plain.update(*step())
    fast = PreallocatedLayer(plain, room=2)
    plain = DynamicLayer()
    plain.update(fast.keys.clone(), fast.values.clone())
    for event in ["step", "step", "step", "crop", "step", "reorder", "step", "select", "step", "step"]:
        if event == "step":                                                  # the 3rd step grows
            kv = step(len(plain.keys))
            got, want = fast.update(*kv), plain.update(*kv)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert fast.keys.data_ptr() == fast.key_buffer.data_ptr()       # a view, not a copy
        elif event == "crop":
            fast.crop(-2), plain.crop(-2)
        elif event == "select":
            fast.batch_select_indices(slice(0, 2)), plain.batch_select_indices(slice(0, 2))
        else:
            order = torch.tensor([3, 0, 0, 1])
            fast.reorder_cache(order), plain.reorder_cache(order)
    assert fast.get_seq_length() == plain.get_seq_length() == 6               # 1 + 3 − 2 + 1 + 3
    assert fast.keys.shape[0] == 2
    from grpo.models.fast_decode import preallocate
    with pytest.raises(RuntimeError, match="without gradients"):             # it writes in place
        preallocate(DynamicCache(), 2)
