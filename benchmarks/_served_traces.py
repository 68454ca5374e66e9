"""Traces replayed through ``mmserve serve`` over HTTP (``prefix_cache.py --served``): what a client of
a default-flag server gets from the prefix cache, read from ``usage.prompt_tokens_details.cached_tokens``.

    agent trace       one long shared system prompt; conversations of tool outputs + questions, each
                      turn sent with the whole history (the assistant's replies included), several
                      conversations at once: prefix_cache.py's model-free agent trace scaled by 1/4
                      in tokens (system ~750, a turn's new text ~25-85, 5-12 turns) to fit the demo
                      model's 2048-token context
                      hit rate = cached prompt tokens / prompt tokens, over every request
    question/media    every sample (videos, images, audio) asked several different questions, one
                      after the other, interleaved across samples
                      media hit rate = sum min(cached, media end) / sum media end over the follow-up
                      questions (media end: the prompt position after the media item)

Only whole pages are cached, and a match leaves one token to compute (docs/kv_cache.md §2).
"""

from __future__ import annotations

import base64
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tokenizers import Tokenizer

WORDS = ("red blue green yellow square circle triangle star moves left right up down fast slow beep tone "
         "high low frame shape colour count sees hears then after before").split()
QUESTIONS = ("What shapes do you see?", "Which colours appear, and in what order?", "What comes next?",
             "Describe it again in five words.", "Is anything moving?", "What is the last thing in it?")
# what the chat template puts after the last user content part (samples/demo-model/chat_template.jinja)
AFTER_CONTENT = "<|im_end|>\n<|im_start|>assistant\n"


def _chat(base_url: str, messages: list[dict], max_tokens: int) -> dict:
    r = httpx.post(base_url + "/v1/chat/completions", timeout=300,
                   json={"model": "demo-model", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def agent_plans(conversations: int, turns: tuple[int, int], system_words: int,
                seed: int = 0) -> tuple[str, list[list[tuple[str, str]]]]:
    """The agent trace's system prompt and, per conversation, its turns (tool output, question)."""
    rng = random.Random(seed)
    system = "You are a tool-using agent. Tools: " + _text(rng, system_words)
    return system, [[(_text(rng, rng.randint(6, 22)), _text(rng, rng.randint(1, 3)) + "?")
                     for _ in range(rng.randint(*turns))] for _ in range(conversations)]


def agent_mean_prompt_tokens(model_dir: Path, *, conversations: int, turns: tuple[int, int], system_words: int,
                             max_tokens: int, seed: int = 0) -> float:
    """Mean prompt of the agent trace's requests, in tokens, estimated before it runs (every reply
    ``max_tokens`` long, ~5 template tokens per message): the mean length of a live conversation's
    prefix, to size the replicas' KV pools against. The run measures the real figure."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    n = lambda text: len(tok.encode(text, add_special_tokens=False).ids) + 5  # noqa: E731 - role + delimiters
    system, plans = agent_plans(conversations, turns, system_words, seed)
    prompts = []
    for plan in plans:
        history = n(system)
        for tool, question in plan:
            history += n(f"Tool output: {tool}\n{question}")
            prompts.append(history + 3)  # the assistant header
            history += n("") + max_tokens
    return sum(prompts) / len(prompts)


def agent_trace(base_url: str, *, conversations: int, turns: tuple[int, int], system_words: int,
                concurrency: int, max_tokens: int, seed: int = 0) -> dict:
    system_text, plans = agent_plans(conversations, turns, system_words, seed)
    system = {"role": "system", "content": system_text}

    def run(plan: list[tuple[str, str]]) -> tuple[int, int, int]:
        messages, prompt, cached, requests = [system], 0, 0, 0
        for tool, question in plan:
            # the API takes no "tool" role: the tool's output comes in the user turn, as agents relay it
            messages.append({"role": "user", "content": f"Tool output: {tool}\n{question}"})
            answer = _chat(base_url, messages, max_tokens)
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            prompt += answer["usage"]["prompt_tokens"]
            cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            requests += 1
        return prompt, cached, requests

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(run, plans))
    prompt, cached, requests = (sum(r[i] for r in results) for i in range(3))
    return dict(requests=requests, prompt_tokens=prompt, cached_tokens=cached, hit_rate=cached / prompt)


def media_part(path: Path) -> dict:
    data = base64.b64encode(path.read_bytes()).decode()
    if path.name.startswith("audio"):
        return {"type": "input_audio", "input_audio": {"data": data, "format": path.suffix.lstrip(".")}}
    kind = "video" if path.name.startswith("video") else "image"
    return {"type": f"{kind}_url", f"{kind}_url": {"url": f"data:application/octet-stream;base64,{data}"}}


def question_per_media_trace(base_url: str, model_dir: Path, media: list[Path], *, questions: int,
                             max_tokens: int) -> dict:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rows = []
    for q in range(questions):  # round-robin: other media requests run between two questions
        for path in media:
            question = QUESTIONS[q % len(QUESTIONS)]
            answer = _chat(base_url, [{"role": "user", "content": [media_part(path),
                                                                    {"type": "text", "text": question}]}], max_tokens)
            usage = answer["usage"]
            end = usage["prompt_tokens"] - len(tok.encode(question + AFTER_CONTENT, add_special_tokens=False).ids)
            rows.append((path.name, q, end, usage["prompt_tokens_details"]["cached_tokens"]))
    follow = [(end, min(cached, end)) for _, q, end, cached in rows if q > 0]
    return dict(requests=len(rows), media_tokens=sum(e for e, _ in follow),
                cached_media_tokens=sum(c for _, c in follow),
                media_hit_rate=sum(c for _, c in follow) / sum(e for e, _ in follow))
