#!/usr/bin/env python3
"""Train the draft model for speculative decoding that ships in bloompeer/demo_model/draft/.

A draft proposes tokens that the demo model (the target) then checks in one pass through the
swarm; a proposal is worth something only if it is the token the target would have chosen. So the
draft is distilled from the target rather than trained on the text: its loss is the divergence from
the target's next-token distribution at every position of the training text, plus the
cross-entropy to the target's own greedy choice there. It has the target's tokenizer and vocab,
and starts as an early exit of the target (its embeddings, first --n-layer blocks and final layer
norm), which already agrees with it on many tokens.

One command, CPU only, seeded and reproducible on the same library versions and thread count:

    nice -n 10 python scripts/train_draft_model.py

Corpus and split are those of scripts/train_demo_model.py (its functions, imported), so the draft
never sees the validation text either. The draft is saved (float16, loadable by
BloomForCausalLM.from_pretrained and bloompeer.blocks.open_checkpoint) every --save-every steps,
so a run stopped early leaves a usable draft, and when --max-minutes of training have passed the
loop stops and saves what it has. generation_config.json carries the assisted-generation settings
(num_assistant_tokens and its schedule) that benchmarks/draft_acceptance.py found best; transformers
reads them from the assistant's generation config. The model card, draft/README.md, is written by
hand from this script's output and that benchmark's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_demo_model import (  # noqa: E402  (a sibling script, not a package)
    BOS_ID, DEFAULT_OUTPUT as DEMO_MODEL_DIR, EOS_ID, PAD_ID, adamw, batches, encode_stream, load_corpus_split,
    log, lr_at, mark_config_float32, optimizer_step, start_run)

DEFAULT_OUTPUT = DEMO_MODEL_DIR / "draft"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Distill a small BLOOM draft model from the bloompeer demo model, for speculative decoding, "
                    "on the demo model's training split, on CPU, reproducibly. The defaults are the settings of "
                    "the shipped draft.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", type=Path, default=DEMO_MODEL_DIR, help="the model the draft proposes tokens for")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="directory to write the draft into")
    parser.add_argument("--seed", type=int, default=1234, help="seed for data order (and weights, with --init random)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (results are bit-identical only for the same value)")
    parser.add_argument("--val-fraction", type=float, default=0.04,
                        help="as in train_demo_model.py: must be the target's, so that validation stays unseen")
    parser.add_argument("--n-layer", type=int, default=2, help="number of BLOOM blocks of the draft")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="hidden size (default: the target's; any other value needs --init random)")
    parser.add_argument("--n-head", type=int, default=None, help="attention heads (default: the target's)")
    parser.add_argument("--init", choices=["target", "random"], default="target",
                        help="target: start from the target's embeddings, first blocks and final layer norm")
    parser.add_argument("--context", type=int, default=256, help="training sequence length in tokens")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=30, help="linear warmup steps before the cosine decay")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of the peak")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (matrices only)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--hard-weight", type=float, default=0.5,
                        help="loss = (1 - w) * KL(target || draft) + w * cross-entropy to the target's argmax")
    parser.add_argument("--log-every", type=int, default=20, help="print the train loss every N steps")
    parser.add_argument("--eval-every", type=int, default=100,
                        help="print agreement with the target on part of the validation split every N steps")
    parser.add_argument("--save-every", type=int, default=100, help="save the draft every N steps")
    parser.add_argument("--max-minutes", type=float, default=35.0,
                        help="stop the training loop after this many minutes and save (0: no limit)")
    parser.add_argument("--num-assistant-tokens", type=int, default=6,
                        help="draft tokens per verify pass, written to generation_config.json")
    parser.add_argument("--num-assistant-tokens-schedule", choices=["constant", "heuristic"], default="constant",
                        help="how transformers adapts that number between passes, written to generation_config.json")
    parser.add_argument("--assistant-confidence-threshold", type=float, default=0.0,
                        help="stop drafting when the draft's top probability falls below this (0: never), "
                             "written to generation_config.json")
    parser.add_argument("--rscript", default="Rscript", help="R interpreter used to read the corpus")
    return parser.parse_args(argv)


def build_draft(target, args):
    """A BLOOM with the target's vocab and special tokens; with --init target, its early exit."""
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    hidden = args.hidden_size or target.config.hidden_size
    heads = args.n_head or target.config.n_head
    if args.init == "target" and (hidden != target.config.hidden_size or args.n_layer > target.config.n_layer):
        raise SystemExit("error: --init target needs the target's hidden size and at most its number of blocks; "
                         "use --init random for another shape")
    config = BloomConfig(vocab_size=target.config.vocab_size, hidden_size=hidden, n_layer=args.n_layer, n_head=heads,
                         pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, hidden_dropout=0.0,
                         attention_dropout=0.0, tie_word_embeddings=True,
                         layer_norm_epsilon=target.config.layer_norm_epsilon)
    torch.manual_seed(args.seed)
    draft = BloomForCausalLM(config)
    if args.init == "target":
        source = target.state_dict()
        kept = {name: value for name, value in source.items()
                if not name.startswith("transformer.h.") or int(name.split(".")[2]) < args.n_layer}
        missing, unexpected = draft.load_state_dict(kept, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        draft.tie_weights()
    return draft


def distill_loss(draft_logits, target_logits, hard_weight: float):
    import torch.nn.functional as F

    vocab = draft_logits.size(-1)
    draft_logp = F.log_softmax(draft_logits.float().reshape(-1, vocab), dim=-1)
    target_logp = F.log_softmax(target_logits.float().reshape(-1, vocab), dim=-1)
    soft = F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")
    hard = F.nll_loss(draft_logp, target_logp.argmax(-1))
    return (1 - hard_weight) * soft + hard_weight * hard


def agreement(draft, target, streams: list[list[int]], context: int, max_tokens: int | None = None) -> dict:
    """Teacher-forced, over validation text: how often the draft's argmax is the target's (the chance
    that a proposal is accepted, were the text the target's own), and the mean KL(target || draft)."""
    import torch
    import torch.nn.functional as F

    windows = [s[i:i + context] for s in streams for i in range(0, len(s), context) if len(s[i:i + context]) > 1]
    same = total = 0
    kl = 0.0
    draft.eval()
    with torch.no_grad():
        for window in windows:
            ids = torch.tensor([window])
            d = F.log_softmax(draft(input_ids=ids).logits[0].float(), -1)
            t = F.log_softmax(target(input_ids=ids).logits[0].float(), -1)
            same += int((d.argmax(-1) == t.argmax(-1)).sum())
            kl += float(F.kl_div(d, t, log_target=True, reduction="sum"))
            total += len(window)
            if max_tokens and total >= max_tokens:
                break
    return {"top1": same / total, "kl": kl / total, "tokens": total}


def save_draft(draft, args, output: Path, status: dict) -> None:
    """float16 weights, the target's tokenizer, and the assisted-generation settings; config says float32
    (like the demo model's), so dtype="auto" loads it in float32 on CPU."""
    import copy

    import torch
    from transformers import GenerationConfig

    output.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(draft).to(torch.float16)
    half.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        num_assistant_tokens=args.num_assistant_tokens,
        num_assistant_tokens_schedule=args.num_assistant_tokens_schedule,
        assistant_confidence_threshold=args.assistant_confidence_threshold)
    half.save_pretrained(output)
    (output / "model.safetensors").chmod(0o644)
    mark_config_float32(output)
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.target / name, output / name)
    (output / "training.json").write_text(json.dumps(status, indent=2, sort_keys=True) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    wall_start = time.time()
    start_run(args)

    import torch
    from transformers import AutoTokenizer, BloomForCausalLM

    corpus = load_corpus_split(args.rscript, args.val_fraction)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = BloomForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    train_ids = torch.tensor(encode_stream(tokenizer, corpus.train_docs, add_bos_eos=True), dtype=torch.long)
    val_streams = [encode_stream(tokenizer, [doc], add_bos_eos=False) for doc in corpus.val_docs]
    log(f"target: {args.target} ({sum(p.numel() for p in target.parameters()):,} parameters); "
        f"train {len(train_ids):,} tokens, validation {sum(map(len, val_streams)):,} tokens")

    draft = build_draft(target, args)
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft: BLOOM n_layer={draft.config.n_layer} hidden={draft.config.hidden_size} heads={draft.config.n_head} "
        f"vocab={draft.config.vocab_size}, init {args.init}: {n_params:,} parameters")
    quick = agreement(draft, target, val_streams, args.context, max_tokens=4096)
    log(f"before training: top-1 agreement {quick['top1']:.3f}, KL {quick['kl']:.3f} (first {quick['tokens']} "
        f"validation tokens)")
    history = [{"step": 0, **quick}]

    optimizer = adamw(draft, args)
    data = batches(train_ids, args.context, args.batch_size, args.seed)
    tokens_per_step = args.context * args.batch_size
    log(f"training: {args.steps} steps x {args.batch_size} x {args.context} tokens "
        f"= {args.steps * tokens_per_step / len(train_ids):.2f} epochs, {args.threads} thread(s), "
        f"at most {args.max_minutes:g} min")

    def status(step: int, finished: bool) -> dict:
        return {"command": command_line(args), "steps_done": step, "steps_planned": args.steps,
                "finished": finished, "train_minutes": round((time.time() - train_start) / 60, 2),
                "parameters": n_params, "agreement_history": history}

    train_start = time.time()
    running, running_n, step = 0.0, 0, 0
    stopped_early = False
    for step in range(1, args.steps + 1):
        lr = lr_at(step - 1, args.steps, args.lr, args.warmup, args.min_lr_ratio)
        epoch, batch = next(data)
        with torch.no_grad():
            target_logits = target(input_ids=batch).logits
        draft.train()
        loss = distill_loss(draft(input_ids=batch).logits, target_logits, args.hard_weight)
        optimizer_step(draft, optimizer, loss, lr, args.grad_clip)
        running += loss.item()
        running_n += 1
        elapsed = time.time() - train_start
        if step % args.log_every == 0 or step == args.steps:
            log(f"step {step:5d}/{args.steps}  epoch {epoch}  distill loss {running / running_n:.4f}  lr {lr:.2e}  "
                f"{step * tokens_per_step / elapsed:,.0f} tok/s  elapsed {elapsed:7.1f}s")
            running, running_n = 0.0, 0
        out_of_time = bool(args.max_minutes) and elapsed > args.max_minutes * 60
        if step < args.steps and (step % args.eval_every == 0 or out_of_time):
            quick = agreement(draft, target, val_streams, args.context, max_tokens=4096)
            history.append({"step": step, **quick})
            log(f"step {step:5d}  top-1 agreement {quick['top1']:.3f}  KL {quick['kl']:.3f}")
        if step < args.steps and (step % args.save_every == 0 or out_of_time):
            save_draft(draft, args, args.output, status(step, finished=False))
            log(f"step {step:5d}  saved to {args.output}")
        if out_of_time and step < args.steps:
            log(f"stopping after {step} of {args.steps} steps: --max-minutes {args.max_minutes:g} reached")
            stopped_early = True
            break
    train_time = time.time() - train_start

    # Evaluate the draft as saved (float16 weights), in float32.
    draft = draft.to(torch.float16).to(torch.float32)
    final = agreement(draft, target, val_streams, args.context)
    history.append({"step": step, **final})
    log(f"validation (whole split, float16 weights): top-1 agreement {final['top1']:.3f}, KL {final['kl']:.3f} "
        f"over {final['tokens']:,} tokens")
    save_draft(draft, args, args.output, status(step, finished=not stopped_early))
    sizes = {p.name: p.stat().st_size for p in sorted(args.output.iterdir()) if p.is_file()}
    for name, size in sizes.items():
        log(f"  {name:28s} {size:>11,} bytes")
    wall = time.time() - wall_start
    log(f"saved to {args.output} ({sum(sizes.values()) / 1e6:.2f} MB)")
    log(f"total wall time: {wall:.0f}s ({wall / 60:.1f} min; training loop {train_time / 60:.1f} min)")


def command_line(args) -> str:
    defaults = parse_args([])
    flags = [f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()
             if getattr(defaults, key) != value]
    return " ".join(["nice -n 10 python scripts/train_draft_model.py", *flags])


if __name__ == "__main__":
    main()
