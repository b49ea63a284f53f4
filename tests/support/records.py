"""A session turn written to a record store the way the server writes it."""

from __future__ import annotations

from typing import Any

from chatstore.store.session_kv import SessionKey


def server_turn(records: Any, key: SessionKey, i: int, version: int, tokens: list[int]) -> int:
    """Turn i: 50 new token ids (appended to `tokens`), their chunk list and the turn's two
    messages, in the one write a turn over the API makes (the messages with the KV store's
    chain: store/commit/turn_commit.py); the record's new version."""
    tokens += [1000 * i + j for j in range(50)]
    messages = [
        {"role": "user", "content": f"question-{i}-" + "q" * 200},
        {"role": "assistant", "content": f"answer-{i}-" + "a" * 200},
    ]
    chunks = [f"c{j}" for j in range(len(tokens) // 64)]
    saved = records.append_turn(
        key, version, messages, token_ids=list(tokens), chunks=chunks, kv_tokens=len(tokens)
    )
    return int(saved.version)
