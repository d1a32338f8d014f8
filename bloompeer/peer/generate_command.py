"""`bloompeer generate`: text from a prompt, through a swarm (given, or started locally)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from collections.abc import Callable

from .default_model import DEMO_MODEL_DIR
from .flags import fraction, initial_peers, model_argument, positive_int

__all__ = ["add_generate_parser", "run_generate"]

logger = logging.getLogger(__name__)


def add_generate_parser(commands, add_network_flags) -> None:
    generate = commands.add_parser(
        "generate", help="generate text through the swarm",
        description="Generate a continuation of PROMPT, printing it as tokens arrive. The embeddings and the LM "
                    "head run here; every transformer block runs on the swarm's servers. With no "
                    "--initial-peers (and no $BLOOMPEER_INITIAL_PEERS), a local swarm of a bootstrap peer and "
                    "two servers is started for the model and stopped afterwards.")
    generate.add_argument("prompt", help="text to continue")
    generate.add_argument("--model", default=str(DEMO_MODEL_DIR), type=model_argument,
                          help="local checkpoint directory or hub name (default: the bundled demo model, a small "
                               "BLOOM trained on Jane Austen's novels)")
    generate.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (32)")
    sampling = generate.add_argument_group("decoding (greedy unless a sampling flag is given)")
    sampling.add_argument("--greedy", action="store_true", help="always take the most likely token")
    sampling.add_argument("--temperature", type=float, default=None, metavar="T", help="sample with temperature T")
    sampling.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K likeliest tokens")
    sampling.add_argument("--top-p", type=float, default=None, metavar="P",
                          help="sample from the smallest set of tokens with probability >= P")
    sampling.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling")
    generate.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                          help="how long to wait for servers of missing blocks before giving up (60)")
    generate.add_argument("--swarm-logs", metavar="DIR", default=None,
                          help="with no --initial-peers: keep the local swarm's logs in DIR (a file per peer)")
    generate.add_argument("--push", action="store_true",
                          help="have each server pass its output straight to the next one (one trip along the chain "
                               "per token instead of a round trip per server; pays off when servers are far apart)")
    speculative = generate.add_argument_group(
        "speculative decoding (fewer trips through the swarm per token; the same tokens as without)")
    speculative = speculative.add_mutually_exclusive_group()
    speculative.add_argument("--draft-model", metavar="PATH", default=None, type=model_argument,
                             help="a small local model with the same tokenizer proposes tokens, the swarm checks "
                                  "them all in one pass (transformers' assisted generation)")
    speculative.add_argument("--prompt-lookup", metavar="K", type=positive_int, default=None,
                             help="propose up to K tokens by looking up the text so far (no draft model needed)")
    trust = generate.add_argument_group("trust")
    trust.add_argument("--verify-fraction", type=fraction, default=0.0, metavar="F",
                       help="recompute this fraction of each span's steps on another server (or locally, with a "
                            "local checkpoint) and ban servers whose outputs disagree (0: off; 1: every step)")
    trust.add_argument("--trusted-servers", nargs="+", default=(), metavar="PEER_ID",
                       help="use only these servers (peer ids, as `bloompeer status` and the servers print them)")
    add_network_flags(generate, "/ip4/127.0.0.1/tcp/0")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    sampling = {name: value for name, value in sampling.items() if value is not None}
    if args.greedy and sampling:
        raise ValueError("--greedy cannot be combined with --temperature, --top-k or --top-p")
    if not sampling:
        return {"do_sample": False}
    return {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0, **sampling}


def run_generate(args: argparse.Namespace) -> int:
    from ..p2p import BloompeerError

    try:
        sampling = _sampling_kwargs(args)
        with contextlib.ExitStack() as stack:
            model_path = args.model
            peers, swarm_ready = initial_peers(args), None
            if not peers:
                swarm = _start_local_swarm(model_path, stack, args.swarm_logs)
                peers, swarm_ready = tuple(swarm.initial_peers), swarm.wait_online
            _generate(args, model_path, peers, sampling, swarm_ready)
        return 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        logger.info("Interrupted")
        return 130
    except (BloompeerError, ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        # At exit the interpreter would walk and finalize every object that torch and transformers
        # made (seconds on 2 cores, for memory the OS takes back anyway); frozen ones it leaves alone.
        gc.freeze()


def _start_local_swarm(model_path: str, stack: contextlib.ExitStack, log_dir: str | None):
    """A bootstrap peer up and servers starting (LocalSwarm.wait_online waits for them)."""
    from .local_swarm import ONE_COMMAND_SWARM, LocalSwarm, model_num_blocks, split_blocks

    spans = split_blocks(model_num_blocks(model_path), 2)
    logger.info("No --initial-peers given: starting a local swarm (a bootstrap peer and servers for blocks %s)",
                ", ".join(f"{start}:{end}" for start, end in spans))
    swarm = LocalSwarm(model_path, spans, log_dir=log_dir, config=ONE_COMMAND_SWARM)
    stack.callback(swarm.stop)
    return swarm.start(wait_online=False)


def _generate(args: argparse.Namespace, model_path: str, initial_peers: tuple[str, ...], sampling: dict,
              swarm_ready: Callable[[], object] | None) -> None:
    """swarm_ready: waits for a local swarm's servers; the client gets ready meanwhile."""
    import torch
    from transformers import AutoTokenizer, TextStreamer

    from ..p2p import NetworkConfig
    from .client.config import ClientConfig
    from .client.model import DistributedBloomForCausalLM, draft_overshoot

    if args.seed is not None:
        torch.manual_seed(args.seed)
    network = NetworkConfig(initial_peers=initial_peers, host_maddrs=tuple(args.host_maddrs),
                            announce_maddrs=tuple(args.announce_maddrs), identity_path=args.identity_path,
                            client_mode=True)
    config = ClientConfig(network=network, missing_blocks_timeout_s=args.timeout, push=args.push,
                          verify_fraction=args.verify_fraction, trusted_servers=tuple(args.trusted_servers))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    max_length = inputs.input_ids.shape[1] + args.max_new_tokens
    speculation = _speculation_kwargs(args)
    if speculation:
        max_length += draft_overshoot(args.prompt_lookup)
    with DistributedBloomForCausalLM.from_pretrained(model_path, client_config=config) as model, \
            model.inference_session(max_length) as session:
        if swarm_ready is not None:
            swarm_ready()
        model.swarm.runtime.run(session.open(batch=1))  # the route (logged) before the text starts
        print(args.prompt, end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer,
                           pad_token_id=tokenizer.pad_token_id, **sampling, **speculation)


def _speculation_kwargs(args: argparse.Namespace) -> dict:
    if args.prompt_lookup is not None:
        return {"prompt_lookup_num_tokens": args.prompt_lookup}
    if args.draft_model:
        from transformers import AutoModelForCausalLM

        return {"assistant_model": AutoModelForCausalLM.from_pretrained(args.draft_model).eval()}
    return {}
