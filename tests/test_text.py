"""Tokens to text, incrementally: what a stream shows equals the whole text decoded at once, cut at
the first stop string (before it for the server, after it for the CLI), whatever the chunking."""

from __future__ import annotations

from functools import cache

from helpers import tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from triedec.api.text import TextStream


@cache
def tokenizer():
    return tiny_tokenizer()


TEXTS = ["Hello there! How are you today? Tell me a story about the sea.", "déjà vu: naïve café ☕ 日本語 テキスト",
         "def quicksort(arr):\n    return sorted(arr)\n", "one two three four five six seven eight nine ten."]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(1, 5), min_size=1, max_size=40),
       st.sampled_from([(), ("e t",), ("sea", "xyz"), ("☕",), ("four five",)]), st.booleans())
def test_streamed_deltas_add_up_to_the_text_decoded_at_once(text, sizes, stops, keep_stop):
    tok = tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stops, keep_stop=keep_stop)
    shown, at = "", 0
    for size in sizes:
        shown += stream.add(ids[at : at + size])
        at += size
        assert "\ufffd" not in shown  # never half a character
        assert not any(s in shown for s in stops) or keep_stop
    shown += stream.add(ids[at:])
    shown += stream.finish()
    whole = tok.decode(ids, skip_special_tokens=True)
    cuts = [whole.index(s) + (len(s) if keep_stop else 0) for s in stops if s in whole]
    assert shown == stream.text == (whole[: min(cuts)] if cuts else whole)
