"""A client's connection to the swarm for one model: its network peer, its event loop, its view of
the swarm, and what it owns for its whole life (the view's refresher, the output verifier).

A model holds one as `model.client`; the threads calling the model share it. Sessions are opened
from it, and an inference step is a coroutine of the session run on `client.runtime` (there is no
step method here: nothing would be added on the way).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import weakref
from collections.abc import Callable

import torch

from ...blocks import Checkpoint
from ...p2p import PeerNode, dtype_name
from .config import ClientConfig
from .inference_session import InferenceSession
from .routing import ServerFilter
from .runtime import ClientRuntime
from .sequential import SwarmSequential, ThroughSwarm
from .swarm import SwarmView
from .verification import LocalBlocks, OutputVerifier

__all__ = ["Connecting", "SwarmClient"]

logger = logging.getLogger(__name__)

_connected: weakref.WeakSet[SwarmClient] = weakref.WeakSet()  # not shut down yet: left at exit


@atexit.register
def _leave_the_swarm_at_exit() -> None:
    """Shut down the clients a program did not: their loop thread and daemon would otherwise still
    run while the interpreter tears itself down, which can crash it (SIGSEGV) after the program's
    work is done. atexit runs after the main thread returns, before interpreter teardown."""
    for client in list(_connected):
        client.shutdown()


class SwarmClient:
    """The one owner of a client's network resources, so that they are started together, shared by
    every session and request, and released in one defined order (view, peer, loop) at shutdown or,
    if the program forgot, at exit.

    Its methods are synchronous and run their work on the client's loop thread (runtime.py), so a
    torch model can call them from its forward.
    """

    def __init__(self, runtime: ClientRuntime, node: PeerNode, swarm: SwarmView, config: ClientConfig,
                 verifier: OutputVerifier | None):
        self.runtime, self.node, self.swarm, self.config, self.verifier = runtime, node, swarm, config, verifier
        self.sequential = SwarmSequential(node.p2p, swarm, config)
        self._refresher = runtime.run(self._start_refresher())
        _connected.add(self)

    async def _start_refresher(self) -> asyncio.Task:
        return asyncio.create_task(self.swarm.keep_fresh(), name="bloompeer-swarm-view")

    @classmethod
    def connect(cls, checkpoint: Checkpoint, config: ClientConfig, dtype: torch.dtype = torch.float32) -> SwarmClient:
        """Join the swarm as a client of `checkpoint`'s model (only servers with its fingerprint are
        used) whose local parts compute in `dtype` (an exact client's servers compute in it too)."""
        return cls.start_connecting(checkpoint, config, dtype).result()

    @classmethod
    def start_connecting(cls, checkpoint: Checkpoint, config: ClientConfig,
                         dtype: torch.dtype = torch.float32) -> Connecting:
        """connect(), begun now: the network peer (a libp2p daemon and a DHT node, a good part of a
        second) starts on the client's loop thread while the caller goes on (from_pretrained loads
        its tensors meanwhile); the result's result() finishes it."""
        runtime = ClientRuntime()
        return Connecting(runtime, runtime.submit(PeerNode.create(config.network)),
                          lambda node: cls._joined(runtime, node, checkpoint, config, dtype))

    @classmethod
    def _joined(cls, runtime: ClientRuntime, node: PeerNode, checkpoint: Checkpoint, config: ClientConfig,
                dtype: torch.dtype) -> SwarmClient:
        allowed = ServerFilter.of_client(config, checkpoint.fingerprint(), dtype_name(dtype))
        view = SwarmView(node.p2p, node.directory, checkpoint.model_uid, checkpoint.config().num_hidden_layers,
                         allowed, config.swarm_refresh_period_s)
        verifier = None
        if config.verify_fraction > 0:
            local = LocalBlocks(checkpoint) if checkpoint.local_dir is not None else None
            model_config = checkpoint.config()
            experts = checkpoint.family.span_class.experts_of(model_config)
            verifier = OutputVerifier(node.p2p, view, config, local,
                                      routed_blocks=[index for index, (count, _) in enumerate(experts) if count])
        return cls(runtime, node, view, config, verifier)

    def open_session(self, max_length: int) -> InferenceSession:
        """A session whose servers are chosen, and caches reserved, at its first step."""
        return InferenceSession(self.node.p2p, self.swarm, self.config, max_length, self.verifier)

    def close_session(self, session: InferenceSession) -> None:
        """Close it, even in a call cancelled by its caller (runtime.Cancellation): that frees the
        servers' caches now rather than at their timeout."""
        self.runtime.run(session.close(), cancellable=False)

    def forward(self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None,
                prompts: torch.Tensor | None = None) -> torch.Tensor:
        """A full forward through every block, with no cache kept on the servers, differentiable with
        respect to `hidden` and the deep `prompts` ([num_model_blocks, batch, prompt_length, hidden])."""
        return ThroughSwarm.apply(hidden, prompts, (self.sequential, self.runtime.run), padding_mask)

    def shutdown(self) -> None:
        """Stop the calls in flight, the swarm view, the network peer and the client's loop thread, in
        that order. Idempotent and thread-safe; calls from other threads during and after it fail with
        ClientShutDownError (at once: none waits on a loop that no longer runs)."""
        _connected.discard(self)
        self.runtime.shutdown(last=self._stop())

    async def _stop(self) -> None:
        self._refresher.cancel()
        await asyncio.gather(self._refresher, return_exceptions=True)
        await self.node.shutdown()


class Connecting:
    """A SwarmClient on its way (SwarmClient.start_connecting): result() waits for it; cancel()
    releases what was started, for a caller that will not need it after all."""

    def __init__(self, runtime: ClientRuntime, node: concurrent.futures.Future[PeerNode],
                 finish: Callable[[PeerNode], SwarmClient]):
        self._runtime, self._node, self._finish = runtime, node, finish

    def result(self) -> SwarmClient:
        node = None
        try:
            node = self._node.result()
            return self._finish(node)
        except BaseException:
            self._release(node)
            raise

    def cancel(self) -> None:
        try:
            node = self._node.result()
        except BaseException:  # noqa: BLE001 - it failed to start: only the loop is left to stop
            node = None
        self._release(node)

    def _release(self, node: PeerNode | None) -> None:
        self._runtime.shutdown(last=node.shutdown() if node is not None else None)
