#!/usr/bin/env python3
"""Train the small BLOOM demo model that ships in bloompeer/demo_model/.

One command, CPU only, seeded and reproducible (same corpus + same flags => same files, on the
same library versions and thread count):

    nice -n 19 python scripts/train_demo_model.py

Corpus: Jane Austen's six completed novels (public domain, 1811-1817) as packaged for Debian in
`r-cran-janeaustenr` (install it with `apt-get install --no-install-recommends r-cran-janeaustenr`).
That package stores the texts as R data sets; R (`r-base-core`, a dependency of the package) is
used once to write them out as UTF-8 text.

Steps:
  1. read the six novels, unwrap their hard-wrapped lines into paragraphs;
  2. split: the last --val-fraction of every novel (cut at a paragraph boundary) is the validation
     split, the rest is the training split;
  3. train a byte-level BPE tokenizer on the training split only;
  4. train BloomForCausalLM from scratch on the training split (AdamW, warmup + cosine schedule,
     fixed context length, deterministic data order);
  5. round the weights to the on-disk dtype, report the validation perplexity of that rounded
     model computed in float32, save model + tokenizer + generation config, write heldout.txt
     (prose from the validation split) and a model card README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "bloompeer" / "demo_model"

CORPUS_PACKAGE = "r-cran-janeaustenr"
CORPUS_R_PACKAGE = "janeaustenr"
INSTALL_HINT = f"apt-get install --no-install-recommends {CORPUS_PACKAGE}"
# Publication order. These are the R data set names inside the janeaustenr package.
NOVELS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
HELDOUT_NOVEL = "prideprejudice"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

_EXPORT_R = r"""
args <- commandArgs(trailingOnly = TRUE)
out <- args[1]
cat(find.package("janeaustenr"), "\n", sep = "", file = file.path(out, "PATH"))
cat(as.character(packageVersion("janeaustenr")), "\n", sep = "", file = file.path(out, "VERSION"))
for (name in args[-1]) {
  env <- new.env()
  data(list = name, package = "janeaustenr", envir = env)
  con <- file(file.path(out, paste0(name, ".txt")), open = "wb")
  writeLines(enc2utf8(get(name, envir = env)), con, useBytes = TRUE)
  close(con)
}
"""


def log(message: str) -> None:
    print(message, flush=True)


def missing_corpus(detail: str) -> SystemExit:
    return SystemExit(
        f"error: the training corpus is missing ({detail}).\n"
        f"It is the Debian package {CORPUS_PACKAGE} (Jane Austen's six novels, public-domain texts).\n"
        f"Install it with:  {INSTALL_HINT}\n"
        f"(as root; run 'apt-get update' first if apt cannot find it)"
    )


def dpkg_version(package: str) -> str | None:
    try:
        result = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True,
                                check=False)
    except FileNotFoundError:
        return None
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else None


def read_corpus(rscript: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Raw lines of each novel, read from where r-cran-janeaustenr installs them, plus provenance."""
    rscript_path = shutil.which(rscript)
    if rscript_path is None:
        raise missing_corpus(f"'{rscript}' not found; R comes with the package")
    with tempfile.TemporaryDirectory(prefix="janeausten-") as tmp:
        result = subprocess.run([rscript_path, "--vanilla", "-e", _EXPORT_R, tmp, *NOVELS], capture_output=True,
                                text=True, check=False)
        if result.returncode != 0:
            raise missing_corpus(f"R could not load the '{CORPUS_R_PACKAGE}' data sets: "
                                 f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no output'}")
        lines = {}
        for name in NOVELS:
            raw = Path(tmp, f"{name}.txt").read_bytes().decode("utf-8")
            lines[name] = raw.split("\n")
        info = {
            "r_library_path": Path(tmp, "PATH").read_text().strip(),
            "r_package_version": Path(tmp, "VERSION").read_text().strip(),
        }
    info["debian_package"] = CORPUS_PACKAGE
    info["debian_version"] = dpkg_version(CORPUS_PACKAGE) or "unknown (not installed with dpkg)"
    return lines, info


def paragraphs_of(lines: list[str]) -> list[str]:
    """Unwrap the ~70-column lines into paragraphs; drop the _italic_ underscores; squeeze spaces."""
    paragraphs, current = [], []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            text = " ".join(current).replace("_", "")
            paragraphs.append(re.sub(r"\s+", " ", text).strip())
            current = []
    return [p for p in paragraphs if p]


def split_novel(paragraphs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The last `val_fraction` of the characters, starting at a paragraph boundary, is validation."""
    total = sum(len(p) + 1 for p in paragraphs)
    budget, cut = total * (1.0 - val_fraction), 0
    running = 0
    for i, p in enumerate(paragraphs):
        running += len(p) + 1
        if running > budget:
            cut = i + 1
            break
    else:
        cut = len(paragraphs)
    return paragraphs[:cut], paragraphs[cut:]


ABBREVIATIONS = {"Mr", "Mrs", "Dr", "St", "Messrs", "Col"}


def pick_heldout(paragraphs: list[str], min_chars: int = 2100, max_chars: int = 3000) -> str:
    """2-4 KB of consecutive validation paragraphs, ending at the last sentence end before max_chars."""
    start = next(i for i, p in enumerate(paragraphs) if len(p) >= 200)  # skip a chapter heading
    text = ""
    for p in paragraphs[start:]:
        text = f"{text}\n{p}" if text else p
        if len(text) >= max_chars:
            break
    text = text[:max_chars]
    ends = [m.end() for m in re.finditer(r"(\w*)[.!?][\"']?(?=\s|$)", text)
            if m.group(1) not in ABBREVIATIONS]
    ends = [e for e in ends if e >= min_chars]
    if not ends:
        raise RuntimeError("no sentence end in the held-out window")
    return text[:ends[-1]] + "\n"


@dataclass(frozen=True)
class CorpusSplit:
    """The six novels as paragraphs, split into training and validation text (one doc per novel)."""
    train_docs: list[str]
    val_docs: list[str]
    val_paragraphs: dict[str, list[str]]
    info: dict[str, str]
    sha256: str


def load_corpus_split(rscript: str, val_fraction: float) -> CorpusSplit:
    """Steps 1-2, shared with scripts/train_draft_model.py so that a draft trains on the same split."""
    raw, corpus_info = read_corpus(rscript)
    corpus_sha = hashlib.sha256("\n".join("\n".join(raw[n]) for n in NOVELS).encode()).hexdigest()
    train_docs, val_docs, val_paragraphs = [], [], {}
    for name in NOVELS:
        train_p, val_p = split_novel(paragraphs_of(raw[name]), val_fraction)
        train_docs.append("\n".join(train_p))
        val_docs.append("\n".join(val_p))
        val_paragraphs[name] = val_p
    log(f"corpus: {CORPUS_PACKAGE} {corpus_info['debian_version']} (R package {CORPUS_R_PACKAGE} "
        f"{corpus_info['r_package_version']}, {corpus_info['r_library_path']}), sha256 {corpus_sha[:16]}")
    log(f"split: train {sum(map(len, train_docs)):,} chars, validation {sum(map(len, val_docs)):,} chars "
        f"(last {val_fraction:.0%} of each of {len(NOVELS)} novels)")
    return CorpusSplit(train_docs, val_docs, val_paragraphs, corpus_info, corpus_sha)


def train_tokenizer(train_docs: list[str], vocab_size: int, output: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [line for doc in train_docs for line in doc.split("\n")]
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=2048,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(output)
    return fast


def encode_stream(tokenizer, docs: list[str], add_bos_eos: bool) -> list[int]:
    ids: list[int] = []
    for doc in docs:
        if add_bos_eos:
            ids.append(BOS_ID)
        ids.extend(tokenizer.backend_tokenizer.encode(doc, add_special_tokens=False).ids)
        if add_bos_eos:
            ids.append(EOS_ID)
    return ids


def batches(stream, context: int, batch_size: int, seed: int):
    """Endless deterministic batches: each epoch picks a random offset, cuts the token stream into
    windows of `context` tokens from there, and shuffles the windows with a seeded generator."""
    import torch

    rng = random.Random(seed)
    epoch = 0
    while True:
        offset = rng.randrange(context)
        n_windows = (len(stream) - offset) // context
        windows = stream[offset: offset + n_windows * context].view(n_windows, context)
        order = list(range(n_windows))
        rng.shuffle(order)
        for start in range(0, n_windows - batch_size + 1, batch_size):
            yield epoch, windows[torch.tensor(order[start:start + batch_size])]
        epoch += 1


def mean_nll(model, streams: list[list[int]], context: int, batch_size: int = 16) -> tuple[float, int]:
    """Mean token cross-entropy over each stream, cut into non-overlapping windows of `context`
    tokens (the last window may be shorter); every token but a window's first is predicted."""
    import torch
    import torch.nn.functional as F

    windows = [s[i:i + context] for s in streams for i in range(0, len(s), context) if len(s[i:i + context]) > 1]
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            group = windows[start:start + batch_size]
            width = max(len(w) for w in group)
            ids = torch.full((len(group), width), PAD_ID, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, w in enumerate(group):
                ids[row, :len(w)] = torch.tensor(w)
                mask[row, :len(w)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-100, reduction="sum")
            total += loss.item()
            count += int((targets != -100).sum())
    return total / count, count


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def start_run(args) -> None:
    """Deterministic CPU training: --threads torch threads, deterministic kernels, --seed everywhere."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)


def adamw(model, args):
    """AdamW with weight decay on matrices only (not on biases and layernorms)."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def optimizer_step(model, optimizer, loss, lr: float, grad_clip: float) -> None:
    import torch

    for group in optimizer.param_groups:
        group["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def mark_config_float32(output: Path) -> None:
    """Loading with dtype="auto" gives float32 (a CPU model), whatever dtype the weights file holds."""
    config_path = output / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train the bloompeer demo model (a small BLOOM) on Jane Austen's novels from the Debian "
                    f"package {CORPUS_PACKAGE}, on CPU, reproducibly. The defaults are the settings of the "
                    "shipped model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="directory to write the model, tokenizer, heldout.txt and README.md into")
    parser.add_argument("--seed", type=int, default=1234, help="seed for weights init and data order")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads (results are bit-identical only for the same value)")
    parser.add_argument("--val-fraction", type=float, default=0.04,
                        help="fraction of every novel (its end, cut at a paragraph) held out for validation")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, special tokens included")
    parser.add_argument("--n-layer", type=int, default=6, help="number of BLOOM blocks")
    parser.add_argument("--hidden-size", type=int, default=256, help="hidden size")
    parser.add_argument("--n-head", type=int, default=8, help="attention heads (must divide --hidden-size)")
    parser.add_argument("--context", type=int, default=256, help="training sequence length in tokens")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="linear warmup steps before the cosine decay")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of the peak")
    parser.add_argument("--weight-decay", type=float, default=0.1,
                        help="AdamW weight decay (matrices and embeddings only)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--log-every", type=int, default=20, help="print train loss every N steps")
    parser.add_argument("--eval-every", type=int, default=400,
                        help="print validation perplexity every N steps (0: only at the end)")
    parser.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                        help="dtype of the weights in model.safetensors")
    parser.add_argument("--rscript", default="Rscript",
                        help=f"R interpreter used to read the data sets of {CORPUS_PACKAGE}")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    wall_start = time.time()
    start_run(args)

    import torch
    from transformers import BloomConfig, BloomForCausalLM, GenerationConfig

    # 1-2. Corpus and split.
    corpus = load_corpus_split(args.rscript, args.val_fraction)
    train_docs, val_docs, val_paragraphs = corpus.train_docs, corpus.val_docs, corpus.val_paragraphs
    corpus_info, corpus_sha = corpus.info, corpus.sha256

    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "model.safetensors.index.json"):
        (output / stale).unlink(missing_ok=True)

    # 3. Tokenizer (training split only).
    tokenizer = train_tokenizer(train_docs, args.vocab_size, output)
    train_ids = torch.tensor(encode_stream(tokenizer, train_docs, add_bos_eos=True), dtype=torch.long)
    val_streams = [encode_stream(tokenizer, [doc], add_bos_eos=False) for doc in val_docs]
    n_val_tokens = sum(len(s) for s in val_streams)
    log(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens; train {len(train_ids):,} tokens, "
        f"validation {n_val_tokens:,} tokens")

    # 4. Model and training.
    config = BloomConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size, n_layer=args.n_layer,
                         n_head=args.n_head, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    model = BloomForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: BLOOM n_layer={args.n_layer} hidden={args.hidden_size} heads={args.n_head} "
        f"vocab={config.vocab_size}: {n_params:,} parameters")

    optimizer = adamw(model, args)
    data = batches(train_ids, args.context, args.batch_size, args.seed)
    tokens_per_step = args.context * args.batch_size
    log(f"training: {args.steps} steps x {args.batch_size} x {args.context} tokens "
        f"= {args.steps * tokens_per_step / len(train_ids):.2f} epochs, {args.threads} thread(s)")

    train_start = time.time()
    running, running_n = 0.0, 0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.min_lr_ratio)
        epoch, batch = next(data)
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        optimizer_step(model, optimizer, loss, lr, args.grad_clip)
        running += loss.item()
        running_n += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.time() - train_start
            log(f"step {step + 1:5d}/{args.steps}  epoch {epoch}  train loss {running / running_n:.4f}  "
                f"lr {lr:.2e}  {(step + 1) * tokens_per_step / elapsed:,.0f} tok/s  elapsed {elapsed:7.1f}s")
            running, running_n = 0.0, 0
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            nll, _ = mean_nll(model, val_streams, args.context)
            log(f"step {step + 1:5d}  validation loss {nll:.4f}  perplexity {math.exp(nll):.2f}")
    train_time = time.time() - train_start

    # 5. Round to the on-disk dtype, evaluate that model in float32, save.
    model.eval()
    raw_nll, _ = mean_nll(model, val_streams, args.context)
    save_dtype = getattr(torch, args.save_dtype)
    model = model.to(save_dtype).to(torch.float32)
    val_nll, val_count = mean_nll(model, val_streams, args.context)
    val_ppl = math.exp(val_nll)
    log(f"validation perplexity (float32, weights before rounding): {math.exp(raw_nll):.3f}")
    log(f"validation perplexity (float32, weights as saved in {args.save_dtype}): {val_ppl:.3f} "
        f"over {val_count:,} predicted tokens")

    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.to(save_dtype).save_pretrained(output)
    (output / "model.safetensors").chmod(0o644)  # package data: readable by everyone
    model.to(torch.float32)
    mark_config_float32(output)  # the file holds save_dtype
    model.config.dtype = "float32"

    heldout = pick_heldout(val_paragraphs[HELDOUT_NOVEL])
    (output / "heldout.txt").write_text(heldout, encoding="utf-8")
    heldout_ids = torch.tensor([tokenizer(heldout)["input_ids"]])
    with torch.no_grad():
        heldout_ppl = math.exp(model(input_ids=heldout_ids, labels=heldout_ids).loss.item())
    log(f"heldout.txt: {len(heldout.encode())} bytes, {heldout_ids.size(1)} tokens, perplexity {heldout_ppl:.3f}")

    prompt = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        greedy = model.generate(**prompt, max_new_tokens=40, do_sample=False)
        torch.manual_seed(args.seed)
        sampled = model.generate(**prompt, max_new_tokens=40, do_sample=True, temperature=0.8, top_p=0.9)
    samples = {"greedy": tokenizer.decode(greedy[0], skip_special_tokens=True),
               "sampled (temperature 0.8, top-p 0.9, seed %d)" % args.seed:
                   tokenizer.decode(sampled[0], skip_special_tokens=True)}
    for kind, text in samples.items():
        log(f"sample, {kind}: {text!r}")

    wall = time.time() - wall_start
    write_model_card(output, args, corpus_info, corpus_sha, n_params, config.vocab_size, len(train_ids),
                     n_val_tokens, train_time, wall, val_ppl, heldout_ppl, samples)
    sizes = {p.name: p.stat().st_size for p in sorted(output.iterdir()) if p.is_file()}
    for name, size in sizes.items():
        log(f"  {name:28s} {size:>11,} bytes")
    log(f"saved to {output} ({sum(sizes.values()) / 1e6:.2f} MB)")
    log(f"validation perplexity: {val_ppl:.3f}")
    log(f"total wall time: {wall:.0f}s ({wall / 60:.1f} min; training loop {train_time / 60:.1f} min)")


def write_model_card(output: Path, args, corpus_info: dict, corpus_sha: str, n_params: int, vocab: int,
                     n_train_tokens: int, n_val_tokens: int, train_time: float, wall: float, val_ppl: float,
                     heldout_ppl: float, samples: dict[str, str]) -> None:
    default_output = args.output.resolve() == DEFAULT_OUTPUT.resolve()
    flags = [] if default_output else [f"--output {args.output}"]
    defaults = parse_args([])
    for key, value in vars(args).items():
        if key != "output" and getattr(defaults, key) != value:
            flags.append(f"--{key.replace('_', '-')} {value}")
    command = " ".join(["nice -n 19 python scripts/train_demo_model.py", *flags])
    size = (output / "model.safetensors").stat().st_size
    sample_lines = "\n".join(f"- {kind}: \"{text}\"" for kind, text in samples.items())
    card = f"""# bloompeer demo model

A small BLOOM language model trained from scratch on Jane Austen's novels, shipped with bloompeer
so that the swarm can be demonstrated offline with a model whose output is English. It is a toy:
expect period-flavoured, grammatical-looking but often meaningless prose.

The weights in this directory were trained by `scripts/train_demo_model.py` in this repository,
with:

    {command}

## Architecture

| | |
|---|---|
| class | `transformers.BloomForCausalLM` (ALiBi positions, tied input/output embeddings) |
| blocks (`n_layer`) | {args.n_layer} |
| hidden size | {args.hidden_size} |
| attention heads | {args.n_head} (head dim {args.hidden_size // args.n_head}) |
| vocabulary | {vocab} |
| parameters | {n_params:,} |
| weights on disk | `model.safetensors`, {args.save_dtype}, {size:,} bytes; `config.json` says `"dtype": "float32"`, so `dtype="auto"` loads it in float32 |
| special tokens | `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3 |

## Tokenizer

Byte-level BPE (`tokenizers`), {vocab} tokens including the four special tokens, trained on the
training split only; saved with `PreTrainedTokenizerFast.save_pretrained` (`tokenizer.json`,
`tokenizer_config.json`; transformers 5 keeps the special tokens in `tokenizer_config.json` and
writes no `special_tokens_map.json`). It adds no special tokens when encoding. Paragraphs are
separated by a single newline.

## Training data

- Corpus: Jane Austen's six completed novels (Sense and Sensibility, Pride and Prejudice,
  Mansfield Park, Emma, Northanger Abbey, Persuasion; 1811-1817), from the Debian package
  `{corpus_info['debian_package']}` version `{corpus_info['debian_version']}` (R package
  `{CORPUS_R_PACKAGE}` {corpus_info['r_package_version']}), installed with
  `{INSTALL_HINT}`. The novels are in the public domain; the texts were taken
  from Project Gutenberg by the package's author. The package itself (its R code and packaging)
  is under the MIT licence.
- sha256 of the raw text as read: `{corpus_sha}`.
- Preprocessing: hard-wrapped lines joined into paragraphs, `_italic_` underscores removed.
- Split: the last {args.val_fraction:.0%} of each novel (by characters, cut at a paragraph
  boundary) is the validation split; the rest is the training split
  ({n_train_tokens:,} training tokens, {n_val_tokens:,} validation tokens).

## Training

AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), peak LR {args.lr}, {args.warmup} warmup steps,
cosine decay to {args.min_lr_ratio:g} x peak, gradient clipping {args.grad_clip}, {args.steps} steps of
{args.batch_size} x {args.context} tokens ({args.steps * args.batch_size * args.context / n_train_tokens:.1f} epochs),
seed {args.seed}, float32 on CPU with {args.threads} threads.
Training loop: {train_time / 60:.1f} min ({args.steps * args.batch_size * args.context / train_time:,.0f} tokens/s on average);
whole script: {wall / 60:.1f} min. Times depend on the machine and on what else runs on it.
Rerunning the command with the same corpus, library versions and `--threads` gives the same files
(README timings aside).

## Evaluation

Weights rounded to {args.save_dtype} (as saved), computed in float32:

- validation perplexity: **{val_ppl:.2f}** (exp of the mean token cross-entropy over the whole
  validation split, in non-overlapping windows of {args.context} tokens);
- `heldout.txt` perplexity: **{heldout_ppl:.2f}** (the whole file as one sequence,
  `labels=input_ids`, `exp(loss)`). `heldout.txt` is prose from the validation split of
  Pride and Prejudice, never seen by the tokenizer or the model in training.

Samples from the prompt "Once upon a time" (40 new tokens):

{sample_lines}

## Draft model

`draft/` holds a small draft of this model for speculative decoding through the swarm
(`bloompeer generate --draft-model demo`), distilled from it by `scripts/train_draft_model.py`;
its card, `draft/README.md`, gives its size, how often the demo model accepts its proposals, and
the speed-up. Retrain it whenever this model is retrained.
"""
    (output / "README.md").write_text(card, encoding="utf-8")


if __name__ == "__main__":
    main()
