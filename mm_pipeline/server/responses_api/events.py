"""A streamed response: the chat's chunks (ChatService.chat_chunks) as the Responses API's
server-sent events, ``event: <type>`` and ``data: <json>`` with a ``sequence_number`` from 0.

    response.created, response.in_progress                     the response, nothing answered yet
    per output item, in order (output.py's items):
      response.output_item.added
        reasoning:     response.content_part.added, response.reasoning_text.delta ...,
                       response.reasoning_text.done, response.content_part.done
        message:       response.content_part.added, response.output_text.delta ... (logprobs when
                       asked), response.output_text.done, response.content_part.done
        function_call: response.function_call_arguments.delta (a call is parsed whole when its
                       </tool_call> arrives), response.function_call_arguments.done
      response.output_item.done
    response.completed | response.incomplete                   the whole response, usage included

An error after the stream started (the HTTP status is sent) is an ``error`` event, then
``response.failed`` with the response's ``error`` set. The items, their order, text, logprobs and
statuses are the ones the same request gets without ``stream`` (one parse of the same deltas:
choices.py), which settles three things here:

  - the message stays open until the answer ends, and the function_call items are announced after
    it: the chat answer is one message of text and calls, so text written after a call is still the
    message's, listed before the calls;
  - the logprobs of tokens that are no text (thinking, call markup) go to the message when it is
    open, else wait for its first text (the answer's logprobs cover every token) and are dropped
    when no message comes;
  - an item is ``completed`` when the next one starts; the one open at the end is ``incomplete``
    when max_output_tokens cut it, so its ``output_item.done`` waits for the finish reason.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from mm_pipeline.server.errors import APIError, to_api_error, log_rejection
from mm_pipeline.server.responses import ChatChunkChoice, ChatCompletionChunk, TokenLogprob, Usage
from mm_pipeline.server.responses_api.output import (FunctionCallOutput, OutputItem, OutputMessage, OutputText,
                                                     ReasoningOutput, ReasoningText, ResponseObject)


def named_event(payload: dict[str, Any]) -> str:
    """One SSE event named by its payload's type (the Responses API names every event)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def record_failure(response: ResponseObject, exc: Exception, where: str) -> APIError:
    """Fail ``response`` with what ``exc`` answers as an HTTP error (its code, or kind, and its
    public message), once the HTTP status can no longer say it; one log line names ``where`` and
    the response's id (its ``X-Request-Id``), as the other error lines do."""
    err = to_api_error(exc)
    log_rejection(err, "POST", where, response.id)
    response.fail(err.code or err.kind or "server_error", err.message)
    return err


class ResponseEvents:
    """Turns one response's chat chunks into its events; ``response`` (output.py's, in progress)
    is filled as they come and is whole once the stream ends."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._seq = 0
        self._open: ReasoningOutput | OutputMessage | None = None  # the item text goes to now
        self._indexes: dict[str, int] = {}  # item id -> its output_index (every event names it)
        self._held: list[TokenLogprob] = []  # logprobs of tokens before the message opened (module doc)
        self._calls: list[FunctionCallOutput] = []  # announced once the message is done (module doc)
        self._finish_reason: str | None = None

    async def events(self, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._snapshot())
        yield self._event("response.in_progress", response=self._snapshot())
        try:
            async for chunk in chunks:
                if not chunk.choices:  # the last chunk: usage (chat_body asks for it)
                    for e in self._end(chunk.usage):
                        yield e
                    continue
                for e in self._delta(chunk.choices[0]):
                    yield e
        except Exception as exc:
            err = record_failure(self.response, exc, "/v1/responses (stream already started)")
            yield self._event("error", code=self.response.error.code, message=err.message, param=err.param)
            yield self._event("response.failed", response=self._snapshot())

    def _delta(self, choice: ChatChunkChoice) -> list[str]:
        out: list[str] = []
        delta = choice.delta
        if choice.finish_reason is not None:
            self._finish_reason = choice.finish_reason
        if delta.reasoning_content:
            out += self._reasoning(delta.reasoning_content)
        logprobs = choice.logprobs.content if choice.logprobs is not None else []
        # a token without text (thinking, call markup) must not open a message: that would end the
        # reasoning item mid-thought, one item per token
        if delta.content or logprobs and isinstance(self._open, OutputMessage):
            out += self._text(delta.content or "", logprobs)
        else:
            self._held += logprobs
        if delta.tool_calls and isinstance(self._open, ReasoningOutput):
            out += self._close("completed")  # the thinking ended before the call
        self._calls += [FunctionCallOutput.of_chat(call) for call in delta.tool_calls or ()]
        return out

    def _end(self, usage: Usage) -> list[str]:
        """Close the open item with the finish reason's status, announce the calls, then the response."""
        out: list[str] = []
        if not self._calls and not any(isinstance(x, OutputMessage) for x in self.response.output):
            thinking_cut = isinstance(self._open, ReasoningOutput) and self._end_status() == "incomplete"
            out += self._close(self._end_status())  # the thinking, when the answer was nothing else
            if not thinking_cut:  # no message after thinking the limit cut (output.py), else an empty one
                out += self._add(OutputMessage(status="in_progress", content=[OutputText()]), "output_text")
                if self._held:  # an empty answer is an empty message, as without stream, its tokens' logprobs too
                    out += self._text("", [])
        out += self._close(self._end_status())
        for call in self._calls:
            out += self._call(call)
        self.response.finish(self._finish_reason, usage)
        kind = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
        out.append(self._event(kind, response=self._snapshot()))
        return out

    def _end_status(self) -> str:
        return "incomplete" if self._finish_reason == "length" else "completed"

    # ---- items ----------------------------------------------------------------------------------
    def _reasoning(self, text: str) -> list[str]:
        out = []
        if not isinstance(self._open, ReasoningOutput):
            out += self._close("completed")
            out += self._add(ReasoningOutput(status="in_progress", content=[ReasoningText()]), "reasoning_text")
        item = self._open
        item.content[0].text += text
        out.append(self._event("response.reasoning_text.delta", **self._at(item), content_index=0, delta=text))
        return out

    def _text(self, text: str, logprobs: list[TokenLogprob]) -> list[str]:
        out = []
        if not isinstance(self._open, OutputMessage):
            out += self._close("completed")
            out += self._add(OutputMessage(status="in_progress", content=[OutputText()]), "output_text")
        if self._held:
            logprobs, self._held = self._held + logprobs, []
        part = self._open.content[0]
        part.text += text
        part.logprobs += logprobs
        out.append(self._event("response.output_text.delta", **self._at(self._open), content_index=0, delta=text,
                               logprobs=[lp.model_dump() for lp in logprobs]))
        return out

    def _call(self, call: FunctionCallOutput) -> list[str]:
        call.status = "in_progress"
        arguments, call.arguments = call.arguments, ""
        out = self._add(call, None)
        call.arguments = arguments
        out.append(self._event("response.function_call_arguments.delta", **self._at(call), delta=arguments))
        out.append(self._event("response.function_call_arguments.done", **self._at(call), arguments=arguments))
        call.status = "completed"  # parsed whole: a cut call is no call
        out.append(self._event("response.output_item.done", output_index=self._index(call), item=call.model_dump()))
        return out

    def _add(self, item: OutputItem, part: str | None) -> list[str]:
        """Append ``item`` to the output and announce it (and its one content part, of kind ``part``)."""
        self._indexes[item.id] = len(self.response.output)
        self.response.output.append(item)
        out = [self._event("response.output_item.added", output_index=self._index(item),
                           item=item.model_dump() | ({"content": []} if part else {}))]
        if part is not None:
            self._open = item
            empty = ReasoningText() if part == "reasoning_text" else OutputText()
            out.append(self._event("response.content_part.added", **self._at(item), content_index=0,
                                   part=empty.model_dump()))
        return out

    def _close(self, status: str) -> list[str]:
        """End the item text was going to, as ``status``: its text's done, its part's done, its done."""
        item, self._open = self._open, None
        if item is None:
            return []
        part = item.content[0]
        if isinstance(item, ReasoningOutput):
            out = [self._event("response.reasoning_text.done", **self._at(item), content_index=0, text=part.text)]
        else:
            out = [self._event("response.output_text.done", **self._at(item), content_index=0, text=part.text,
                               logprobs=[lp.model_dump() for lp in part.logprobs])]
        item.status = status
        out.append(self._event("response.content_part.done", **self._at(item), content_index=0, part=part.model_dump()))
        out.append(self._event("response.output_item.done", output_index=self._index(item), item=item.model_dump()))
        return out

    # ---- events ---------------------------------------------------------------------------------
    def _index(self, item: OutputItem) -> int:
        return self._indexes[item.id]  # a dict: a scan of the output per event is quadratic in the items

    def _at(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self._index(item)}

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump()

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return named_event(payload)
