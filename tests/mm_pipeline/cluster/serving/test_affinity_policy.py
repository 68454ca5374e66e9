"""The LLM router's choice (mm_pipeline/cluster/serving/affinity_policy.py + route_key.py): a conversation's
next turn and a new question about the same media go where their prefix went; load breaks ties and
caps a hot prefix; new conversations spread."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from mm_pipeline.cluster.serving.affinity_policy import AffinityConfig, AffinityPolicy
from mm_pipeline.cluster.serving.route_key import key_of_messages, media_key
from mm_pipeline.cluster.serving.router_state import MemoryPrefixIndex


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def image(data: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def route(policy: AffinityPolicy, messages: list[dict], loads: dict[str, float]) -> str:
    key = key_of_messages(messages, encode)
    best = policy.rank(key, loads)[0]
    policy.dispatched(best, key)
    return best


def test_conversation_turns_stay_on_one_replica():
    policy = AffinityPolicy(MemoryPrefixIndex())
    loads = {"r0": 0.0, "r1": 0.0, "r2": 0.0}
    history = [{"role": "system", "content": "You are a careful agent. " * 8}]
    seen = set()
    for turn in range(6):
        history.append({"role": "user", "content": f"step {turn}: run the tool and report " * 3})
        seen.add(route(policy, history, loads))
        history.append({"role": "assistant", "content": f"result {turn} " * 5})
        loads = {r: (5.0 if r in seen else 0.0) for r in loads}  # its own turns load the chosen replica
    assert len(seen) == 1


def test_same_media_goes_where_it_went_first():
    policy = AffinityPolicy(MemoryPrefixIndex())
    loads = {"r0": 0.0, "r1": 0.0}
    first = route(policy, [{"role": "user", "content": [image("QUJD" * 50), {"type": "text", "text": "what?"}]}], loads)
    other = {"r0": 1.0, "r1": 1.0}
    other[first] = 2.0  # busier, but it holds the media's KV
    again = route(policy, [{"role": "user", "content": [image("QUJD" * 50), {"type": "text", "text": "colour?"}]}],
                  other)
    assert again == first


def test_media_key_names_content_not_part_type():
    assert media_key(image("QUJD")) == media_key(image("QUJD")) != media_key(image("QUJE"))
    assert media_key({"type": "file", "file": {"file_id": "file-1"}}) != media_key(image("QUJD"))


def test_media_key_names_audio_codes_by_their_bytes():
    from mm_pipeline.media.audio_codes import parse_codes

    def codes(rows):
        return {"type": "input_audio_codes", "input_audio_codes": {"codes": parse_codes(rows, "codes")}}

    assert media_key(codes([[1, 2], [3, 4]])) == media_key(codes([[1, 2], [3, 4]]))
    assert media_key(codes([[1, 2], [3, 4]])) != media_key(codes([[1, 2, 3, 4]]))  # same values, other shape
    assert media_key({"type": "input_audio_codes", "input_audio_codes": {"codes": [[1, 2]]}}) is not None


@given(st.integers(2, 8), st.integers(8, 64))
def test_new_conversations_spread(replicas, conversations):
    policy = AffinityPolicy(MemoryPrefixIndex())
    names = [f"r{i}" for i in range(replicas)]
    loads = dict.fromkeys(names, 0.0)
    counts = dict.fromkeys(names, 0)
    for c in range(conversations):
        msgs = [{"role": "user", "content": f"conversation {c} " * 4}]
        r = route(policy, msgs, loads)
        loads[r] += key_of_messages(msgs, encode).total  # its prompt is queued there (nothing finishes)
        counts[r] += 1
    # with load in the score no replica takes much more than its share of fresh prefixes
    assert max(counts.values()) <= conversations / replicas + 2


def test_hot_prefix_is_capped_by_load():
    policy = AffinityPolicy(MemoryPrefixIndex(), AffinityConfig(match_weight=2.0, max_load_ratio=2.0))
    loads = {"r0": 0.0, "r1": 0.0}
    picks = Counter()
    for i in range(40):
        r = route(policy, [{"role": "system", "content": "same long system prompt " * 10},
                           {"role": "user", "content": "q"}], loads)
        picks[r] += 1
        loads[r] += 10.0
    assert min(picks.values()) > 0, picks  # the other replica took some once the first was over the cap


def test_forget_drops_a_dead_replica():
    policy = AffinityPolicy(MemoryPrefixIndex())
    msgs = [{"role": "user", "content": "hello there " * 10}]
    key = key_of_messages(msgs, encode)
    policy.dispatched("r0", key)
    assert policy.index.match(key.hashes, ["r0"])["r0"] == len(key.hashes)
    policy.forget(["r0"])
    assert policy.index.match(key.hashes, ["r0"])["r0"] == 0
