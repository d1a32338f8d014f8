"""The Responses API's output (responses.py): a reply read as reasoning, content and tool calls
(replies.py) becomes output items (a reasoning item, an assistant message, function calls), plain
or streamed as OpenAI's typed events:

    response.created, response.in_progress
    per item: response.output_item.added, then
        reasoning       response.reasoning_text.delta ... .done
        message         response.content_part.added, response.output_text.delta ... .done, response.content_part.done
        function_call   response.function_call_arguments.delta ... .done
    response.output_item.done
    response.completed (or response.incomplete, cut by max_output_tokens), with the whole response

The shapes are those of the openai package's openai.types.responses (tests/api/test_responses.py
reads them with it).
"""

from __future__ import annotations

import json
import time
import uuid

from .errors import ApiError
from .pieces import TextPiece
from .replies import ReplyFormat
from .response_store import ResponseStore

__all__ = ["ResponsesOutput"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _OutputItems:
    """Reader deltas in, output items and their events out: an item opens when the kind of delta
    changes (reasoning, content, a new call) and closes when the next opens or the reply ends."""

    def __init__(self, event):
        self.event, self.items, self.open = event, [], None  # open: the item being written

    def add(self, delta: tuple) -> list[dict]:
        kind = delta[0]
        events = []
        if kind == "call" or self.open is None or self.open["type"] != _ITEM_TYPES[kind]:
            events += self.close() + self._start(delta)
        item, index = self.open, len(self.items) - 1
        text = delta[-1]
        if kind == "reasoning":
            item["content"][0]["text"] += text
            events.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                     content_index=0, delta=text))
        elif kind == "content":
            item["content"][0]["text"] += text
            events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                     content_index=0, delta=text, logprobs=[]))
        elif kind == "arguments":
            item["arguments"] += text
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=text))
        return events

    def _start(self, delta: tuple) -> list[dict]:
        kind = delta[0]
        if kind == "call":
            item = {"id": _id("fc"), "type": "function_call", "call_id": delta[2], "name": delta[3], "arguments": "",
                    "status": "in_progress"}
        elif kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [_text_part("")]}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events = [self.event("response.output_item.added", output_index=index, item=_shown(item))]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=_text_part("")))
        return events

    def close(self) -> list[dict]:
        """The open item's closing events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, item["status"] = self.items.index(item), "completed"
        events = []
        if item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0])]
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        return events + [self.event("response.output_item.done", output_index=index, item=item)]


_ITEM_TYPES = {"reasoning": "reasoning", "content": "message", "arguments": "function_call"}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _shown(item: dict) -> dict:
    """An item as output_item.added shows it: as it starts, empty."""
    return json.loads(json.dumps(item))


class ResponsesOutput:
    """The output of one response (one choice): what completions.answer() shapes a response with."""

    done_marker = None  # the Responses stream ends with response.completed, no [DONE]

    def __init__(self, request, model: str, conversation: list[dict], reply: ReplyFormat, store: ResponseStore):
        """request: the ResponsesRequest; conversation: the items before this response's output."""
        self.request, self.model, self.conversation, self.reply, self.store = request, model, conversation, reply, store
        self.id, self.created_at, self.sequence_number = _id("resp"), time.time(), 0
        self.output = _OutputItems(self._event)
        self.reader = reply.reader()
        self.finish_reason: str | None = None
        self.reasoning_tokens = 0  # the reply's tokens up to the last that wrote reasoning

    def _event(self, event_type: str, **fields) -> dict:
        self.sequence_number += 1
        return {"type": event_type, "sequence_number": self.sequence_number - 1, **fields}

    def opening(self) -> list[dict]:
        response = self._response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunks(self, index: int, piece: TextPiece, first: bool) -> list[dict]:
        deltas = self.reader.add(piece.text) + (self.reader.finish() if piece.finish_reason is not None else [])
        self.finish_reason = piece.finish_reason or self.finish_reason
        if any(delta[0] == "reasoning" for delta in deltas):
            self.reasoning_tokens = piece.completion_tokens
        return [event for delta in deltas for event in self.output.add(delta)]

    def closing(self, usage_counts: tuple[int, int], body) -> list[dict]:
        events = self.output.close()
        response = self._finished(usage_counts)
        return events + [self._event(f"response.{response['status']}", response=response)]

    def choice(self, index: int, pieces: list[TextPiece]) -> None:
        for piece in pieces:
            self.chunks(index, piece, False)
        self.output.close()

    def response(self, choices: list, usage_counts: tuple[int, int]) -> dict:
        return self._finished(usage_counts)

    def error_event(self, error: ApiError) -> dict:
        return self._event("error", code=error.body["error"]["code"], message=error.body["error"]["message"],
                           param=error.body["error"]["param"], error=error.body["error"])

    def sse(self, event: dict) -> dict:
        return {"event": event["type"], "data": json.dumps(event)}

    def _finished(self, usage_counts: tuple[int, int]) -> dict:
        if not self.output.items:  # an empty reply is an empty message, as OpenAI's
            self.output.add(("content", ""))
            self.output.close()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        response = self._response(status, usage_counts)
        if self.request.store:
            self.store.put(self.id, self.conversation + self.output.items)
        return response

    def _response(self, status: str, usage_counts: tuple[int, int] | None = None) -> dict:
        request = self.request
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": self.output.items if status != "in_progress" else [],
                "instructions": request.instructions, "tools": request.tools_shown(),
                "tool_choice": request.tool_choice or "auto", "parallel_tool_calls": request.parallel_tool_calls,
                "temperature": request.temperature, "top_p": request.top_p,
                "max_output_tokens": request.max_output_tokens, "previous_response_id": request.previous_response_id,
                "text": {"format": request.text_format()}, "store": request.store, "metadata": request.metadata or {},
                "error": None, "usage": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
        if usage_counts is not None:
            prompt_tokens, completion_tokens = usage_counts
            body["usage"] = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                             "total_tokens": prompt_tokens + completion_tokens}
        return body
