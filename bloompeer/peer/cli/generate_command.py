"""`bloompeer generate`: text from a prompt, through a swarm (given, or started locally)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from .arguments import model_argument, positive_float, positive_int, probability
from .default_model import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR
from .flags import add_client_flags, add_model_flag, client_config, initial_peers
from .import_gc import imports_without_gc
from .local_swarm import start_local_swarm

__all__ = ["add_parser", "run"]

logger = logging.getLogger(__name__)


def add_parser(commands) -> None:
    generate = commands.add_parser(
        "generate", help="generate text through the swarm",
        description="Generate a continuation of PROMPT, printing it as tokens arrive. The embeddings and the LM "
                    "head run here; every transformer block runs on the swarm's servers. With no "
                    "--initial-peers (and no $BLOOMPEER_INITIAL_PEERS), a local swarm of a bootstrap peer and "
                    "two servers is started for the model and stopped afterwards.")
    generate.add_argument("prompt", help="text to continue")
    add_model_flag(generate)
    generate.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                          help="tokens to generate (32)")
    sampling = generate.add_argument_group("decoding (greedy unless a sampling flag is given)")
    sampling.add_argument("--greedy", action="store_true", help="always take the most likely token")
    sampling.add_argument("--temperature", type=positive_float, default=None, metavar="T",
                          help="sample with temperature T")
    sampling.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                          help="sample from the K likeliest tokens")
    sampling.add_argument("--top-p", type=probability, default=None, metavar="P",
                          help="sample from the smallest set of tokens with probability >= P")
    sampling.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling")
    generate.add_argument("--swarm-logs", metavar="DIR", default=None,
                          help="with no --initial-peers: keep the local swarm's logs in DIR (a file per peer)")
    speculative = generate.add_argument_group(
        "speculative decoding (fewer trips through the swarm per token; the same tokens as without)")
    speculative = speculative.add_mutually_exclusive_group()
    speculative.add_argument("--draft-model", metavar="PATH", default=None, type=_draft_model_argument,
                             help="a small local model with the same tokenizer proposes tokens, the swarm checks "
                                  "them all in one pass (transformers' assisted generation); 'demo': the draft "
                                  "bundled with the demo model")
    speculative.add_argument("--prompt-lookup", metavar="K", type=positive_int, default=None,
                             help="propose up to K tokens by looking up the text so far (no draft model needed)")
    add_client_flags(generate)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    sampling = {name: value for name, value in sampling.items() if value is not None}
    if args.greedy and sampling:
        raise ValueError("--greedy cannot be combined with --temperature, --top-k or --top-p")
    if not sampling:
        return {"do_sample": False}
    return {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0, **sampling}


class _CtrlC:
    """Ctrl-C raises KeyboardInterrupt, as by default, and also stops the generation at its next
    token (a stopping criterion for generate): Python drops an exception raised while a finalizer
    or the garbage collector runs, and a signal can land there, so the exception alone may be lost."""

    def __init__(self):
        self.pressed = False
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.full((input_ids.shape[0],), self.pressed, dtype=torch.bool)


def run(args: argparse.Namespace) -> int:
    sampling = _sampling_kwargs(args)
    _check_draft_model(args)
    ctrl_c = _CtrlC()
    try:
        with contextlib.ExitStack() as stack:
            peers, swarm_ready = initial_peers(args), None
            if not peers:
                swarm = start_local_swarm(args.model, stack, args.swarm_logs, wait_online=False)
                peers, swarm_ready = tuple(swarm.initial_peers), swarm.wait_online
            _generate(args, peers, sampling, swarm_ready, ctrl_c)
            if ctrl_c.pressed:
                raise KeyboardInterrupt
        return 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        logger.info("Interrupted")
        return 130


def _generate(args: argparse.Namespace, peers: tuple[str, ...], sampling: dict,
              swarm_ready: Callable[[], object] | None, ctrl_c: _CtrlC) -> None:
    """swarm_ready: waits for a local swarm's servers; the client gets ready meanwhile."""
    with imports_without_gc():
        import torch
        from transformers import AutoTokenizer, StoppingCriteriaList, TextStreamer

        from ..client.auto import AutoDistributedModelForCausalLM
        from ..client.model import draft_overshoot

    if args.seed is not None:
        torch.manual_seed(args.seed)
    model_path = args.model
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    max_length = inputs.input_ids.shape[1] + args.max_new_tokens
    speculation = _speculation_kwargs(args)
    if speculation:
        max_length += draft_overshoot(args.prompt_lookup)
    with AutoDistributedModelForCausalLM.from_pretrained(model_path, client_config=client_config(args, peers)) as model, \
            model.inference_session(max_length) as session:
        if swarm_ready is not None:
            swarm_ready()
        model.client.runtime.run(session.open(batch=1))  # the route (logged) before the text starts
        print(args.prompt, end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer,
                           stopping_criteria=StoppingCriteriaList([ctrl_c]), pad_token_id=tokenizer.pad_token_id,
                           **sampling, **speculation)


def _draft_model_argument(text: str) -> str:
    """--draft-model: 'demo' names the bundled demo model's draft; anything else is what --model takes."""
    return str(DEMO_DRAFT_MODEL_DIR) if text == "demo" else model_argument(text)


def _check_draft_model(args: argparse.Namespace) -> None:
    """Before any swarm starts: the bundled draft proposes tokens of the demo model's tokenizer only."""
    if args.draft_model == str(DEMO_DRAFT_MODEL_DIR) and Path(args.model).resolve() != DEMO_MODEL_DIR:
        raise ValueError(f"--draft-model demo is the demo model's draft and has its tokenizer, not that of "
                         f"{args.model}; give --draft-model a small model with the tokenizer of {args.model}")


def _speculation_kwargs(args: argparse.Namespace) -> dict:
    if args.prompt_lookup is not None:
        return {"prompt_lookup_num_tokens": args.prompt_lookup}
    if args.draft_model:
        from transformers import AutoModelForCausalLM

        return {"assistant_model": AutoModelForCausalLM.from_pretrained(args.draft_model).eval()}
    return {}
