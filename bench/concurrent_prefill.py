"""Long prompts arriving together (issue 32): N fresh prompts of ~T tokens sent at the same
moment to one server, one token each; their mean TTFT. chatstore's scheduler prefills them in
arrival order within each step's token budget (vLLM's chunked-prefill FCFS), so the first reply
does not wait for the whole backlog; what the mean measures is the prefill speed of long
contexts with that order.

    concurrent_prefill_ttft_ratio = mean TTFT ours / mean TTFT vLLM (goal <= 1.0)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from peer_servers import Message, PromptMaker, concurrent_streams

PROMPTS = 8
PROMPT_TOKENS = 3700


@dataclass(frozen=True)
class ConcurrentPrefill:
    mean_ttft_s: float
    first_ttft_s: float  # the fastest reply's
    last_ttft_s: float
    prompt_tokens: int  # of the first prompt, as the server counted it


def concurrent_prompts(
    maker: PromptMaker, count: int, tokens: int, tag: str
) -> list[list[Message]]:
    """Distinct fresh prompts (no shared first block, so no prefix-cache reuse between them)."""
    return [maker.fresh_prompt(f"{tag}-{i}", tokens) for i in range(count)]


def measure_concurrent_prefill(url: str, prompts: list[list[Message]]) -> ConcurrentPrefill:
    streams = concurrent_streams(url, prompts, 1)
    ttfts = [s.ttft for s in streams]
    return ConcurrentPrefill(
        statistics.mean(ttfts), min(ttfts), max(ttfts), streams[0].prompt_tokens
    )
