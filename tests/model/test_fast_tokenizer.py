"""FastTokenizer (the server's tokenizer without importing transformers) against transformers'
own tokenizer of the same directory: the embedded model's converted tokenizer, its template and
a Hermes-style tool template, token for token and character for character."""

from __future__ import annotations

import copy
import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

from chatstore.engine.detokenizer import IncrementalDetokenizer, rust_backend
from chatstore.model.default_model import default_model_dir
from chatstore.model.errors import ModelLoadError
from chatstore.model.fast_tokenizer import FastTokenizer, generic_tokenizer_config
from chatstore.model.loader import load_tokenizer
from tests.api.test_tool_rendering import HERMES_TEMPLATE, LOOP, WEATHER

TEXTS = [
    "Hello there",
    " leading space, and punctuation ... ? ! isn't it",
    "Ünïcödé — 日本語のテキスト 🙂🚀 mixed\twith\ttabs\n\nand newlines",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "    indented code:\n\tdef f(x):\n\t\treturn x ** 2  # comment",
    "",
    "a" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Ünïcödé 🙂"},
    ],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok", "name": None}],
    LOOP,
]


@pytest.fixture(scope="module")
def pair():
    path = default_model_dir()
    assert generic_tokenizer_config(path) is not None
    return FastTokenizer(path), AutoTokenizer.from_pretrained(path)


def test_the_server_loads_the_converted_tokenizer_without_transformers_class():
    assert isinstance(load_tokenizer(default_model_dir()), FastTokenizer)


def test_encode_matches(pair):
    fast, hf = pair
    for text in TEXTS:
        assert fast.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        assert fast.encode(text) == hf.encode(text)  # through transformers (special tokens)
    assert len(fast) == len(hf)


def test_decode_and_pieces_match(pair):
    fast, hf = pair
    rng = random.Random(0)
    vocab = len(hf)
    samples = [rng.sample(range(vocab), 12) for _ in range(40)]
    samples += [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    samples += [[i] for i in range(0, vocab, 97)] + [[i] for i in range(20)]
    for ids in samples:
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        if ids:
            assert fast.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])


@pytest.mark.parametrize("template", ["own", "hermes"])
@pytest.mark.parametrize("generation", [True, False])
def test_chat_template_renders_as_transformers_does(pair, template, generation):
    fast, hf = FastTokenizer(pair[0].path), pair[1]
    if template == "hermes":
        hf = copy.copy(hf)
        fast.chat_template = hf.chat_template = HERMES_TEMPLATE
    assert fast.chat_template == hf.chat_template
    rendered = 0
    for messages in CONVERSATIONS:
        for tools in (None, [WEATHER]):
            kw = dict(tools=tools, add_generation_prompt=generation)
            try:
                want = hf.apply_chat_template(messages, tokenize=False, **kw)
            except Exception as exc:  # SmolLM2's template reads content a tool call lacks
                with pytest.raises(type(exc), match=str(exc)):
                    fast.apply_chat_template(messages, tokenize=False, **kw)
                continue
            assert fast.apply_chat_template(messages, tokenize=False, **kw) == want
            rendered += 1
    assert rendered >= 6
    assert fast._hf is None  # none of it needed transformers' tokenizer
    # ids, or transformers' own options: its answer, with this tokenizer's template
    for options in ({}, {"return_dict": False}, {"return_dict": True}):
        messages = CONVERSATIONS[1]
        got = fast.apply_chat_template(messages, add_generation_prompt=generation, **options)
        assert got == hf.apply_chat_template(messages, add_generation_prompt=generation, **options)


def test_template_errors_and_fallbacks(pair):
    fast, hf = pair
    raising = copy.copy(fast)
    raising.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(Exception, match="no system role"):
        raising.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    # a field transformers renames first: rendered by transformers itself, the same text
    reasoning = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "reasoning_content": "because"},
    ]
    want = hf.apply_chat_template(reasoning, tokenize=False)
    assert FastTokenizer(fast.path).apply_chat_template(reasoning, tokenize=False) == want


def test_the_detokenizer_streams_the_same_text(pair):
    fast, hf = pair
    assert rust_backend(fast) is fast.backend_tokenizer
    ids = hf.encode(TEXTS[2] + TEXTS[1], add_special_tokens=False)
    streams = []
    for tok in (fast, hf):
        detok = IncrementalDetokenizer(tok)
        streams.append("".join(detok.append(i) for i in ids) + detok.flush())
    assert streams[0] == streams[1] == hf.decode(ids, skip_special_tokens=True)


def test_other_classes_stay_with_transformers(tmp_path):
    path = tmp_path / "tok"
    shutil.copytree(default_model_dir(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert generic_tokenizer_config(path) is None
    assert not isinstance(load_tokenizer(path), FastTokenizer)


def test_chatstore_tokenizer_setting(monkeypatch):
    monkeypatch.setenv("CHATSTORE_TOKENIZER", "transformers")
    assert not isinstance(load_tokenizer(default_model_dir()), FastTokenizer)
    monkeypatch.setenv("CHATSTORE_TOKENIZER", "rust")
    with pytest.raises(ModelLoadError, match="CHATSTORE_TOKENIZER='rust'"):
        load_tokenizer(default_model_dir())
