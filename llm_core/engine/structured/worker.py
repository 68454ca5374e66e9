"""The grammar compile worker: a child process (``python -m llm_core.engine.structured.worker``)
that turns constraints into xgrammar's serialized compiled grammars.

Why a process: compiling is CPU work whose cost a request controls -- a JSON schema whose string
``pattern`` holds ``c{1,50000}`` compiled for 270 s on the 2-core host (a regex that size takes
milliseconds). A thread cannot be stopped; a process can: the engine (compiler.py) waits for an
answer up to its time limit and kills this process past it, so one hostile schema costs at most
that many CPU-seconds and a 400, and the next compile starts a fresh worker.

Protocol (stdin / stdout, one JSON document per line):

    parent -> {"tokenizer_info": <TokenizerInfo.serialize_json()>}           once, first
    child  -> {"ready": true}                                                once loaded (the parent's
                                                                             time limit starts after it)
    parent -> {"kind": ..., "text": ..., "disable_any_whitespace": bool}     one per compile
    child  -> {"grammar": <CompiledGrammar.serialize_json()>} | {"error": "message"}
"""

from __future__ import annotations

import json
import sys


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a JSON-escaped literal, which the
    GBNF dialect reads with the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


def compile_one(compiler, request: dict):
    """One request -> xgrammar's CompiledGrammar (raises on a constraint it rejects)."""
    kind, text = request["kind"], request["text"]
    any_ws = not request.get("disable_any_whitespace", False)
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_ws)
    if kind == "json_object":
        # any JSON object (OpenAI's json_object): the schema {"type": "object"}, not any JSON value
        return compiler.compile_json_schema('{"type":"object"}', any_whitespace=any_ws)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    if kind == "grammar":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _error_message(exc: BaseException) -> str:
    # xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
        text = text.removeprefix("Check failed: (error.empty()) is false: ")
    return text[:500]


def main() -> int:
    import xgrammar as xgr

    first = sys.stdin.readline()
    if not first:
        return 0
    info = xgr.TokenizerInfo.deserialize_json(json.loads(first)["tokenizer_info"])
    # one thread: the engine runs one compile at a time and the host's cores serve requests
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            answer = {"grammar": compile_one(compiler, json.loads(line)).serialize_json()}
        except Exception as exc:  # noqa: BLE001 -- every rejection goes back to the request as its message
            answer = {"error": _error_message(exc)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
