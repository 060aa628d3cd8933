"""The files this project writes: its safetensors writer against the safetensors library, checkpoints
that from_pretrained loads to the same weights, background saves, and writes that fail cleanly."""

import errno
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import common


def test_writer_round_trips_through_the_safetensors_library(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5), "f64": torch.randn(2, dtype=torch.float64), "bf16": torch.randn(4, 3).bfloat16(),
        "f16": torch.randn(7).half(), "i64": torch.arange(-5, 5), "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "u8": torch.arange(200, 210, dtype=torch.uint8), "bool": torch.tensor([[True, False], [False, True]]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "strided": torch.randn(6, 4).t(),
    }
    path = tmp_path / "x.safetensors"
    common.write_safetensors(str(path), tensors, {"schema": "test/1", "n": 3})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"schema": "test/1", "n": "3"}
        back = {k: f.get_tensor(k) for k in f.keys()}
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k



@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 8192 - 17, 8192, 8193, 3 * 8192 + 5])
def test_direct_write_gives_the_bytes_of_a_buffered_write(tmp_path, monkeypatch, nbytes):
    """Large files go through O_DIRECT in blocks (here 8 KiB, so that every boundary is crossed: the
    header, a block, the last block's padding); the file must be byte for byte the buffered one."""
    tensors = {"head": torch.arange(3, dtype=torch.int16), "body": torch.randint(0, 256, (nbytes,), dtype=torch.uint8),
               "tail": torch.randn(2, 3)}
    monkeypatch.setattr(common, "DIRECT_WRITE_MIN_BYTES", 1 << 62)
    common.write_safetensors(str(tmp_path / "buffered"), tensors, {"k": "v"})
    monkeypatch.setattr(common, "DIRECT_WRITE_MIN_BYTES", 0)
    monkeypatch.setattr(common, "_DIRECT_BLOCK", 8192)
    used = []
    real = common.write_direct
    monkeypatch.setattr(common, "write_direct", lambda path, pieces: used.append(real(path, pieces)) or used[-1])
    common.write_safetensors(str(tmp_path / "direct"), tensors, {"k": "v"})
    assert used, "the direct path was not taken"
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes()
    back = load_file(str(tmp_path / "direct"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_file_system_without_o_direct_gets_a_buffered_write(tmp_path, monkeypatch, refused_at):
    """tmpfs and some network file systems answer O_DIRECT with EINVAL, at open or at the first write."""
    monkeypatch.setattr(os, "O_DIRECT", getattr(os, "O_DIRECT", 0o40000), raising=False)
    real_open, real_write = os.open, os.write
    direct_fds = set()

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "write", fake_write)
    monkeypatch.setattr(common, "DIRECT_WRITE_MIN_BYTES", 0)
    tensors = {"x": torch.randn(5000)}
    assert common.write_direct(str(tmp_path / "probe"), [b"abc"]) is False
    common.write_safetensors(str(tmp_path / "x.safetensors"), tensors)
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["x"], tensors["x"])


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_loads_to_the_same_weights(tmp_path, tied):
    tok = common.char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    common.save_checkpoint(model, tok, str(tmp_path / "ckpt"))
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not tied)          # a tied copy is not stored twice
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    assert (again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()) == tied


def test_background_save_writes_what_a_plain_save_writes(tmp_path, models):
    model = common.load_model(models["policy"], "cpu")
    tok = common.load_tokenizer(models["policy"])
    common.save_checkpoint(model, tok, str(tmp_path / "plain"))
    writer, buffers = common.BackgroundWriter(), {}
    snap = common.snapshot(common.checkpoint_tensors(model), buffers)
    writer.submit(lambda: common.save_checkpoint(model, tok, str(tmp_path / "background"), weights=snap))
    with torch.no_grad():
        for p in model.parameters():          # training goes on while the thread writes the snapshot
            p.add_(1.0)
    writer.wait()
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == \
        (tmp_path / "background" / "model.safetensors").read_bytes()

    writer.submit(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError):
        writer.wait()                          # the thread's error reaches the caller


@pytest.mark.parametrize("code, text", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")])
def test_a_failed_write_keeps_the_last_good_files(tmp_path, models, monkeypatch, code, text):
    model = common.load_model(models["policy"], "cpu")
    tok = common.load_tokenizer(models["policy"])
    ckpt = tmp_path / "ckpt"
    common.save_checkpoint(model, tok, str(ckpt))
    before = (ckpt / "model.safetensors").read_bytes()
    common.save_tensors(str(tmp_path / "r.safetensors"), {"x": torch.ones(3)}, "t/1", {})

    def full(path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(code, text)

    monkeypatch.setattr(common, "write_safetensors", full)
    with pytest.raises(common.StageError, match=f"{text}.*still holds the last complete one"):
        common.save_checkpoint(model, tok, str(ckpt))
    with pytest.raises(common.StageError, match=f"r.safetensors: cannot write \\({text}\\)"):
        common.save_tensors(str(tmp_path / "r.safetensors"), {"x": torch.zeros(3)}, "t/1", {})
    assert (ckpt / "model.safetensors").read_bytes() == before
    assert torch.equal(load_file(tmp_path / "r.safetensors")["x"], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "r.safetensors"]          # no temporary left behind


def test_a_replace_cut_short_is_recovered(tmp_path, models):
    model = common.load_model(models["policy"], "cpu")
    tok = common.load_tokenizer(models["policy"])
    ckpt = tmp_path / "ckpt"
    common.save_checkpoint(model, tok, str(ckpt))
    os.rename(ckpt, str(ckpt) + ".old")        # a kill between replace_dir's two renames
    assert common.load_model(str(ckpt), "cpu") is not None
    assert ckpt.is_dir() and not os.path.exists(str(ckpt) + ".old")
