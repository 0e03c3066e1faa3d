"""The pure parts of `swarm-api`: tokens to text deltas with stop sequences (`api.engine.TextTracker`), the sampler
with transformers' rules (`client.token_stream.Sampler`), and request validation (`api.schemas`)."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from api.engine import TextTracker
from api.schemas import ChatCompletionRequest, CompletionRequest
from client.token_stream import Sampler
from swarm.model import DEFAULT_MODEL, resolve_model


@cache
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).path)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return smollm2_tokenizer()


def deltas(tokenizer: PreTrainedTokenizerBase, text: str, stops: list[str]) -> tuple[list[str], bool]:
    tracker = TextTracker(tokenizer, stops)
    pieces = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        pieces.append(tracker.add(token))
        if tracker.stopped:
            break
    pieces.append(tracker.finish())
    return pieces, tracker.stopped


def test_deltas_add_up_to_the_decoded_text_and_never_split_a_character(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Crème brûlée 🍮 costs 5€, naïve façade: 日本語もOK."
    pieces, stopped = deltas(tokenizer, text, [])
    assert "".join(pieces) == text and not stopped
    assert not any("\ufffd" in piece for piece in pieces)


def test_text_ends_before_the_first_stop_sequence_and_none_of_it_is_sent_early(
    tokenizer: PreTrainedTokenizerBase
) -> None:
    pieces, stopped = deltas(tokenizer, "The answer is 42. END of it. More text.", ["END", "never"])
    assert stopped and "".join(pieces) == "The answer is 42. "
    pieces, stopped = deltas(tokenizer, "a b c\n\nd e f", ["\n\n"])
    assert stopped and "".join(pieces) == "a b c"
    pieces, stopped = deltas(tokenizer, "ENDING", ["ENDX"])  # a prefix that never completes is sent at the end
    assert not stopped and "".join(pieces) == "ENDING"


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=60), stop=st.text(min_size=1, max_size=4))
def test_the_text_sent_is_the_decoded_text_cut_at_the_stop(text: str, stop: str) -> None:
    tokenizer = smollm2_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    tracker = TextTracker(tokenizer, [stop])
    sent = ""
    for token in ids:
        sent += tracker.add(token)
        if tracker.stopped:
            break
    sent += tracker.finish()
    cut = decoded.find(stop)
    assert sent == (decoded if cut < 0 else decoded[:cut])


def test_the_sampler_is_greedy_at_temperature_zero_and_reproducible_under_a_seed() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))
    assert Sampler(temperature=0).choose(logits) == int(logits.argmax())
    first = [Sampler(temperature=1.0, top_p=0.9, seed=3).choose(logits) for _ in range(5)]
    assert len(set(first)) == 1  # a new sampler with the same seed draws the same
    sampler = Sampler(temperature=1.0, seed=3)
    again = Sampler(temperature=1.0, seed=3)
    assert [sampler.choose(logits) for _ in range(20)] == [again.choose(logits) for _ in range(20)]
    with pytest.raises(ValueError):
        Sampler(top_p=0)


def test_top_p_keeps_the_tokens_transformers_keeps() -> None:
    for seed in range(5):
        logits = torch.randn(300, generator=torch.Generator().manual_seed(seed)) * 3
        warped = TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.7)(None, logits[None]))[0]
        allowed = set(torch.nonzero(warped > -float("inf")).flatten().tolist())
        sampler = Sampler(temperature=0.7, top_p=0.8, seed=seed)
        drawn = {sampler.choose(logits) for _ in range(400)}
        assert drawn <= allowed
        assert len(drawn) >= min(len(allowed), 2)


def test_requests_are_validated_with_the_offending_parameter_named() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(base).token_limit() is None
    request = ChatCompletionRequest.model_validate({**base, "max_tokens": 5, "max_completion_tokens": 7,
                                                    "stop": "x", "logit_bias": {}, "user": "u"})
    assert request.token_limit() == 7 and request.stops() == ["x"]
    assert ChatCompletionRequest.model_validate(
        {**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                            "text": "b"}]}]}
    ).messages[0].text() == "ab"
    for bad, field in (({"n": 3}, "n"), ({"top_p": 0}, "top_p"), ({"stop": ["a"] * 5}, "stop"),
                       ({"messages": []}, "messages"), ({"temperature": -1}, "temperature")):
        with pytest.raises(ValidationError) as error:
            ChatCompletionRequest.model_validate({**base, **bad})
        assert error.value.errors()[0]["loc"][0] == field
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["p"]}).text() == "p"
    assert CompletionRequest.model_validate({"model": "m", "prompt": "p"}).max_tokens == 16
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})


def test_the_pages_events_are_what_changed_between_two_reads_of_the_records() -> None:
    from api.swarm_view import changes, coverage, server_view
    from swarm.records import ServerState
    from tests.test_dht import make_record

    before = {"a": make_record("a", "m", 0, 4), "b": make_record("b", "m", 4, 8), "c": make_record("c", "m", 0, 8),
              "e": make_record("e", "m", 0, 0, state=ServerState.joining)}
    after = {
        "a": make_record("a", "m", 0, 2, restorable_start=0, restorable_end=4, drops=1),  # dropped blocks 2:4
        "b": make_record("b", "m", 4, 8, moved_in=2),  # two sessions arrived
        "d": make_record("d", "m", 2, 4),  # joined; c's record expired
        "e": make_record("e", "m", 4, 8),  # got its first blocks
        "f": make_record("f", "m", 0, 0, state=ServerState.joining),  # joined, waiting for its orchestrator's blocks
    }
    events = {(event.kind, event.peer_id, event.detail) for event in changes(before, after, at=1.0)}
    assert events == {("dropped", "a", "blocks 0:4 -> 0:2"), ("moved_in", "b", "2 session(s) arrived"),
                      ("joined", "d", "blocks 2:4"), ("left", "c", "its record expired"),
                      ("blocks", "e", "blocks 0:0 -> 4:8"), ("joined", "f", "waiting for blocks")}
    del after["e"], after["f"]
    restored = {"a": make_record("a", "m", 0, 4, drops=1, restores=1), "b": after["b"],
                "d": make_record("d", "m", 2, 4, state=ServerState.draining)}
    events = {(event.kind, event.peer_id) for event in changes(after, restored, at=2.0)}
    assert events == {("restored", "a"), ("left", "d")}
    assert coverage(restored, 8) == [1, 1, 1, 1, 1, 1, 1, 1]  # the draining server counts for nothing
    assert server_view(after["a"])["restorable"] == [0, 4] and server_view(after["a"])["blocks"] == [0, 2]
