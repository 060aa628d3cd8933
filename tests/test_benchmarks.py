"""benchmarks/iteration.py's matmul FLOP count, against a count by hand on a tiny Llama config; the
draws of `benchmarks/levers.py draw` are draws from the sampler's distribution; gpu_check.py on the CPU."""

import os
import sys

import pytest
import torch
from transformers import LlamaConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import iteration  # noqa: E402
import levers  # noqa: E402


def tiny_config():
    # d = 8, 2 query heads and 1 K/V head of 4, MLP 16, 2 layers, vocabulary 32.
    return LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       intermediate_size=16, num_hidden_layers=2, vocab_size=32)


def test_matmul_flops_by_hand():
    # B = 2 prompts of P = 3 tokens, G = 2 completions (N = 4 rows) of T = 2 tokens.
    # One token through the layers: q 2·8·8 = 128, k and v 2·8·4 = 64 each, o 128, gate, up and down
    # 2·8·16 = 256 each: 1,152 a layer, 2,304 for both. One position of the LM head: 2·8·32 = 512.
    # One (query, key) pair of attention: 2 heads × (2·4 for q·k + 2·4 for p·v) = 32 a layer, 64 for both.
    # The prefill (each stage): 2 × 3 tokens, 2 × 3 × 3 pairs, the LM head at 2 positions:
    #   6·2,304 = 13,824; 18·64 = 1,152; 2·512 = 1,024.
    # Sampling draws token 0 from the prefill, then 1 decode step (token 1's), 4 rows of one token:
    #   4·2,304 = 9,216 in the layers, 4·512 = 2,048 in the LM head; 4 keys a row: 16 pairs, 1,024.
    # The reference's completion pass: 4 rows × 1 token = 4·2,304 = 9,216; 4 positions of the
    #   LM head, 2,048; 4 rows × 1 query × 4 keys = 16 pairs, 1,024.
    # The update: the reference's forward, and a backward of twice that.
    flops = iteration.matmul_flops(tiny_config(), B=2, P=3, G=2, T=2)
    assert flops["sampling"] == {"layers": 13_824 + 9_216, "lm_head": 1_024 + 2_048, "attention": 1_152 + 1_024}
    assert flops["reference"] == {"layers": 13_824 + 9_216, "lm_head": 1_024 + 2_048, "attention": 1_152 + 1_024}
    assert flops["update"] == {k: 3 * v for k, v in flops["reference"].items()}
    assert sum(sum(f.values()) for f in flops.values()) == 5 * 28_288


def test_backward_is_the_transposed_products():
    # Each of the update's forward products [m, k] × [k, n] appears with its two gradients' shapes.
    matmuls = iteration.iteration_matmuls(tiny_config(), B=2, P=3, G=2, T=2)
    update = [(kind, m, k, n, c) for stage, kind, m, k, n, c in matmuls if stage == "update"]
    reference = [(kind, m, k, n, c) for stage, kind, m, k, n, c in matmuls if stage == "reference"]
    assert len(update) == 3 * len(reference)
    for kind, m, k, n, c in reference:
        assert {(kind, m, k, n, c), (kind, m, n, k, c), (kind, k, m, n, c)} <= set(update)
    # the LM head at the 4 completion positions: [4, 8] × [8, 32], dx [4, 32] × [32, 8], dW [8, 4] × [4, 32]
    assert {("lm_head", 4, 8, 32, 1), ("lm_head", 4, 32, 8, 1), ("lm_head", 8, 4, 32, 1)} <= set(update)


@pytest.mark.parametrize("name", list(levers.DRAWS))
def test_every_draw_follows_softmax_at_temperature(name):
    # 4 tokens, logits [2, 1, 0, -1] at τ = 0.5: p ∝ exp([4, 2, 0, -2]) = [0.8650, 0.1171, 0.0158, 0.0021].
    # 200,000 draws: a frequency's standard error is at most 0.0011, so 0.006 is more than 5 of them.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(200_000, 4)
    tokens = levers.DRAWS[name](logits, 0.5, torch.Generator().manual_seed(0)).squeeze(-1)
    frequency = torch.bincount(tokens, minlength=4).double() / len(tokens)
    assert torch.allclose(frequency, torch.tensor([0.8650, 0.1171, 0.0158, 0.0021], dtype=torch.double), atol=0.006)


def test_the_gpu_check_runs_on_the_cpu_and_reports_every_part():
    """benchmarks/gpu_check.py --small: the script a GPU day runs, end to end on the tiny model."""
    import gpu_check

    result = gpu_check.main(["--small", "--tests", "tests/test_advantage.py::test_grpo_hand_vector",
                             "--engine-tests", "tests/test_vllm.py::test_vllm_is_installed"])
    assert result["tests"]["exit"] == 0 and result["tests"]["passed"] == 1
    job = result["default_job"]
    assert job["exit"] == 0 and len(job["charts/reward_mean"]) == 2, job
    assert job["old_logprobs"] == ("recompute" if result["environment"]["gpu"] else "sampler")
    assert job["diag/logprob_diff_max"][0] < 1e-4               # float32 on a CPU: sampler and update agree
    table = result["iteration_table_1"]
    assert table["exit"] == 0, table
    assert table["table_1"]["sampler_tokens_per_s"]["generate"] > 0, table
    engine = result["engine"]                               # the README's setup installs vLLM
    assert engine["tests"]["exit"] == 0 and engine["tests"]["passed"] == 1, engine["tests"]
    assert engine["default_job"]["exit"] == 0, engine["default_job"]
    assert max(engine["default_job"]["diag/rollout_is_diff_max"][1:]) < 1e-3, engine["default_job"]
    assert table["table_1"]["vllm"]["engine"]["tokens_per_s"] > 0, table
