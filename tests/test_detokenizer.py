"""Incremental detokenization and exact streaming: both decoders equal a full decode, and a stop
string that spans tokens is never streamed in part."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from conftest import train_tiny_tokenizer
from jaxrunner.engine import detokenizer
from jaxrunner.engine.detokenizer import IncrementalDetokenizer, held_back_length

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France. naïve café",
         "pages hold keys and values; 日本語 😀 end"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


def _full_text(tokenizer, prompt, output):
    """What decoding everything at once gives for the output after ``prompt``'s context."""
    context = prompt[-detokenizer.PROMPT_CONTEXT_TOKENS:]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return decode(context + output)[len(decode(context)):]


def _stream(detok, token_ids):
    """Feed tokens one at a time as the engine does; return every delta and the stop found."""
    deltas, stop = [], None
    for i, token in enumerate(token_ids):
        stop = detok.find_stop(detok.append(token))
        last = stop is not None or i == len(token_ids) - 1
        deltas.append(detok.take_delta(finished=last))
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize("kind", ["stream", "window"])
@pytest.mark.parametrize("text", TEXTS)
def test_decoders_equal_a_full_decode(tokenizer, monkeypatch, kind, text):
    if kind == "window":
        monkeypatch.setattr(detokenizer, "_decode_stream_type", lambda: None)
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt, output = ids[:5], ids[5:]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    expected = detokenizer._StreamDecoder if kind == "stream" else detokenizer._WindowDecoder
    assert isinstance(detok._decoder, expected)
    deltas, _ = _stream(detok, output)
    assert "".join(deltas) == detok.text == _full_text(tokenizer, prompt, output)


def test_multibyte_characters_come_out_whole(tokenizer):
    ids = tokenizer.encode("a 日本語 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, _ = _stream(detok, ids)
    assert all(detokenizer.REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == "a 日本語 😀"


def test_stop_string_spanning_tokens_is_held_back(tokenizer):
    text = "Hello there, hello world and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world and"])
    deltas, stop = _stream(detok, ids)
    assert stop == "world and"
    assert "".join(deltas) == detok.text == "Hello there, hello "
    assert not any("wor" in d for d in deltas)


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("Hello there, hello world and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world"], include_stop_str_in_output=True)
    deltas, stop = _stream(detok, ids)
    assert stop == "world" and "".join(deltas) == "Hello there, hello world"


@pytest.mark.parametrize("stops, expected", [(["def", "c d"], ("c d", "ab")), (["abc def", "bc"], ("bc", "a")),
                                             (["c", "bc"], ("bc", "a"))])
def test_the_stop_reached_first_wins(tokenizer, stops, expected):
    """Several stops complete in one delta: the text is cut at the one it reached first."""
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    ids = tokenizer.encode("abc def", add_special_tokens=False)
    _, stop = _stream(detok, ids)
    assert (stop, detok.text) == expected


def test_held_back_length():
    assert held_back_length("say hel", ["hello"]) == 3
    assert held_back_length("say he", ["hello", "e"]) == 2
    assert held_back_length("say", ["hello"]) == 0
    assert held_back_length("aa", ["aab"]) == 2


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab cd.", min_size=1, max_size=40),
       stops=st.lists(st.text(alphabet="ab cd.", min_size=1, max_size=4), min_size=1, max_size=3))
def test_streamed_text_is_never_taken_back(tokenizer, text, stops):
    """Whatever the text and the stops, every streamed prefix is a prefix of the final text, the
    deltas add up to it, and it is the full text cut at the earliest stop."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    deltas, stop = _stream(detok, ids)
    shown = ""
    for delta in deltas:
        shown += delta
        assert detok.text.startswith(shown)
    assert shown == detok.text
    full = _full_text(tokenizer, [], ids)
    hits = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    assert detok.text == (full[:min(hits)[1]] if hits else full)
    assert (stop is None) == (not hits)
