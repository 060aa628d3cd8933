"""Stage 1 of GRPO: sample G completions for each of B prompts from the policy π_old.

Reads   --prompts FILE   JSON lines; each record has "prompt" (a string used as is) or
                         "messages" (a chat, rendered with the tokenizer's chat template and the
                         generation prompt). Other fields travel to samples.jsonl untouched.
                         The B records starting at --start are used, in file order.
Writes  --out DIR/rollouts.safetensors   (schema rollouts/1, N = B·G rows; docs/formats.md)
            prompt_ids [N, P] int64 (left-padded)    prompt_mask [N, P] bool
            completion_ids [N, T] int64 (right-padded)  completion_mask [N, T] bool
            group_ids [N] int64    old_logprobs [N, T] f32
            ref_logprobs [N, T] f32 (with --ref-model)    truncated [N] bool
            values [N, T] f32 (with --critic: PPO's V_t, read where the logits of token t are)
            sampler_logprobs [N, T] f32 (with --top-k/--top-p/--min-p or --engine vllm: log q of the draw)
            loss_mask [N, T] bool (with --env: true on the policy's tokens, false on the environment's)
        --out DIR/samples.jsonl  one object per row: group, prompt, completion, and the record's fields
                                 (with --env: the turns and the environment's fields too)

Example:
    python sample.py --model ckpt/ --prompts prompts.jsonl --out it0/ --group-size 8 \\
        --num-prompts 4 --max-new-tokens 64 --temperature 1.0 --seed 0 --ref-model ckpt/

Choices where the paper and docs/formats.md are silent (docs/numerics.md and performance.md say why):
- Tokens are drawn at τ from the distribution --top-k, --top-p and --min-p truncate (in that order,
  all off by default); log π_old is the untruncated log_softmax(logits / τ), as TRL and verl record
  it, because the update's log π_θ is that distribution (ρ = 1 on-policy). update.py --rollout-is
  reweighs the truncation from sampler_logprobs, log q of the draw.
- The sampler is a short KV-cache loop rather than `model.generate`, so the code shows which
  distribution each token came from; log π_old comes from the very logits it samples from, through
  modeling.logprobs_from_logits, update.py's function. grpo/models/fast_decode.py makes it fast (packed
  weights, an in-place cache, the draw a batch at once): rounding only, the same tokens for a seed.
- Each distinct prompt of a micro-batch is prefilled once and its KV cache expanded to its G rows
  (modeling.prefill), the reference and critic passes alike; --no-prefix-sharing: the same numbers.
- completion_mask is true up to and including the first EOS (the tokenizer's and the model's EOS
  ids), never read off the pad id, which a model may sample; T is trimmed to the longest completion.
- --engine vllm draws with vLLM (grpo/models/vllm_engine.py); log π_old is then the policy's forward
  over the draws (modeling.rollout_logprobs) and the engine's log-probs are sampler_logprobs.
- --env SPEC plays episodes (docs/environments.md): each policy turn is sampled as above from the
  prompt and every turn before it, prefilled anew, and the environment's reply is tokenized once and
  appended: no id is ever re-tokenized. --max-new-tokens is the budget of all turns together.
- All rows come from one seeded generator in --micro-batch-size chunks: reproducible for a seed and
  micro-batch size. Under torchrun rank r samples a contiguous share of whole groups with the seed
  distributed.rank_seed(seed, r), and rank 0 writes them all.
"""

import argparse
import os
import time

import torch
from tqdm import tqdm

from grpo import lora, settings
from grpo.cli import ArgumentParser, add_runtime_flags, run_cli
from grpo.disk import files, outputs, provenance
from grpo.loop.rollouts import sample_rows, sharded, stack_completions
from grpo.models import distributed, fast_decode, loading, modeling, vllm_engine
from grpo.models.fast_decode import draw
from grpo.rewards import environments, prompting
from grpo.settings import above, at_least, between


# ----------------------------------------------------------------------------------------
# The algorithm: one completion per row, token by token from softmax(logits / τ)

def truncate(z, top_k=0, top_p=1.0, min_p=0.0):
    """The logits at τ, z [n, V], with the tokens that top-k, then top-p (the smallest set of most
    likely tokens whose probability reaches p), then min-p (tokens below min_p × the most likely
    one's probability) leave out set to −inf, in that order (as transformers' warpers). 0, 1.0, 0.0:
    off."""
    if 0 < top_k < z.shape[-1]:         # k at least the vocabulary keeps every token, as transformers does
        keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, z.topk(top_k, dim=-1).indices, True)
        z = z.masked_fill(~keep, -torch.inf)                                        # exactly k tokens
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)                           # [n, V]
        p = sorted_z.softmax(-1)                                                    # [n, V]
        outside = p.cumsum(-1) - p >= top_p                  # the more likely ones already reach p
        z = z.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), -torch.inf)
    if min_p > 0.0:
        p = z.softmax(-1)                                                           # [n, V]
        z = z.masked_fill(p < min_p * p.max(-1, keepdim=True).values, -torch.inf)
    return z


@torch.inference_mode()
def sample_completions(model, prompt_ids, prompt_mask, max_new_tokens, temperature, eos_ids, pad_id,
                       generator, progress=None, share_prefix=True, top_k=0, top_p=1.0, min_p=0.0, stop=None):
    """Draw one completion per row: token t ~ q_t = softmax(truncate(logits_t / τ)), top-k, top-p and
    min-p applied after τ; its log-prob is the model's at τ, log_softmax(logits_t / τ), untruncated;
    with a truncation on, also log q_t(token), the distribution it was drawn from (renormalised).

    prompt_ids/prompt_mask [n, P]. Returns the rollouts' completion columns: completion_ids [n, T],
    completion_mask [n, T], old_logprobs [n, T] (at τ), truncated [n] and, with a truncation,
    sampler_logprobs [n, T]; T <= max_new_tokens. `stop(tokens)`, given the list of tokens [n] drawn so
    far, says which rows have just written a stop string [n] (an episode's tool call): it ends them as EOS.
    """
    n = prompt_ids.shape[0]
    eos = torch.tensor(eos_ids, dtype=torch.long, device=prompt_ids.device)
    # Each distinct prompt once, its KV cache expanded to its rows (or every row's own prompt), with
    # room for the completion: a step writes its keys and values in place (grpo/models/fast_decode.py).
    room = max_new_tokens - 1
    prefilled = share_prefix and modeling.prefill(model, prompt_ids, prompt_mask, room=room)
    out, cache, prompt_attention, position_ids = prefilled or modeling.prefill(
        model, prompt_ids, prompt_mask, share_prefix=False, room=room)
    attention_mask = torch.cat([prompt_attention, prompt_attention.new_ones(n, room)], dim=1)  # [n, P'+room]
    next_position = position_ids[:, -1:] + 1                                          # [n, 1]
    finished = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)             # EOS already sampled
    truncating = top_k > 0 or top_p < 1.0 or min_p > 0.0
    tokens, masks, logprobs, sampler_logprobs = [], [], [], []
    for step in range(max_new_tokens):
        logits = out[:, -1].float()                                                   # [n, V]
        z = truncate(logits / temperature, top_k, top_p, min_p)                       # [n, V]
        token = draw(torch.softmax(z, dim=-1), generator)            # [n], as torch.multinomial draws
        logprobs.append(modeling.logprobs_from_logits(logits, token, temperature))   # log π_old, [n]
        if truncating:                                                                # log q(token), [n]
            sampler_logprobs.append(torch.log_softmax(z, dim=-1).gather(-1, token[:, None]).squeeze(-1))
        masks.append(~finished)
        tokens.append(torch.where(finished, pad_id, token))
        finished = finished | torch.isin(token, eos) | (stop(tokens) if stop else False)
        if progress is not None:
            progress.update(1)
        if finished.all() or step == max_new_tokens - 1:       # no forward whose logits go unused
            break
        columns = prompt_attention.shape[1] + step + 1                  # the prompt and tokens 0..step
        with modeling.autocast(prompt_ids.device):
            out = model(input_ids=token[:, None], attention_mask=attention_mask[:, :columns],
                        position_ids=next_position, past_key_values=cache, use_cache=True).logits
        next_position = next_position + 1
    completion_mask = torch.stack(masks, dim=1)                                       # [n, T]
    columns = {"completion_ids": torch.stack(tokens, dim=1), "completion_mask": completion_mask,
               "old_logprobs": torch.stack(logprobs, dim=1).masked_fill(~completion_mask, 0.0),  # [n, T]
               "truncated": ~finished}                                                # [n]
    if truncating:
        columns["sampler_logprobs"] = torch.stack(sampler_logprobs, dim=1).masked_fill(~completion_mask, 0.0)
    return columns


# ----------------------------------------------------------------------------------------
# The loop: G completions per prompt, log π_ref and V_t beside them; under torchrun, shares of groups

def rollout(policy, tokenizer, records, args, ref_model=None, generator=None, where=("prompts", None),
            critic=None, engine=None):
    """Sample G completions for each record; return (rollouts.safetensors' tensors, samples.jsonl rows).
    log π_ref comes from `ref_model` and PPO's V_t from `critic`, when given. With a vLLM `engine`
    (grpo/models/vllm_engine.py) the engine draws them and log π_old is the policy's forward pass."""
    device = next(policy.parameters()).device
    max_len = prompting.prompt_room(policy, args.max_new_tokens)
    path, lines = where                                 # the records' file and lines, for messages
    texts, token_lists = prompting.render_prompts(records, tokenizer, path, max_len, lines)
    G = args.group_size
    prompt_ids, prompt_mask = prompting.left_pad(token_lists, tokenizer.pad_token_id)  # [B, P]
    prompt_ids = prompt_ids.repeat_interleave(G, dim=0).to(device)                    # [N, P]
    prompt_mask = prompt_mask.repeat_interleave(G, dim=0).to(device)                  # [N, P]
    group_ids = torch.arange(len(records)).repeat_interleave(G)                       # [N]
    N = prompt_ids.shape[0]
    eos_ids = [] if args.ignore_eos else loading.eos_token_ids(tokenizer, policy)
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(args.seed)

    envs = None
    if engine is not None:                            # vLLM draws them all (grpo/models/vllm_engine.py)
        parts = [engine.sample(prompt_ids, prompt_mask, G, eos_ids, tokenizer.pad_token_id, generator,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, min_p=args.min_p, ignore_eos=args.ignore_eos)]
    else:                                             # per micro-batch: its completion columns
        parts, turns = [], []
        envs = args.env and environments.make(args.env, records, G)        # one per row, reset with its record
        ends = envs and environments.turn_ends(tokenizer, getattr(envs[0], "stop", None) or ())
        chats = [prompting.chat_of(record) is not None for record in records for _ in range(G)]        # [N]
        with (tqdm(desc="sample", unit="tok", leave=False, disable=None if distributed.is_main() else True) as bar,
              fast_decode.decode_linears(policy, min(N, args.micro_batch_size or N))):  # CPU: oneDNN, packed
            for rows in distributed.row_slices(N, args.micro_batch_size):
                def sample_turn(ids, mask, rooms=None):       # an episode's turn: rooms [n] of its budget
                    return sample_completions(
                        policy, ids, mask, args.max_new_tokens if rooms is None else int(rooms.max()),
                        args.temperature, eos_ids, tokenizer.pad_token_id, generator, progress=bar,
                        share_prefix=args.prefix_sharing, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        stop=None if rooms is None else lambda tokens: ends(tokens, rooms))
                if not envs:
                    parts.append(sample_turn(prompt_ids[rows], prompt_mask[rows]))
                    continue
                columns, played = environments.sample_episodes(
                    prompt_ids[rows], prompt_mask[rows], envs[rows], chats[rows], tokenizer, eos_ids,
                    args.max_new_tokens, args.max_turns, sample_turn)
                parts.append(columns)
                turns += played
    tensors = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "group_ids": group_ids,
               **stack_completions(parts, tokenizer.pad_token_id)}                       # [N, T] and [N]
    if engine is not None:                             # the trainer's forward, as update.py computes it
        tensors["old_logprobs"] = modeling.rollout_logprobs(policy, tensors, args.temperature,
                                                            args.micro_batch_size, args.prefix_sharing)
    if ref_model is not None:
        tensors["ref_logprobs"] = modeling.rollout_logprobs(ref_model, tensors, args.temperature,
                                                            args.micro_batch_size, args.prefix_sharing)
    if critic is not None:
        tensors["values"] = modeling.rollout_values(critic, tensors, args.micro_batch_size,
                                                    args.prefix_sharing)                       # [N, T]
    samples = sample_rows(tensors, records, texts, tokenizer)
    if envs:
        samples = [environments.episode_row(s, t, e) for s, t, e in zip(samples, turns, envs)]
    return tensors, samples


def rollout_sharded(policy, tokenizer, records, args, ref_model=None, where=("prompts", None), critic=None,
                    engine=None):
    """rollout() under torchrun: rank r samples a contiguous share of whole groups with the seed
    distributed.rank_seed(seed, r), and every rank gets all rows back (grpo/loop/rollouts.py:sharded)."""
    def share_of(share, generator):
        return rollout(policy, tokenizer, records[share], args, ref_model, generator,
                       (where[0], where[1] and where[1][share]), critic, engine)
    return sharded(share_of, len(records), args.seed, tokenizer.pad_token_id, next(policy.parameters()).device)


# ----------------------------------------------------------------------------------------
# Reading and writing files

def write_outputs(out_dir, tensors, samples, args, policy_fingerprint=None, tokenizer_fingerprint=None,
                  policy_version=None):
    """samples.jsonl, then rollouts.safetensors, each renamed into place when complete; the rollouts,
    which every later stage opens first, appear last. Their metadata's made_from names the policy that
    sampled them, its tokenizer and their samples.jsonl rows (grpo/disk/provenance.py); train.py's
    record the policy's version too (its updates so far)."""
    files.make_dir(out_dir)
    files.write_jsonl(os.path.join(out_dir, "samples.jsonl"), samples)
    made_from = {"policy": policy_fingerprint, "tokenizer": tokenizer_fingerprint,
                 "samples": provenance.samples_digest(samples)}
    version = {} if policy_version is None else {"policy_version": policy_version}
    files.save_tensors(os.path.join(out_dir, "rollouts.safetensors"), tensors, files.ROLLOUTS[0], vars(args),
                       made_from=made_from, **version)


# ----------------------------------------------------------------------------------------
# The command line

def build_parser():
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    paths = p.add_argument_group("files")
    paths.add_argument("--model", required=True, help="policy π_old (π_θ before this update): folder or Hub id")
    paths.add_argument("--prompts", required=True, help="JSON-lines prompts ('prompt' or 'messages' per record)")
    paths.add_argument("--out", required=True, help="output folder for rollouts.safetensors and samples.jsonl")
    paths.add_argument("--ref-model", default=None, help="π_ref: the frozen reference model's folder or Hub id")
    paths.add_argument("--critic", default=None, help="PPO only: the critic V, whose V_t go into 'values'")
    draws = p.add_argument_group("the algorithm: G completions of B prompts")
    draws.add_argument("--group-size", type=int, default=8, help="G: completions sampled per prompt (default 8)")
    draws.add_argument("--num-prompts", type=int, default=None, help="B: prompts (default: all from --start)")
    draws.add_argument("--start", type=int, default=0, help="index of the first record to use (default 0)")
    draws.add_argument("--max-new-tokens", type=int, default=128, help="L_max: completion length limit (128)")
    draws.add_argument("--temperature", type=float, default=1.0, help="τ: sampling and log-prob temperature (1)")
    draws.add_argument("--top-k", type=int, default=0, metavar="K", help="K: the K likeliest tokens, after τ (0: all)")
    draws.add_argument("--top-p", type=float, default=1.0, metavar="P", help="P: nucleus, after top-k (1.0: all)")
    draws.add_argument("--min-p", type=float, default=0.0, metavar="M", help="M: min-p, after top-p (0: none)")
    draws.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    draws.add_argument("--engine", choices=["sampler", "vllm"], default="sampler",
                       help="what draws the tokens: the project's sampler (default) or vLLM")
    draws.add_argument("--env", default=None, metavar="SPEC",
                       help="episodes with an environment: calculator, module:NAME or file.py:NAME")
    draws.add_argument("--max-turns", type=int, default=4, help="policy turns an episode may take, with --env (4)")
    draws.add_argument("--ignore-eos", action="store_true",
                       help="for benchmarks: EOS does not end a completion, every one has L_max tokens")
    mem = p.add_argument_group("memory and devices")
    mem.add_argument("--micro-batch-size", type=int, default=0, help="rows per forward pass (default 0: all N)")
    mem.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=True,
                     help="prefill each distinct prompt once for its G rows (default; the same numbers)")
    add_runtime_flags(mem)
    lora.add_flags(p.add_argument_group("LoRA"))
    provenance.add_flag(paths)
    return p


# What each setting may be, checked before anything is read or written (train.py's runs too).
RULES = {"group_size": at_least(1), "num_prompts": at_least(1), "start": at_least(0),
         "max_new_tokens": at_least(1), "temperature": above(0), "top_k": at_least(0),
         "top_p": between(0, 1, lo_open=True), "min_p": between(0, 1), "micro_batch_size": at_least(0),
         "max_turns": at_least(1), **lora.RULES}


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    settings.check(args, RULES)
    vllm_engine.check(args)
    if args.env:
        environments.load_env(args.env)              # a bad SPEC stops here, before any model is loaded
    return args


def main(argv=None):
    args = parse_args(argv)
    outputs.check_dir(args.out, "sample.py")
    records, lines = files.select_records(args.prompts, args.start, args.num_prompts)
    args.num_prompts = len(records)
    device = distributed.init_distributed(args.device)
    tokenizer = loading.load_tokenizer(args.model, args.trust_remote_code)
    policy = lora.load_policy(args.model, device, args)
    provenance.check_tokenizers(tokenizer, {"reference": args.ref_model, "critic": args.critic},
                                args.allow_mismatch, args.trust_remote_code)
    ref_model = args.ref_model and lora.load_reference(args.ref_model, policy, device, args.trust_remote_code)
    critic = loading.load_critic(args.critic, device, args.trust_remote_code) if args.critic else None

    engine = (vllm_engine.start(policy, lora.plain_model_dir(args.model), args.max_new_tokens,
                                len(records) * args.group_size) if args.engine == "vllm" else None)

    t0 = time.perf_counter()
    try:
        tensors, samples = rollout_sharded(policy, tokenizer, records, args, ref_model, (args.prompts, lines),
                                           critic, engine)
    finally:
        if engine is not None:
            engine.close()
    seconds = time.perf_counter() - t0
    if not distributed.is_main():
        return
    # Marked first: a folder cut short by Ctrl-C between the two files is still this command's to redo.
    outputs.mark_dir(args.out, "sample.py", ["rollouts.safetensors", "samples.jsonl"])
    write_outputs(args.out, tensors, samples, args, provenance.fingerprint(policy),
                  provenance.tokenizer_fingerprint(tokenizer))

    lengths = tensors["completion_mask"].sum(-1).float()
    print(f"sampled {len(samples)} completions ({len(records)} prompts × G={args.group_size}) in "
          f"{seconds:.1f}s, {lengths.sum().item() / seconds:.0f} tok/s; "
          f"mean length {lengths.mean().item():.1f}, "
          f"truncated {tensors['truncated'].float().mean().item():.0%}; wrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
