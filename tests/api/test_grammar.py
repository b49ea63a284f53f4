"""The xgrammar constraint on the embedded model's real vocabulary: what its mask allows, the
end of the grammar, and a schema it cannot compile."""

from __future__ import annotations

import pytest
import torch

from chatstore.api.common.errors import APIError
from chatstore.api.openai.grammar import Grammars

pytestmark = pytest.mark.model

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def grammars(default_model) -> Grammars:
    return Grammars(default_model.tokenizer, default_model.spec.vocab_size, (2,))


def allowed(constraint, vocab: int) -> set[int]:
    logits = torch.zeros(1, vocab)
    constraint.mask(logits)
    return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())


def test_mask_follows_the_schema_then_allows_only_eos(grammars, default_model):
    tok, vocab = default_model.tokenizer, default_model.spec.vocab_size
    constraint = grammars.json_schema(SCHEMA, strict=True, field="schema")()
    first = allowed(constraint, vocab)
    assert first and all(tok.decode([t]).startswith("{") for t in first)
    for token in tok.encode('{"n": 42}', add_special_tokens=False):
        assert token in allowed(constraint, vocab)
        constraint.accept(token)
    assert allowed(constraint, vocab) == {2}  # complete: only the end of the turn
    constraint.accept(2)
    assert len(allowed(constraint, vocab)) == vocab  # past the end (ignore_eos): free


def test_json_object_is_an_object(grammars, default_model):
    tok, vocab = default_model.tokenizer, default_model.spec.vocab_size
    constraint = grammars.json_object()()
    assert all(tok.decode([t]).startswith("{") for t in allowed(constraint, vocab))


def test_a_schema_it_cannot_compile_is_a_400_naming_the_field(grammars):
    with pytest.raises(APIError) as err:
        grammars.json_schema({"type": "nope"}, strict=True, field="response_format.x")
    assert err.value.status == 400 and err.value.param == "response_format.x"
