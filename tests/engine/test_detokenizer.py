"""Incremental detokenization (real SmolLM2 tokenizer) and stop-string matching."""

from __future__ import annotations

import pytest

from chatstore.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, rust_backend

TEXTS = [
    "Hello, world! How are you today?",
    "  two leading spaces,   and   runs of   spaces ",
    "Héllo naïve café, Ångström, Zürich, São Paulo, œuvre",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 then 🙂",
    "日本語のテキストと中文的句子，还有한국어",
    "mixed: ñ 漢字 🙂 ∑ x² → ∞\n\tnew line and tab",
    "😀",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from chatstore.model import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def deltas(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    out = [detok.append(token) for token in ids]
    assert detok.text == "".join(out)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    out = deltas(tokenizer, ids)
    assert "".join(out) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in delta for delta in out)


def test_split_multibyte_characters_are_held_back(tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # the byte-level BPE splits the emoji over several tokens
    out = deltas(tokenizer, ids)
    assert out[:-1] == [""] * (len(ids) - 1)
    assert out[-1] == "😀"


def test_flush_releases_an_unfinished_character(tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.append(token) for token in ids[:-1])
    assert text == "ok"
    tail = detok.flush()
    assert text + tail == tokenizer.decode(ids[:-1])
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    ids = [*tokenizer.encode("Hi there"), 2, *tokenizer.encode(" again")]
    assert "".join(deltas(tokenizer, ids)) == "Hi there again"
    kept = "".join(deltas(tokenizer, ids, skip_special_tokens=False))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) == "Hi there<|im_end|> again"


def test_chat_reply_streams_like_its_decode(tokenizer) -> None:
    text = "Sure! Here's a list:\n1. Crème brûlée 🍮\n2. 寿司 🍣\n<|im_end|>"
    ids = tokenizer.encode(text)
    assert "".join(deltas(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_fast_tokenizers_decode_through_their_rust_backend(tokenizer) -> None:
    """The backend's decode (no transformers wrapper) streams exactly the wrapper's deltas."""
    assert rust_backend(tokenizer) is tokenizer.backend_tokenizer
    special = [*tokenizer.encode("Hi"), 2, *tokenizer.encode(" 🙂 again"), 1]
    for ids in [tokenizer.encode(text) for text in TEXTS] + [special]:
        for skip in (True, False):
            fast = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            slow = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            slow._backend = None
            assert [fast.append(t) for t in ids] == [slow.append(t) for t in ids]
            assert fast.flush() == slow.flush()


def test_tokenizers_with_their_own_decode_keep_it(tokenizer) -> None:
    class Custom(type(tokenizer)):
        def _decode(self, token_ids, **kwargs) -> str:
            return "x" * len(token_ids)

    class Plain:
        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return "y" * len(ids)

    custom = Custom.__new__(Custom)
    custom.__dict__.update(tokenizer.__dict__)
    assert rust_backend(custom) is None
    assert rust_backend(Plain()) is None
    assert IncrementalDetokenizer(Plain()).append(5) == "y"


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    return out, False


def test_no_stop_strings_pass_text_through() -> None:
    matcher = StopStringMatcher(())
    assert feed_all(matcher, ["a", "bc"]) == (["a", "bc"], False)
    assert matcher.flush() == ""


def test_stop_string_within_one_piece() -> None:
    out, stopped = feed_all(StopStringMatcher(("STOP",)), ["Hello ", "there STOP now"])
    assert stopped
    assert "".join(out) == "Hello there "


def test_stop_string_spanning_two_pieces_is_never_emitted() -> None:
    out, stopped = feed_all(StopStringMatcher(("lo w",)), ["Hel", "lo wor", "ld"])
    assert stopped
    assert out == ["He", "l"]  # "l" is held back after "Hel": it might start "lo w"


def test_stop_string_spanning_three_pieces() -> None:
    matcher = StopStringMatcher(("</answer>",))
    out, stopped = feed_all(matcher, ["42 </", "ans", "wer> trailing"])
    assert stopped
    assert out == ["42 ", "", ""]
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_held_text_is_released_when_the_match_fails() -> None:
    matcher = StopStringMatcher(("lo w",))
    assert matcher.feed("Hel") == ("He", False)  # "l" might start "lo w"
    assert matcher.feed("lo") == ("l", False)  # "lo" might too
    assert matcher.feed("ng") == ("long", False)
    assert matcher.feed(" lo") == (" ", False)
    assert matcher.flush() == "lo"


def test_flush_releases_held_text_at_the_end() -> None:
    matcher = StopStringMatcher(("###",))
    out, stopped = feed_all(matcher, ["abc #", "#"])
    assert not stopped
    assert "".join(out) == "abc "
    assert matcher.flush() == "##"
    assert matcher.flush() == ""


def test_multiple_stop_strings_the_earliest_wins() -> None:
    matcher = StopStringMatcher(("END", "\n\n", "e\n"))
    out, stopped = feed_all(matcher, ["one\n", "\ntwo END"])
    assert stopped
    assert "".join(out) == "on"  # "e\n" starts before "\n\n"


def test_multiple_stop_strings_overlapping_prefixes() -> None:
    matcher = StopStringMatcher(("abcd", "bx"))
    out, stopped = feed_all(matcher, ["zab", "c", "x"])
    assert not stopped
    assert "".join(out) + matcher.flush() == "zabcx"
    matcher = StopStringMatcher(("abcd", "bx"))
    out, stopped = feed_all(matcher, ["zab", "x"])
    assert stopped
    assert "".join(out) == "za"


def test_stop_string_at_the_very_start() -> None:
    assert StopStringMatcher(("Hi",)).feed("Hi there") == ("", True)


def test_detokenizer_and_stop_matcher_together(tokenizer) -> None:
    text = "The answer is 42.\nObservation: done"
    detok, matcher = IncrementalDetokenizer(tokenizer), StopStringMatcher(("\nObservation:",))
    emitted, stopped = [], False
    for token in tokenizer.encode(text):
        piece, stopped = matcher.feed(detok.append(token))
        emitted.append(piece)
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "The answer is 42."
