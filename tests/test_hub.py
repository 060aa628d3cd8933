"""Model arguments given as Hub ids (org/name[@revision]), resolved through huggingface_hub's cache with
no network: tiny models laid out in a temporary HF_HOME, each stage run as its own process with
HF_HUB_OFFLINE=1, so that huggingface_hub reads its settings from that environment as a user's run would."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, cli
from safetensors.torch import load_file

from grpo.disk import checkpoints
from grpo.models import builders

MAIN, OLD = "1" * 40, "2" * 40                     # two commits of tiny-org/tiny-llama


def put_in_cache(hf_home, repo_id, folder, commit, refs=()):
    """Lay `folder` out as `commit` of `repo_id` in a Hugging Face hub cache, `refs` pointing at it."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub(models, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    hf_home = tmp_path_factory.mktemp("hf_home")
    put_in_cache(hf_home, "tiny-org/tiny-llama", models["policy"], MAIN, refs=("main",))
    put_in_cache(hf_home, "tiny-org/tiny-llama", models["ref"], OLD, refs=("v1",))
    rm = tmp_path_factory.mktemp("rm") / "rm"
    tok = builders.char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    checkpoints.save_checkpoint(LlamaForSequenceClassification(config), tok, str(rm))
    put_in_cache(hf_home, "tiny-org/tiny-rm", rm, MAIN, refs=("main",))
    pickled = tmp_path_factory.mktemp("pickled") / "pickled"     # the policy with its weights as a pickle
    shutil.copytree(models["policy"], pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(os.path.join(models["policy"], "model.safetensors")), pickled / "pytorch_model.bin")
    put_in_cache(hf_home, "tiny-org/pickle-only", pickled, MAIN, refs=("main",))
    return {"home": hf_home, "rm": rm}


def offline(hub, script, *args):
    env = {**os.environ, "HF_HOME": str(hub["home"]), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], env=env,
                          capture_output=True, text=True, cwd=ROOT)


def test_stages_take_hub_ids_from_the_offline_cache(hub, models, prompts_file, tmp_path):
    sample_args = ["--prompts", prompts_file, "--group-size", 2, "--num-prompts", 2, "--max-new-tokens", 6,
                   "--seed", 1]
    r = offline(hub, "sample.py", "--model", "tiny-org/tiny-llama", "--ref-model", "tiny-org/tiny-llama@v1",
                *sample_args, "--out", tmp_path / "hub")
    assert r.returncode == 0, r.stderr
    assert cli("sample.py", "--model", models["policy"], "--ref-model", models["ref"], *sample_args,
               "--out", tmp_path / "local").code == 0
    by_id, by_folder = (load_file(tmp_path / d / "rollouts.safetensors") for d in ("hub", "local"))
    assert by_id.keys() == by_folder.keys()
    assert all(torch.equal(by_id[k], by_folder[k]) for k in by_id)          # main is the policy, v1 the ref
    rollouts, samples = tmp_path / "hub" / "rollouts.safetensors", tmp_path / "hub" / "samples.jsonl"
    r = offline(hub, "score.py", "--rollouts", rollouts, "--samples", samples, "--reward", f"tiny-org/tiny-rm@{MAIN}",
                "--out", tmp_path / "hub_rewards.safetensors")
    assert r.returncode == 0, r.stderr
    assert cli("score.py", "--rollouts", rollouts, "--samples", samples, "--reward", hub["rm"],
               "--out", tmp_path / "local_rewards.safetensors").code == 0
    torch.testing.assert_close(load_file(tmp_path / "hub_rewards.safetensors")["rewards"],
                               load_file(tmp_path / "local_rewards.safetensors")["rewards"])


def test_train_runs_from_a_hub_id(hub, tmp_path):
    run = tmp_path / "run"
    r = offline(hub, "train.py", "--config", "tiny", "--model", "tiny-org/tiny-llama", "--iterations", 1,
                "--eval-every", 0, "--run-dir", run)
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(run / "iter_0000" / "metrics.json")
    assert '"model": "tiny-org/tiny-llama"' in (run / "config.json").read_text()


def test_hub_id_errors_are_one_line(hub):
    """A pickle-only repo, a repo not in the cache, a revision not in it: each a StageError naming it
    (the stages print it as one line; here in one process, to pay for the imports once)."""
    script = ("from grpo.models import loading\nfrom grpo.cli import StageError\n"
              "for spec in ['tiny-org/pickle-only', 'tiny-org/not-cached', 'tiny-org/tiny-llama@v9']:\n"
              "    try:\n        loading.load_model(spec, 'cpu')\n        print('loaded', spec)\n"
              "    except StageError as e:\n        print(e)\n")
    env = {**os.environ, "HF_HOME": str(hub["home"]), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout + r.stderr
    assert "pickle-only" in lines[0] and "only safetensors weights are read, never pickle" in lines[0]
    assert "tiny-org/not-cached" in lines[1] and "HF_HUB_OFFLINE=1" in lines[1]
    assert "tiny-org/tiny-llama@v9" in lines[2] and "HF_HUB_OFFLINE=1" in lines[2]
