"""The files this project writes: stage files through safetensors' own writer, checkpoints that
from_pretrained loads to the same weights, background saves, and writes that fail cleanly."""

import errno
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import update
from grpo.cli import StageError
from grpo.disk import checkpoints, files, outputs
from grpo.models import builders, loading
from grpo.training import optim


def test_stage_file_round_trips_with_schema_and_args(tmp_path):
    tensors = {"f32": torch.randn(3, 5), "i64": torch.arange(-5, 5), "bool": torch.tensor([[True, False]]),
               "strided": torch.randn(6, 4).t()}
    path = tmp_path / "x.safetensors"
    files.save_tensors(str(path), tensors, "test/1", {"n": 3, "path": tmp_path})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["schema"] == "test/1"
        assert json.loads(f.metadata()["args"]) == {"n": 3, "path": str(tmp_path)}
        back = {k: f.get_tensor(k) for k in f.keys()}
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert os.listdir(tmp_path) == ["x.safetensors"]                           # no temporary left behind


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_loads_to_the_same_weights(tmp_path, tied):
    tok = builders.char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    checkpoints.save_checkpoint(model, tok, str(tmp_path / "ckpt"))
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not tied)          # a tied copy is not stored twice
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert (again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()) == tied


def test_background_save_writes_what_a_plain_save_writes(tmp_path, models):
    """The saver's thread writes the same files as a plain save, and its error reaches the caller.
    (That training waits for it before changing the weights is tests/test_train.py's.)"""
    model = loading.load_model(models["policy"], "cpu")
    tok = loading.load_tokenizer(models["policy"])
    optimizer = optim.adamw(model, 1e-3)
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    optimizer.step()
    args = update.parse_args(["--model", "m", "--rollouts", "r", "--advantages", "a", "--out", "o"])
    checkpoints.save_policy(model, tok, optimizer, {"loss": 1.0}, args, str(tmp_path / "plain"))
    saver = checkpoints.BackgroundSaver()
    checkpoints.save_policy(model, tok, optimizer, {"loss": 1.0}, args, str(tmp_path / "background"), saver=saver)
    saver.wait()
    for name in ("model.safetensors", "optimizer.safetensors"):
        plain, background = (load_file(tmp_path / kind / name) for kind in ("plain", "background"))
        assert plain.keys() == background.keys()
        assert all(torch.equal(plain[k], background[k]) for k in plain), name
    assert (tmp_path / "plain" / "metrics.json").read_text() == (tmp_path / "background" / "metrics.json").read_text()

    saver.submit(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError):
        saver.wait()                                 # the thread's error reaches the caller


@pytest.mark.parametrize("code, text", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")])
def test_a_failed_write_keeps_the_last_good_files(tmp_path, models, monkeypatch, code, text):
    model = loading.load_model(models["policy"], "cpu")
    tok = loading.load_tokenizer(models["policy"])
    ckpt = tmp_path / "ckpt"
    checkpoints.save_checkpoint(model, tok, str(ckpt))
    before = (ckpt / "model.safetensors").read_bytes()
    files.save_tensors(str(tmp_path / "r.safetensors"), {"x": torch.ones(3)}, "t/1", {})

    def full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(code, text)

    monkeypatch.setattr(checkpoints, "save_file", full)
    monkeypatch.setattr(files, "save_file", full)
    with pytest.raises(StageError, match=f"{text}.*still holds the last complete one"):
        checkpoints.save_checkpoint(model, tok, str(ckpt))
    with pytest.raises(StageError, match=f"r.safetensors: cannot write \\({text}\\)"):
        files.save_tensors(str(tmp_path / "r.safetensors"), {"x": torch.zeros(3)}, "t/1", {})
    assert (ckpt / "model.safetensors").read_bytes() == before
    assert torch.equal(load_file(tmp_path / "r.safetensors")["x"], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "r.safetensors"]          # no temporary left behind


def test_a_replace_cut_short_is_finished_by_its_writer_and_said_to_a_reader(tmp_path, models):
    """A kill between replace_dir's two renames leaves the old folder under the project's scratch name,
    named by the journal: a reader (--model) says so in one line and renames nothing; the next writer
    puts it back. A user's own ckpt.old beside it is never touched."""
    model = loading.load_model(models["policy"], "cpu")
    tok = loading.load_tokenizer(models["policy"])
    ckpt = tmp_path / "ckpt"
    checkpoints.save_checkpoint(model, tok, str(ckpt), command="update.py")
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "notes.txt").write_text("mine")
    old = files.scratch_name(str(ckpt), "old")
    files.write_json(files.swap_journal(str(ckpt)), {"grpo_swap": 1, "old": os.path.basename(old)})
    os.rename(ckpt, old)                                       # killed here, before the second rename
    with pytest.raises(StageError, match="cut short.*grpo-old"):
        loading.load_model(str(ckpt), "cpu")
    assert not ckpt.exists() and os.path.isdir(old)
    outputs.check_dir(str(ckpt), "update.py")                  # the writer's check finishes the swap
    assert loading.load_model(str(ckpt), "cpu") is not None
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old"]
    assert (tmp_path / "ckpt.old" / "notes.txt").read_text() == "mine"
    checkpoints.save_checkpoint(model, tok, str(ckpt), command="update.py")      # a whole swap
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old"]


def test_a_journal_not_the_projects_is_ignored(tmp_path):
    """recover_dir acts only on a journal that names a scratch folder of its own path."""
    target = tmp_path / "x"
    (tmp_path / "elsewhere").mkdir()
    files.write_json(files.swap_journal(str(target)), {"grpo_swap": 1, "old": "elsewhere"})
    files.recover_dir(str(target))
    assert not target.exists() and (tmp_path / "elsewhere").is_dir()


