"""The chat a Responses request is answered as: its input items as chat messages (content parts in
the chat's spelling, a function_call joined to its assistant turn, reasoning as the next turn's
thinking) and the /v1/chat/completions body around them (``chat_body``). A part or item the chat
cannot take is an ``InvalidMessageError`` naming where it is in the request's ``input``."""

from __future__ import annotations

from typing import Any

from mm_pipeline.errors import InvalidMessageError, Where, echo
from mm_pipeline.server.message_protocol import IMAGE_DETAILS
from mm_pipeline.server.responses_api.protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                                       NamedFunctionChoice, ResponsesRequest)


def _chat_part(part: dict[str, Any], at: Where) -> dict[str, Any]:
    """One content part in the chat's spelling (the chat's own parts pass as they are); one the
    chat cannot take is an ``InvalidMessageError`` at ``at``."""
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        if part.get("detail") is not None and part["detail"] not in IMAGE_DETAILS:
            raise InvalidMessageError(f"{at}.detail: an input_image's detail is one of "
                                      f"{', '.join(IMAGE_DETAILS)}, not {echo(part['detail'])}", loc=at.then("detail"))
        if (part.get("file_id") is None) == (part.get("image_url") is None):
            raise InvalidMessageError(f"{at}: an input_image needs exactly one of image_url or file_id", loc=at)
        if part.get("file_id") is not None:
            return {"type": "file", "file": {"file_id": part["file_id"]}}
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail")}}
    if kind == "input_file":
        if part.get("file_url") is not None:
            raise InvalidMessageError(f"{at}: input_file by file_url is not supported; send file_id (POST /v1/files) "
                                      f"or file_data, or the media as an input_image / video_url / audio_url part",
                                      loc=at)
        ref = {k: part[k] for k in ("file_id", "file_data", "filename") if part.get(k) is not None}
        return {"type": "file", "file": ref}
    return part


def chat_content(content: str | list[dict[str, Any]], at: Where) -> str | list[dict[str, Any]]:
    """``content`` (at ``at``: an item's content or output) in the chat's spelling."""
    return content if isinstance(content, str) else [_chat_part(p, at.then(i)) for i, p in enumerate(content)]


def chat_messages(items: str | list[Any], origins: list[int] | None = None) -> list[dict[str, Any]]:
    """The input as chat messages. A function_call joins the assistant message just before it (or
    starts one), so text and calls of one turn stay one turn; a reasoning item's text becomes the
    reasoning_content of the assistant turn that follows it. An InvalidMessageError names a bad part.
    ``origins``, when given, gets for each message the index of the input item that started it
    (so an error in a message can name the item: routes.py)."""
    if isinstance(items, str):
        if origins is not None:
            origins.append(0)
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    thinking: str | None = None  # a reasoning item's text, for the next assistant turn

    def new_turn(turn: dict[str, Any]) -> dict[str, Any]:
        nonlocal thinking
        if thinking is not None:
            turn["reasoning_content"], thinking = thinking, None
        out.append(turn)
        return turn

    for i, item in enumerate(items):
        at = Where(("input", i))
        if isinstance(item, MessageItem):
            turn = {"role": item.role, "content": chat_content(item.content, at.then("content"))}
            if item.role == "assistant":
                new_turn(turn)
            else:
                out.append(turn)
        elif isinstance(item, FunctionCallItem):
            joins = out and out[-1]["role"] == "assistant" and thinking is None
            turn = out[-1] if joins else new_turn({"role": "assistant", "content": None})
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else chat_content(item.output, at.then("output"))
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:  # ReasoningItem
            thinking = (thinking or "") + "".join(c.text for c in item.content or ())
        if origins is not None:
            origins += [i] * (len(out) - len(origins))
    return out


def _check_call_outputs(items: str | list[Any], messages: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a call of the conversation (this input's function_call
    items or the stored response's): an InvalidMessageError names the first that does not, as
    OpenAI refuses it (the template would otherwise render an answer to a call never made)."""
    if isinstance(items, str):
        return
    made = {call.get("id") for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or ()}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallOutputItem) and item.call_id not in made:
            at = Where(("input", i, "call_id"))
            raise InvalidMessageError(f"{at}: no function_call with call_id {echo(item.call_id)} in this input or "
                                      f"the response it continues (previous_response_id)", loc=at)


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]],
              origins: list[int] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The /v1/chat/completions body ``req`` is answered as, and its input as chat messages;
    ``history``: the messages of the response it continues (``previous_response_id``), its answer
    included; ``origins``: chat_messages'. A ValueError names what cannot be answered (an
    InvalidMessageError: a content part, where it is)."""
    turn = chat_messages(req.input, origins)
    _check_call_outputs(req.input, history + turn)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history + turn
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            **req.passed()}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.tools:
        body["tools"] = [t.as_chat() for t in req.tools]
        body["parallel_tool_calls"] = req.parallel_tool_calls
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, NamedFunctionChoice) else choice)
    elif req.tool_choice not in ("auto", "none"):
        raise ValueError("tool_choice \"required\" or a named function needs tools")
    response_format = req.text.format.as_chat()
    if response_format is not None:
        body["response_format"] = response_format
    return body, turn
