"""The four stages chained as separate processes, exactly as a user would type them."""

import json
import os
import resource
import subprocess
import sys

import pytest
from conftest import ROOT, cli
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def run(*argv):
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, env=env)


def test_pipeline_as_separate_processes(models, prompts_file, tmp_path):
    it = tmp_path / "iter_0000"
    steps = [
        ["sample.py", "--model", models["policy"], "--prompts", prompts_file, "--out", it, "--group-size", 4,
         "--num-prompts", 3, "--max-new-tokens", 16, "--temperature", 1.0, "--seed", 0, "--ref-model", models["ref"]],
        ["score.py", "--rollouts", it / "rollouts.safetensors", "--samples", it / "samples.jsonl",
         "--reward", "exact_answer", "tests/length_reward.py:char_count", "--reward-weights", 1.0, 0.01,
         "--out", it / "rewards.safetensors"],
        ["advantage.py", "--rewards", it / "rewards.safetensors", "--out", it / "advantages.safetensors",
         "--estimator", "grpo", "--eps", 1e-4],
        ["update.py", "--model", models["policy"], "--rollouts", it / "rollouts.safetensors",
         "--advantages", it / "advantages.safetensors", "--out", tmp_path / "policy", "--lr", 1e-4,
         "--beta", 0.01, "--clip-eps", 0.2, "--loss-agg", "seq", "--epochs", 1, "--minibatch-size", 6],
    ]
    for argv in steps:
        result = run(*argv)
        assert result.returncode == 0, (argv[0], result.stderr)
    rewards = load_file(it / "rewards.safetensors")
    advantages = load_file(it / "advantages.safetensors")
    assert rewards["rewards"].shape == advantages["advantages"].shape == (12,)
    assert advantages["advantages"].abs().sum() > 0                 # char_count gives every group spread
    metrics = json.loads((tmp_path / "policy" / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "policy").config.model_type == "llama"


def test_user_error_is_one_line_and_exit_code_2(tmp_path):
    result = run("advantage.py", "--rewards", tmp_path / "missing.safetensors", "--out", tmp_path / "a.safetensors")
    assert result.returncode == 2
    assert result.stderr.strip() == f"advantage.py: error: {tmp_path / 'missing.safetensors'}: no such file"
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.parametrize("script, symbols", [
    ("sample.py", ["G:", "B:", "τ:", "π_ref", "L_max"]),
    ("score.py", ["r:", "w_k"]),
    ("advantage.py", ["ε", "Dr. GRPO", "RLOO"]),
    ("update.py", ["β:", "ε (ε_low)", "ε_high", "μ:", "τ", "DAPO"]),
    ("train.py", ["K:", "B:", "G:", "L_max:", "τ:", "β:", "ε (ε_low)", "ε_high:", "C:", "μ:", "ε in std + ε", "α:", "S:"]),
])
def test_help_names_the_paper_symbols(script, symbols):
    result = cli(script, "--help")
    assert result.code == 0
    for symbol in symbols:
        assert symbol in result.out, (script, symbol)


FAULTS = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from grpo import cli

def main():
    torch.ones(64 * 2**20)                           # 256 MB allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(48 * 2**20)                           # then 192 MB
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

cli.run_cli(main) if {as_stage} else main()
"""


def test_a_stage_process_reuses_the_memory_it_freed_without_page_faults():
    """run_cli (every stage's command) first calls cli.keep_freed_memory: 192 MB allocated where
    256 MB were freed then faults no page in; glibc's default has returned the 256 MB to the
    kernel and faults in every page of the 192 MB."""
    faults = {}
    for as_stage in (False, True):
        r = run("-c", FAULTS.format(root=ROOT, as_stage=as_stage))
        assert r.returncode == 0, r.stderr
        faults[as_stage] = int(r.stdout)
    pages = 48 * 2**20 * 4 // resource.getpagesize()
    assert faults[False] > 0.9 * pages and faults[True] * 20 < faults[False]
