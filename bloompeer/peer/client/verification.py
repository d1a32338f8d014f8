"""Catching a server that lies: a sampled fraction of each span's steps is recomputed elsewhere.

The check is a full forward of the span's whole input so far on an independent server for the
same blocks (or, where none exists and the span is small, on the client itself when it has the
checkpoint), compared with what the span's server returned for the new tokens. If they
disagree, a third computation decides who is wrong; without one, neither is trusted. A server
found wrong is banned for the rest of the session and its work is redone on another route.

Only servers that compute alike are compared: that store their weights the same way (none, int8,
or int4 with the same group size), compute in the same dtype and, for int8, on the same kind of
device (WeightFormat.arithmetic). An int8 server's honest outputs differ from a float one's, and a
bfloat16 server's from a float32 one's, by as much as a lie does. The client's own recomputation
loads its blocks the same way.

A span with routed blocks (a mixture of experts) can honestly disagree with a recomputation: a float
difference of one rounding before a router can send a token to another expert, which changes that
token's output by far more than any tolerance (in bfloat16, 0.15-0.48 relative for 4 of 1360 checks
of a tiny Mixtral; none in 3400 float32 checks per variant: tests/swarm/test_moe_family.py). A liar
disagrees on every check, so on such a span a server counts as wrong only when it disagreed on
ROUTED_STRIKES of its last ROUTED_WINDOW checks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
from collections import defaultdict, deque
from collections.abc import Collection

import torch

from ...blocks import BlockSpan, Checkpoint, quantize_block
from ...p2p import P2P, WIRE_DTYPES, RemoteError
from ...weight_format import WeightFormat
from .config import ClientConfig
from .health import MISBEHAVIOR_BAN_S
from .routing import SpanRoute
from .span_session import remote_forward
from .swarm import SwarmView

__all__ = ["LocalBlocks", "OutputVerifier", "relative_error", "tolerance_for"]

logger = logging.getLogger(__name__)

LOCAL_MAX_BLOCKS = 8  # the client recomputes at most this many blocks itself
ROUTED_WINDOW, ROUTED_STRIKES = 3, 2  # on routed spans: disagreements among a server's last checks to be wrong


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """||output - reference|| / ||reference||, in float32."""
    reference = reference.float()
    return float((output.float() - reference).norm() / reference.norm().clamp_min(1e-12))


def tolerance_for(arithmetic: WeightFormat) -> float:
    """How far an honest recomputation in the same arithmetic (WeightFormat.arithmetic) may drift: a
    full forward and a step-by-step decode round differently, by far less than this in float32; half
    precisions drift more, and so do quantized weights, whose kernels round each layer's input and
    output to bfloat16 (a flipped rounding is 2^-8 of a value) and sum in an order that depends on
    the rows computed together. The same span in bfloat16 on an H200 and on the CPU differed by
    0.9-1.6 % (none) and 1.1-1.7 % (int4) over 6 to 24 blocks (scripts/device_check.sh's machine,
    2026-12-04), int8 by 2.0-3.0 %, since CUDA computes it otherwise (WeightFormat.arithmetic keeps
    the two apart); the test's lie is 5 %."""
    return 1e-3 if arithmetic.dtype == "float32" and not arithmetic.quantized else 3e-2


class LocalBlocks:
    """Blocks the client loads from its own copy of the checkpoint, only to check servers.

    Checks of several sessions run at once on executor threads: each span is loaded once, by the
    first thread that needs it, while the others that need it wait for that load (a lock per span,
    so that loading one span does not hold up checks that use another)."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._spans: dict[tuple[int, int, WeightFormat], BlockSpan] = {}
        self._lock = threading.Lock()  # guards _loading
        self._loading: dict[tuple[int, int, WeightFormat], threading.Lock] = {}

    def forward(self, start: int, end: int, hidden: torch.Tensor, padding_mask: torch.Tensor | None,
                prompts: torch.Tensor | None, arithmetic: WeightFormat = WeightFormat()) -> torch.Tensor:
        """arithmetic: as the checked server's record says; the blocks are loaded in that dtype and
        quantized so, int8 computing as on that server's kind of device."""
        span = self._span(start, end, arithmetic)
        dtype = WIRE_DTYPES[arithmetic.dtype]
        prompts = None if prompts is None else prompts.to(dtype)
        with torch.inference_mode():
            return span(hidden.to(dtype), padding_mask, prompts=prompts).to(hidden.dtype)

    def _span(self, start: int, end: int, arithmetic: WeightFormat) -> BlockSpan:
        key = (start, end, arithmetic)
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            if key not in self._spans:
                self._spans[key] = self.checkpoint.load_span(
                    start, end, WIRE_DTYPES[arithmetic.dtype],
                    prepare_block=functools.partial(quantize_block, weights=arithmetic))
            return self._spans[key]


class _Strikes:
    """Each server's last ROUTED_WINDOW checks on routed spans: whether it disagreed (module docstring)."""

    def __init__(self):
        self._recent: defaultdict[str, deque[bool]] = defaultdict(lambda: deque(maxlen=ROUTED_WINDOW))

    def record(self, peer: str, disagreed: bool) -> bool:
        """Note a check of `peer`; True if it has disagreed often enough now to be wrong."""
        recent = self._recent[peer]
        recent.append(disagreed)
        return sum(recent) >= ROUTED_STRIKES


class OutputVerifier:
    """Samples steps and recomputes them elsewhere, so that a lying server is caught and banned.
    routed_blocks: the model's blocks with a sparse MLP (BlockSpan.experts_of)."""

    def __init__(self, p2p: P2P, swarm: SwarmView, config: ClientConfig, local: LocalBlocks | None,
                 routed_blocks: Collection[int] = ()):
        self.p2p, self.swarm, self.config, self.local = p2p, swarm, config, local
        self.routed_blocks = frozenset(routed_blocks)
        self._strikes = _Strikes()

    def sampled(self) -> bool:
        return self.config.verify_fraction > 0 and random.random() < self.config.verify_fraction

    async def find_liars(self, route: SpanRoute, inputs: torch.Tensor, padding_mask: torch.Tensor | None,
                         output: torch.Tensor, prompts: torch.Tensor | None = None) -> set[str]:
        """Peers (the span's server, or the one checking it) found to compute these blocks wrongly.

        inputs: [batch, length, hidden], everything the span received so far (with its deep
        `prompts`, if any); output: what its server returned for the last output.shape[1] tokens.
        Empty if the output checks out, or if nobody else can compute these blocks.
        """
        num_new, primary = output.shape[1], route.peer_id_str
        arithmetic = self._arithmetic_of(route)
        opinion = functools.partial(self._opinion, route, inputs, padding_mask, prompts, arithmetic)
        second = await opinion({primary})
        if second is None:
            logger.debug("No second opinion available for blocks %d:%d", route.start, route.end)
            return set()
        checker, checked = second[0], second[1][:, -num_new:]
        tolerance = tolerance_for(arithmetic)
        error = relative_error(output, checked)
        routed = not self.routed_blocks.isdisjoint(range(route.start, route.end))
        if error <= tolerance:
            if routed:
                self._strikes.record(primary, disagreed=False)
            return set()
        arbiter = await opinion({primary, checker})
        if arbiter is None:
            logger.warning("Servers %s and %s disagree on blocks %d:%d (relative error %.3g) and nobody else can "
                           "tell which is wrong: trusting neither", primary, checker, route.start, route.end, error)
            liars = {primary, checker}
        else:
            decided = arbiter[1][:, -num_new:]
            liars = {peer for peer, answer in [(primary, output), (checker, checked)]
                     if relative_error(answer, decided) > tolerance}
        if routed:
            liars = self._struck(liars, route, error)
        for liar in liars - {"local"}:
            self.swarm.bans.ban(liar, f"its output for blocks {route.start}:{route.end} disagrees with others "
                                      f"(relative error {error:.3g})", duration_s=MISBEHAVIOR_BAN_S)
        return liars

    def _struck(self, suspects: set[str], route: SpanRoute, error: float) -> set[str]:
        """Of the suspects of a disagreement on a routed span, those that disagreed often enough to be wrong."""
        liars = {peer for peer in suspects if peer == "local" or self._strikes.record(peer, disagreed=True)}
        for peer in suspects - liars:
            logger.info("Server %s disagrees on routed blocks %d:%d (relative error %.3g): a token may have gone to "
                        "another expert; not trusted less until it disagrees again", peer, route.start, route.end,
                        error)
        return liars

    def _arithmetic_of(self, route: SpanRoute) -> WeightFormat | None:
        """How the route's server computes, as its record says (None: no record seen)."""
        for record in self.swarm.servers.get(route.start, []):
            if record.peer_id == route.peer_id_str:
                return record.weights.arithmetic
        return None

    async def _opinion(self, route: SpanRoute, inputs: torch.Tensor, padding_mask: torch.Tensor | None,
                       prompts: torch.Tensor | None, arithmetic: WeightFormat | None,
                       exclude: Collection[str]) -> tuple[str, torch.Tensor] | None:
        """("peer id" or "local", output of blocks [start, end) for `inputs` computed as `arithmetic`
        says), or None if nobody else can."""
        if arithmetic is None:
            return None
        for peer in self._servers_covering(route, exclude, arithmetic):
            try:
                piece = SpanRoute(peer, route.start, route.end)
                return peer, await remote_forward(self.p2p, piece, self.swarm.model_uid, inputs, padding_mask,
                                                  self.config.request_timeout_s, prompts)
            except RemoteError as exc:
                logger.debug("Could not get a second opinion from %s: %s", peer, exc)
        if self.local is not None and "local" not in exclude and route.end - route.start <= LOCAL_MAX_BLOCKS:
            output = await asyncio.get_running_loop().run_in_executor(
                None, self.local.forward, route.start, route.end, inputs, padding_mask, prompts, arithmetic)
            return "local", output
        return None

    def _servers_covering(self, route: SpanRoute, exclude: Collection[str], arithmetic: WeightFormat) -> list[str]:
        """Servers announcing all of the route's blocks, computing as `arithmetic` says, nearest first."""
        banned = self.swarm.bans.banned()
        peers = {r.peer_id for r in self.swarm.servers.get(route.start, [])
                 if r.start <= route.start and route.end <= r.end and r.peer_id not in exclude
                 and r.peer_id not in banned and r.weights.arithmetic == arithmetic}
        return sorted(peers, key=lambda peer: self.swarm.rtts_s.get(peer, float("inf")))
