"""Client-side errors, extending the tree in `bloompeer.p2p.errors`:

    BloompeerError
    └── MissingBlocksError   no server covers some blocks, even after waiting
"""

from __future__ import annotations

from ...p2p import BloompeerError

__all__ = ["MissingBlocksError", "block_ranges"]


class MissingBlocksError(BloompeerError):
    """No usable server for some blocks: none announced, or every one failed or is banned."""

    def __init__(self, model_uid: str, missing: list[int], waited_s: float, last_error: str | None = None):
        self.model_uid, self.missing = model_uid, missing
        reason = f"; the last server to try failed with: {last_error}" if last_error else ""
        super().__init__(
            f"no usable server in the swarm for block(s) {block_ranges(missing)} of {model_uid} "
            f"(waited {waited_s:.0f} s{reason}). "
            f"Start one with: bloompeer serve --model {model_uid} --blocks {missing[0]}:{missing[-1] + 1} "
            f"--initial-peers ..."
        )


def block_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0:3, 5:6" (half-open, as --blocks takes them)."""
    spans, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1:
            spans.append(f"{start}:{previous + 1}")
            start = current
    return ", ".join(spans)
