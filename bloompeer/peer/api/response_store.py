"""The responses kept for `previous_response_id` (POST /v1/responses with `store`, the default): in
memory, for the server's life, the most recent MAX_STORED_RESPONSES of them (an older id is then
unknown, as one never stored is: a 400 that says so). Handlers on the event loop and anything on a
worker thread may use it at once, so every access holds its lock."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .errors import ApiError

__all__ = ["MAX_STORED_RESPONSES", "ResponseStore"]

MAX_STORED_RESPONSES = 4096  # a conversation's items, some kB each: tens of MB at most


class ResponseStore:
    """response id -> the conversation's items up to and including that response's output."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES):
        self.max_responses = max_responses
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, items: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = items
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def items(self, response_id: str) -> list[dict]:
        """The stored conversation, or a 400 for an id this server does not hold."""
        with self._lock:
            items = self._items.get(response_id)
        if items is None:
            raise ApiError(400, f"previous_response_id: no stored response has id {response_id!r} (responses are "
                                f"kept in this server's memory, the last {self.max_responses}, with store true)",
                           param="previous_response_id", code="previous_response_not_found")
        return list(items)
