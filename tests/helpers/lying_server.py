"""A dishonest server, for tests: the real `bloompeer serve`, whose outputs are quietly nudged.

Run as `python lying_server.py serve --model ... --blocks A:B ...` (the CLI's own arguments).
"""

import sys

import torch

from bloompeer.peer.cli.main import main
from bloompeer.peer.server.backend import SpanBackend

NUDGE = 0.05  # of each output's own scale: small enough to look plausible, large enough to change tokens


def _nudged(method):
    async def lying(self, *args):
        output = await method(self, *args)
        return output + NUDGE * output.std() * torch.randn_like(output)

    return lying


SpanBackend.step = _nudged(SpanBackend.step)
SpanBackend.forward = _nudged(SpanBackend.forward)
sys.exit(main())
