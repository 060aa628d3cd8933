"""Provenance: what each stage file was made from, so that files of different runs are never combined.

Each stage file's metadata holds "made_from" (docs/formats.md): rollouts name the policy that sampled
them (its fingerprint), its tokenizer (tokenizer_fingerprint) and their samples.jsonl rows (a digest
of every field that reaches a reward);
rewards name their rollouts and samples; advantages their rewards and rollouts. A reader recomputes
the digest of what it was given and refuses, in one line naming both files, inputs that do not
belong together, unless --allow-mismatch says the combination is deliberate. A file without
"made_from" (written by hand, or by an older version) is taken as it is.
"""

import hashlib
import json

import torch
from safetensors import SafetensorError, safe_open

from grpo.cli import StageError
from grpo.models import distributed

FINGERPRINT_VALUES = 64            # values of each parameter a fingerprint reads: any AdamW step moves them


def add_flag(parser):
    """--allow-mismatch, on every stage that checks what its inputs were made from."""
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="combine inputs whose metadata says they do not belong together (files of\n"
                             "other runs, rollouts of another policy, another tokenizer): deliberately")


def file_digest(path):
    """A short hash of a file's bytes: a stage file's identity (safetensors writes the same bytes for
    the same tensors and metadata)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def made_from(path):
    """The "made_from" record of a stage file's metadata ({} for a file without one)."""
    try:
        with safe_open(path, framework="pt") as f:
            record = json.loads((f.metadata() or {}).get("made_from", "{}"))
    except (OSError, SafetensorError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


# samples.jsonl's keys that the stages add after sampling (train.py's rows carry them): not the sample's.
STAGE_OUTPUTS = ("reward", "rewards", "advantage")


def samples_digest(rows):
    """A short hash of what sample.py wrote in samples.jsonl: every field of each row that reaches a
    reward (group, prompt, completion and the prompt record's own, an answer among them; not the
    STAGE_OUTPUTS), marked "2:" (files of versions before it hold a digest of group, prompt and
    completion alone, legacy_samples_digest)."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps({k: v for k, v in row.items() if k not in STAGE_OUTPUTS}, sort_keys=True).encode())
    return "2:" + h.hexdigest()[:16]


def legacy_samples_digest(rows):
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps([row.get("group"), row.get("prompt"), row.get("completion")]).encode())
    return h.hexdigest()[:16]


def digest_as_recorded(recorded, rows):
    """The digest of `rows` in the form of the `recorded` one (a file of an older version: legacy)."""
    if recorded is None:
        return None
    return samples_digest(rows) if recorded.startswith("2:") else legacy_samples_digest(rows)


def tokenizer_fingerprint(tokenizer):
    """A short hash of how a tokenizer maps text to ids: its vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps([vocab, tokenizer.all_special_tokens]).encode()).hexdigest()[:16]


@torch.no_grad()
def fingerprint(model):
    """A short hash of the function a model computes, from its weights: the first FINGERPRINT_VALUES
    values of every parameter, with its name and shape. A LoRA policy counts as its base while its
    adapters are fresh (every lora_B 0: it computes what the base does), and with its adapters once
    they moved. Cheap enough for every iteration; None for a model sharded by FSDP."""
    params = dict(distributed.unwrap(model).named_parameters())
    trained = any("lora_B" in name and p.detach().any() for name, p in params.items())
    h = hashlib.sha256()
    for name, p in params.items():
        if hasattr(p, "full_tensor"):
            return None
        if not trained and ("lora_A" in name or "lora_B" in name):
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")     # peft's names, the base's
        h.update(f"{name}|{list(p.shape)}|".encode())
        h.update(p.detach().flatten()[:FINGERPRINT_VALUES].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def check(recorded, actual, what, made, given, allow):
    """Refuse (one line naming both files) when `made` records `what` as `recorded` and the one
    `given` is `actual`; nothing to check where either is unknown or --allow-mismatch is on."""
    if allow or recorded is None or actual is None or recorded == actual:
        return
    raise StageError(f"{made}: was made from another {what} than {given} ({recorded} there, {actual} here); "
                     f"pass --allow-mismatch if combining them is deliberate")


def same_tokenizer(a, b):
    """Whether two tokenizers map text to the same ids: one vocabulary, the same special tokens."""
    return a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens


def check_tokenizers(policy_tokenizer, others, allow, trust_remote_code=False):
    """sample.py, update.py: refuse another model ({role: folder or None}: the reference, the critic)
    whose tokenizer is not the policy's (its log-probs or values would be of other token ids), unless
    `allow` (--allow-mismatch)."""
    from grpo.models import loading

    for role, path in others.items():
        if not path or allow:
            continue
        other = loading.load_tokenizer(path, trust_remote_code)
        if not same_tokenizer(policy_tokenizer, other):
            raise StageError(f"{path}: the {role}'s tokenizer is not the policy's (vocabulary of {len(other)} "
                             f"tokens, the policy's {len(policy_tokenizer)}, or other special tokens); its "
                             f"numbers would be of other token ids (--allow-mismatch to go on)")


# ----------------------------------------------------------------------------------------
# What each stage checks and records

def samples_of_rollouts(rollouts_path, samples_path, samples, allow):
    """score.py: the samples.jsonl rows must be the rollouts' own; returns the rewards' made_from."""
    recorded = made_from(rollouts_path).get("samples")
    check(recorded, digest_as_recorded(recorded, samples), "samples.jsonl", rollouts_path, samples_path, allow)
    return rewards_made_from(rollouts_path, samples)


def rewards_made_from(rollouts_path, samples):
    """A rewards file's made_from: its rollouts file and samples.jsonl rows."""
    return {"rollouts": file_digest(rollouts_path), "samples": samples_digest(samples)}


def rewards_of_rollouts(rewards_path, rollouts_path, allow):
    """advantage.py: the rewards (and, for gae, the rollouts it reads) belong together; returns the
    advantages' made_from, which names the rollouts the update must be given."""
    rollouts = made_from(rewards_path).get("rollouts")
    if rollouts_path:
        given = file_digest(rollouts_path)
        check(rollouts, given, "rollouts", rewards_path, rollouts_path, allow)
        rollouts = rollouts or given
    return advantages_made_from(rewards_path, rollouts)


def advantages_made_from(rewards_path, rollouts):
    """An advantages file's made_from: its rewards file and the rollouts' hash (`rollouts`)."""
    return {"rewards": file_digest(rewards_path), "rollouts": rollouts}


def advantages_of_rollouts(advantages_path, rollouts_path, allow):
    """update.py: the advantages were computed from these rollouts' rewards."""
    check(made_from(advantages_path).get("rollouts"), file_digest(rollouts_path), "rollouts", advantages_path,
          rollouts_path, allow)


def tokenizer_of_rollouts(rollouts_path, tokenizer, model_path, allow):
    """update.py: the rollouts' token ids are those of --model's tokenizer."""
    check(made_from(rollouts_path).get("tokenizer"), tokenizer_fingerprint(tokenizer), "tokenizer",
          rollouts_path, f"{model_path}'s", allow)


def policy_of_rollouts(rollouts_path, policy, model_path, allow):
    """update.py without --old-logprobs recompute: --model is the policy that sampled the rollouts, or
    their log π_old is another model's."""
    recorded = made_from(rollouts_path).get("policy")
    if allow or recorded is None or recorded == fingerprint(policy):
        return
    raise StageError(f"{rollouts_path}: was sampled by another policy than {model_path} (their log π_old is "
                     f"not this model's); pass the policy that sampled them, --old-logprobs recompute to "
                     f"train on them off-policy, or --allow-mismatch")
