"""vLLM's ``prompt_logprobs``, echo with logprobs (how lm-eval scores a text) and
``return_tokens_as_token_ids`` through the OpenAI server (the demo checkpoint, in process): the prompt's logprobs agree with the logprob the same
model gave a generated token (a prompt that ends with it scores it alike), echo puts them in the
legacy format with the first token's None, streamed or not; a plain answer keeps OpenAI's shape;
streaming with prompt_logprobs and out-of-range values are 400s."""

from __future__ import annotations

import json

import httpx
import pytest

from mm_pipeline.server import ServerSettings, ServerThread, create_app
from tests.support.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="samples/demo-model missing"),
              pytest.mark.usefixtures("one_thread")]

PROMPT = "A red square and a blue circle are"


def complete(demo_client, **body) -> dict:
    r = demo_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_prompt_scores_a_token_as_generation_did(demo_client, tokenizer):
    """Greedy generation gives token t with logprob x; the prompt extended by t scores t at x."""
    first = complete(demo_client, max_tokens=1, logprobs=0, prompt_logprobs=2)
    choice = first["choices"][0]
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    scored = choice["prompt_logprobs"]
    assert len(scored) == first["usage"]["prompt_tokens"] == len(ids) and scored[0] is None
    for tid, entry in zip(ids[1:], scored[1:]):
        mine = entry[str(tid)]  # the prompt's own token, with its rank, beside the top 2
        assert mine["rank"] >= 1 and mine["decoded_token"] == tokenizer.decode([tid])
        assert len(entry) in (2, 3) and min(e["rank"] for e in entry.values()) == 1
        top = sorted(entry.values(), key=lambda e: e["rank"])
        assert top[0]["logprob"] >= mine["logprob"]
    text = choice["logprobs"]["tokens"][0]  # the generated token, as its text: back to its id
    (token,) = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) == text]
    again = demo_client.post("/v1/completions", json={"prompt": ids + [token], "max_tokens": 1, "temperature": 0,
                                                 "prompt_logprobs": 0}).json()
    last = again["choices"][0]["prompt_logprobs"][-1][str(token)]
    assert last["rank"] == 1  # greedy chose it
    assert last["logprob"] == pytest.approx(choice["logprobs"]["token_logprobs"][0], abs=1e-4)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(demo_client, tokenizer):
    body = {"echo": True, "logprobs": 1, "max_tokens": 2, "ignore_eos": True}
    out = complete(demo_client, **body)["choices"][0]
    n = len(tokenizer.encode(PROMPT, add_special_tokens=False))
    lp = out["logprobs"]
    assert out["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == n + 2 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    scored = complete(demo_client, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert lp["token_logprobs"][1:n] == pytest.approx([e[str(t)]["logprob"] for t, e in zip(ids[1:], scored[1:])],
                                                      abs=1e-5)
    # streamed: the echo chunk carries the prompt's logprobs, then the tokens' own follow
    with demo_client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "stream": True,
                                                        **body}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in streamed:
            streamed[key] += (c["choices"][0].get("logprobs") or {}).get(key, [])
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)


def test_chat_answers_carry_the_prompt_logprobs_once(demo_client):
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 2, "temperature": 0, "n": 2,
            "prompt_logprobs": 1}
    out = demo_client.post("/v1/chat/completions", json=body).json()
    assert len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"]  # one prompt for the n choices
    assert out["prompt_logprobs"][0] is None and all(len(e) in (1, 2) for e in out["prompt_logprobs"][1:])


def test_a_plain_answer_has_no_prompt_logprobs_key(demo_client):
    assert "prompt_logprobs" not in complete(demo_client)["choices"][0]
    chat = demo_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 1}).json()
    assert "prompt_logprobs" not in chat


@pytest.mark.parametrize("body,needle", [
    ({"prompt_logprobs": 1, "stream": True}, "not available with stream"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_400s(demo_client, body, needle):
    for path, base in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = demo_client.post(path, json={**base, "max_tokens": 1, **body})
        assert r.status_code == 400 and needle in r.text, r.text


def test_tokens_as_token_ids_name_each_logprob_entry_by_its_id(demo_client, demo_engine, tokenizer, tmp_path):
    """vLLM's return_tokens_as_token_ids: "token_id:<id>" wherever a logprob entry names a token
    (chat content and tops, completion tokens and top keys, an echoed prompt), the same answer;
    the server flag sets the default and a request's own field wins."""
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    plain = demo_client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    ids = demo_client.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True}).json()
    content = ids["choices"][0]["logprobs"]["content"]
    assert [tokenizer.decode([int(e["token"].split(":")[1])]) for e in content] == [e["token"] for e in plain]
    for e in content:
        assert e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
        assert all(t["token"].startswith("token_id:") for t in e["top_logprobs"]) and len(e["top_logprobs"]) == 2
    echoed = complete(demo_client, echo=True, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert echoed["tokens"][:len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    assert all(k.startswith("token_id:") for top in echoed["top_logprobs"][1:] for k in top)
    app = create_app(demo_engine, ServerSettings(files_dir=str(tmp_path), return_tokens_as_token_ids=True))
    with ServerThread(app) as served, httpx.Client(base_url=served.base_url, timeout=120) as c:
        on = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
        off = c.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": False}).json()
    assert [e["token"] for e in on] == [e["token"] for e in content]
    assert [e["token"] for e in off["choices"][0]["logprobs"]["content"]] == [e["token"] for e in plain]


def test_the_server_flag(tmp_path):
    from mm_pipeline import cli
    from mm_pipeline.server.launch.serve_settings import server_settings

    assert ServerSettings().return_tokens_as_token_ids is False
    args = cli.parse_args(["serve", "--model", "m", "--return-tokens-as-token-ids"])
    assert server_settings(args, tmp_path).return_tokens_as_token_ids is True
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"return_tokens_as_token_ids": True}))
    assert server_settings(cli.parse_args(["serve", "--model", "m", "--config", str(path)]),
                               tmp_path).return_tokens_as_token_ids is True


def test_one_choice_scores_the_prompt_for_all(demo_client, demo_engine, monkeypatch):
    """n choices of one prompt: the first alone computes prompt logprobs (no n copies held), and every
    choice of a completion carries them; chat answers carry them once."""
    handed = []
    submit = demo_engine.runtime.submit

    def recording(request_id, token_ids, params, *args, **kwargs):
        handed.append(params.prompt_logprobs)
        return submit(request_id, token_ids, params, *args, **kwargs)

    monkeypatch.setattr(demo_engine.runtime, "submit", recording)
    out = complete(demo_client, n=3, prompt_logprobs=1, temperature=1.0, seed=4)
    assert sorted(handed, key=str) == [1, None, None]
    first = out["choices"][0]["prompt_logprobs"]
    assert first[0] is None and len(first) == out["usage"]["prompt_tokens"]
    assert all(c["prompt_logprobs"] == first for c in out["choices"])
    handed.clear()
    echoed = complete(demo_client, n=2, echo=True, logprobs=1)
    assert sorted(handed, key=str) == [1, None]
    a, b = (c["logprobs"] for c in echoed["choices"])
    n = echoed["usage"]["prompt_tokens"]
    assert a["token_logprobs"][:n] == b["token_logprobs"][:n] and a["token_logprobs"][0] is None
    handed.clear()
    demo_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                   "max_tokens": 1, "prompt_logprobs": 0})
    assert sorted(handed, key=str) == [0, None]


def test_an_answer_without_prompt_logprobs_from_the_engine_says_null(tokenizer):
    """Found by the schema fuzz through /invocations (a scripted engine that computes none): a 500
    before; an engine or replica that gives none makes the field null, not a failed answer."""
    from mm_pipeline.server.completions.choices import TokenStrings

    assert TokenStrings(tokenizer).prompt_logprobs([5, 6, 7], None, 2) is None
