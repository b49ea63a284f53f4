"""The chat template path of the session API: a turn's prompt extends the saved token ids
exactly, equal to rendering the whole conversation, at a cost independent of its length."""

from __future__ import annotations

import pytest

from chatstore.api.common.chat_template import ChatTemplate


@pytest.fixture(scope="module")
def template():
    from transformers import AutoTokenizer

    from chatstore.model.default_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    return ChatTemplate(tokenizer, (tokenizer.eos_token_id,))


@pytest.mark.parametrize("keep_eos", [True, False])
def test_continue_ids_equals_full_render(template, keep_eos):
    tok = template.tokenizer
    assert template.local_tail  # SmolLM2's template renders each message on its own
    history = [{"role": "system", "content": "Be brief."}]
    saved: list[int] = []
    for i in range(6):
        new = {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}
        prompt = template.continue_ids(saved, history, [new]) if saved else None
        history.append(new)
        prompt = prompt or template.render(history)
        assert prompt == template.render(history)
        reply = f"It is {2 * i}, 😀 naïvely."
        reply_ids = [*tok.encode(reply, add_special_tokens=False), tok.eos_token_id]
        # The store keeps the KV of every token but the last sampled one (the EOS).
        saved = prompt + (reply_ids if keep_eos else reply_ids[:-1])
        history.append({"role": "assistant", "content": reply})


def test_falls_back_to_a_full_render(template):
    history = [{"role": "user", "content": "hi"}]
    assert template.continue_ids([], history, []) == template.render(history)
    history.append({"role": "assistant", "content": ""})
    new = [{"role": "user", "content": "again"}]
    assert template.continue_ids([1, 2, 3], history, new) == template.render(history + new)
