"""The batch runner's lines (``/v1/batches``, batches/lines.py, validation.py) on a fake ChatService,
without a model: a line is held to the server's request limits and parsed once, off the event loop;
what a batch keeps is bounded (metadata, echoed values); an input file must be a batch file."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from pydantic import ValidationError

from mm_pipeline.errors import ECHO_CHARS, echo
from mm_pipeline.server.batches import lines as batch_lines
from mm_pipeline.server.batches.lines import LineTooLong, read_lines
from mm_pipeline.server.batches import validation
from mm_pipeline.server.batches.runner import BatchRunner
from mm_pipeline.server.batches.validation import validate_file
from mm_pipeline.server.errors import APIError
from mm_pipeline.server.json_limits import JSONLimits
from tests.support.batches import LIMITS, URL, FakeService, create_body, finished, line, upload


# ---- 1. a line is a request: the same limits, one parse, off the loop --------------------------------
def test_a_line_over_the_request_limits_fails_validation_naming_it(store, tmp_path):
    numbers = line("many", junk=[1] * 1100)  # 3.4 KB: within the bytes, over the values
    long = line("long", junk="x" * 10_000)
    path = store.path(upload(store, [line("a"), long, line("b"), numbers]))
    total, errors = validate_file(path, URL, LIMITS)
    assert total == 4
    assert [(e.line, e.code) for e in errors] == [(2, "line_too_large"), (4, "too_many_json_values")]
    assert "line 2" in errors[0].message and "4096-byte limit (max_request_bytes)" in errors[0].message
    assert "line 4 holds up to" in errors[1].message and "(max_json_values)" in errors[1].message


def test_a_long_line_is_skipped_in_pieces_and_the_numbering_goes_on(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\r\n" + b"x" * 5000 + b"\n\n" + b"y" * 10 + b"\r\n" + b"z" * 11)
    assert list(read_lines(path, 10)) == [(1, "a\r\n"), (2, LineTooLong(10)), (4, "y" * 10 + "\r\n"),
                                          (5, LineTooLong(10))]


def test_each_line_is_parsed_once_to_validate_and_once_to_answer_off_the_loop(store, monkeypatch):
    parsed, loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: parsed.append(threading.get_ident()) or loads(s, *a, **k))

    async def main():
        runner = BatchRunner(FakeService(), store, 2, LIMITS)
        batch = await finished(runner, runner.create(create_body(upload(store, [line(f"r{i}") for i in range(5)]))).id)
        return batch, threading.get_ident()

    batch, loop_thread = asyncio.run(main())
    assert batch.status == "completed" and batch.request_counts.completed == 5
    assert len(parsed) == 10 and loop_thread not in parsed


# ---- 2. what a batch keeps is bounded ------------------------------------------------------------------
@pytest.mark.parametrize("metadata, named", [
    ({"k" * 65: "v"}, "at most 64 characters"),
    ({"k": "v" * 513}, "at most 512 characters"),
    ({"k": {"nested": ["x"]}}, "must be a string"),
    ({f"k{i}": "v" for i in range(17)}, "16"),
])
def test_metadata_follows_openais_rules(metadata, named):
    with pytest.raises(ValidationError) as exc:
        create_body("file-x", metadata=metadata)
    (error,) = exc.value.errors()
    assert error["loc"] == ("metadata",) and named in str(error["msg"])
    assert "k" * 65 not in str(error["msg"])
    assert create_body("file-x", metadata={"k" * 64: "v" * 512}).metadata


def test_validation_errors_quote_a_line_briefly_and_are_bounded_in_number(store):
    huge = "u" * 100_000
    path = store.path(upload(store, [line(f"c{i}", url=huge) for i in range(150)]))
    _, errors = validate_file(path, URL, JSONLimits(1 << 20, 1 << 20))
    assert len(errors) == validation.MAX_ERRORS_SHOWN
    assert all(len(e.message) < 250 for e in errors) and "…" in errors[0].message

    cid = "d" * 100_000
    path = store.path(upload(store, [line(cid), line(cid)]))
    (dup,) = validate_file(path, URL, JSONLimits(1 << 20, 1 << 20))[1]
    assert dup.code == "duplicate_custom_id" and len(dup.message) < 250 and dup.message.count("d") < 110
    assert dup.line == 2 and dup.message.endswith("is used by an earlier line (line 1)")


def test_a_lone_surrogate_escape_is_a_line_error_and_a_pair_is_text(store):
    """JSON lets a line escape half a UTF-16 pair (\\ud800); json.loads keeps it as a lone surrogate,
    which no tokenizer and no UTF-8 result file takes. Such a line (its custom_id or its text) fails
    validation naming it, before any line runs and before any answer could be lost; an escaped pair
    (an emoji) is just text."""
    lone_id = line("x").replace('"custom_id": "x"', '"custom_id": "\\ud800x"')
    lone_text = line("y").replace('"content": "y"', '"content": "hi \\udfff there"')
    pair = line("z").replace('"content": "z"', '"content": "\\ud83d\\ude00"')
    path = store.path(upload(store, [line("a"), lone_id, lone_text, pair]))
    _, errors = validate_file(path, URL, JSONLimits(1 << 20, 1 << 20))
    assert [(e.line, e.code) for e in errors] == [(2, "invalid_json"), (3, "invalid_json")]
    assert all("not valid Unicode" in e.message for e in errors)

    async def main():
        runner = BatchRunner(FakeService(), store, 1)
        return await finished(runner, runner.create(create_body(upload(store, [line("a"), pair]))).id)

    batch = asyncio.run(main())
    assert batch.status == "completed" and batch.request_counts.completed == 2


def test_a_number_past_pythons_digit_limit_is_named_without_python_advice():
    """json.loads refuses integers over 4300 digits with advice about a Python setting: the line's
    error says what is wrong with the line instead."""
    obj, (code, message) = batch_lines.load_line(3, '{"custom_id": "a", "n": ' + "1" * 5000 + "}")
    assert obj is None and code == "invalid_json"
    assert message == "line 3: not JSON (a number with too many digits)"


def test_an_input_file_must_have_purpose_batch(store):
    async def main():
        BatchRunner(FakeService(), store, 1).create(create_body(upload(store, [line("a")], purpose="user_data")))

    with pytest.raises(APIError) as exc:
        asyncio.run(main())
    assert exc.value.status == 400 and exc.value.param == "input_file_id" and "'batch'" in exc.value.message


def test_the_echo_of_a_value_is_cut_with_an_ellipsis():
    assert echo("short") == "'short'"
    cut = echo("x" * 1000)
    assert len(cut) == ECHO_CHARS and cut.endswith("…")
