"""LoRA through peft: the policy trained as low-rank adapters on frozen base weights, with π_ref the
base itself (the adapters disabled), so a run holds one copy of the weights.

A LoRA checkpoint is peft's own adapter files (adapter_config.json, naming the base model, and
adapter_model.safetensors), the tokenizer, and the AdamW state of the adapter's parameters.
`python -m grpo.lora --merge ADAPTER --out DIR` writes the merged weights as a plain Hugging Face
checkpoint, for evaluation or serving.

Choices: the adapters' A matrices are drawn from a generator seeded 0 (B starts at 0, so a fresh
policy computes exactly what its base does), so every stage that adds adapters to a base adds the
same ones; --lora-dropout acts in the update's forward passes only (sampling, the reference and a
recomputed π_old run without it), so with dropout the first step's ratio is not exactly 1.
"""

import argparse
import contextlib
import os
import sys

import torch

from grpo.cli import StageError, run_cli
from grpo.disk import files, outputs
from grpo.models import loading
from grpo.settings import above, at_least, between

# What the LoRA flags may be, in the RULES of every stage that takes them.
RULES = {"lora_r": at_least(0), "lora_alpha": above(0), "lora_dropout": between(0, 1, hi_open=True)}


def add_flags(parser):
    """--lora-r and its companions, on every stage that loads the policy."""
    parser.add_argument("--lora-r", type=int, default=0, metavar="R",
                        help="R: train LoRA adapters of rank R on the frozen policy instead of every weight\n"
                             "(peft); π_ref is the base with the adapters disabled (default 0: full fine-tune)")
    parser.add_argument("--lora-alpha", type=float, default=None, metavar="α",
                        help="α: the adapters' scale is α/R (default 2R)")
    parser.add_argument("--lora-dropout", type=float, default=0.0,
                        help="dropout on the adapters' input in the update's forward passes (default 0)")
    parser.add_argument("--lora-target-modules", nargs="+", action="extend", default=None, metavar="NAME",
                        help="the modules that get adapters (default: every linear layer of the decoder,\n"
                             "peft's all-linear)")


def is_adapter(path):
    """Whether a model folder holds LoRA adapters (peft's adapter_config.json) rather than a model."""
    return os.path.isfile(os.path.join(loading.model_dir(path), "adapter_config.json"))


def base_of(path):
    """The base model an adapter folder names."""
    return files.read_json(os.path.join(loading.model_dir(path), "adapter_config.json"))["base_model_name_or_path"]


def plain_model_dir(path):
    """The folder of the plain model under `path`: its base for an adapter folder, else itself."""
    return loading.model_dir(base_of(path) if is_adapter(path) else path)


def load_policy(path, device, args):
    """The policy of `path`: a plain model; the base and adapters of an adapter folder; or, with --lora-r R
    > 0 and a plain folder, that model with fresh adapters. The adapters take gradients wherever they
    are loaded, in sample.py too: torch's matmul folds batch dimensions only for weights that do not,
    which changes the rounding, and a replayed stage must compute what the run computed."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if is_adapter(path):
        config = LoraConfig.from_pretrained(loading.model_dir(path))
        if getattr(args, "lora_r", 0) not in (0, config.r):
            raise StageError(f"{path}: holds LoRA adapters of rank {config.r}, not --lora-r {args.lora_r}")
        alpha = getattr(args, "lora_alpha", None)
        if alpha is not None and alpha != config.lora_alpha:
            raise StageError(f"{path}: holds LoRA adapters with α {config.lora_alpha:g}, not --lora-alpha {alpha:g}")
        config.lora_dropout = getattr(args, "lora_dropout", config.lora_dropout)   # the flag given, not the saved
        base = loading.load_model(base_of(path), device, args.trust_remote_code)
        model = PeftModel.from_pretrained(base, loading.model_dir(path), config=config, is_trainable=True)
        return model.to(device).eval()
    model = loading.load_model(path, device, args.trust_remote_code)
    if not getattr(args, "lora_r", 0):
        given = [f for f, v in (("--lora-alpha", getattr(args, "lora_alpha", None)),
                                ("--lora-dropout", getattr(args, "lora_dropout", 0.0) or None),
                                ("--lora-target-modules", getattr(args, "lora_target_modules", None))) if v]
        if given:
            raise StageError(f"{given[0]} without --lora-r: {path} is a full model and no adapters are made; "
                             f"pass --lora-r R to train adapters of rank R")
        return model
    check_targets(model, args.lora_target_modules, path)
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r, task_type="CAUSAL_LM",
                        lora_dropout=args.lora_dropout, target_modules=args.lora_target_modules or "all-linear")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)                               # the same adapters wherever they are added
        model = get_peft_model(model, config)
    return model.to(device).eval()


def check_targets(model, targets, path):
    """Every --lora-target-modules name must name modules of the model, as peft matches them (the
    module's name, or its last dotted parts): a typo would silently leave those layers without adapters."""
    names = [name for name, _ in model.named_modules()]
    for target in targets or []:
        if not any(name == target or name.endswith("." + target) for name in names):
            linears = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                              if isinstance(m, torch.nn.Linear)})
            raise StageError(f"--lora-target-modules {target}: {path} has no module of that name (its linear "
                             f"layers: {', '.join(linears)})")


class Reference(torch.nn.Module):
    """π_ref of a LoRA policy: the policy itself with its adapters disabled, for forward passes and
    greedy answers."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.config, self.generation_config = policy.config, policy.generation_config

    def forward(self, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(**kwargs)

    def generate(self, **kwargs):
        with self.policy.disable_adapter():
            return self.policy.generate(**kwargs)

    def get_base_model(self):
        return self.policy.get_base_model()


def reference(policy, ref_path):
    """π_ref for a policy: the policy's base with its adapters disabled when `ref_path` is that base, so
    no second copy is loaded; else None (the caller loads ref_path)."""
    if loading.is_lora(policy) and os.path.realpath(loading.model_dir(ref_path)) == os.path.realpath(
            policy.peft_config["default"].base_model_name_or_path):
        return Reference(policy)
    return None


def load_reference(ref_path, policy, device, trust_remote_code=False):
    """π_ref of `ref_path`: the policy's base with its adapters disabled when the policy is a LoRA
    policy of that base (no second copy), else the model of that folder, loaded frozen."""
    return reference(policy, ref_path) or loading.load_model(ref_path, device, trust_remote_code)


@contextlib.contextmanager
def dropout(model, on, seed=0):
    """The adapters' dropout layers in training mode within the block (the model stays in eval mode),
    their masks drawn from torch's generator (and the GPU's) seeded with `seed` for the block and
    restored after: an update draws the same masks wherever the run stands, so a resume is exact."""
    layers = [m for name, m in model.named_modules() if on and ".lora_dropout." in name]
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for layer in layers:
            layer.train()
        try:
            yield
        finally:
            for layer in layers:
                layer.eval()


def merge(adapter, out, trust_remote_code=False):
    """Write the base with the adapters of `adapter` merged into its weights as a plain checkpoint."""
    from grpo.disk import checkpoints

    if not is_adapter(adapter):
        raise StageError(f"{adapter}: not a LoRA adapter folder (no adapter_config.json)")
    model = load_policy(adapter, "cpu", argparse.Namespace(trust_remote_code=trust_remote_code))
    base = model.get_base_model()
    if getattr(base.config, "tie_word_embeddings", False) and hasattr(base.get_output_embeddings(), "lora_A"):
        # Adapters on an LM head tied to the embeddings: merged into the shared matrix they would change
        # the embeddings too, so the merged model keeps the two apart.
        head = base.get_output_embeddings().base_layer
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        base.config.tie_word_embeddings = False
    merged = model.merge_and_unload()
    checkpoints.save_checkpoint(merged, loading.load_tokenizer(adapter, trust_remote_code), out,
                                command="grpo.lora --merge")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m grpo.lora", description="merge LoRA adapters into their base")
    p.add_argument("--merge", required=True, metavar="ADAPTER", help="an adapter folder (a LoRA run's policy/)")
    p.add_argument("--out", required=True, help="the folder of the merged Hugging Face checkpoint")
    p.add_argument("--trust-remote-code", action="store_true")
    args = p.parse_args(argv)
    checkpoints_out = os.path.abspath(args.out)
    outputs.check_dir(checkpoints_out, "grpo.lora --merge", apart={"--merge": args.merge})
    merge(args.merge, checkpoints_out, args.trust_remote_code)
    print(f"merged {args.merge} into {base_of(args.merge)}'s weights; wrote {checkpoints_out}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
