"""Request bodies -> the engine's SamplingParams (field names kept, so errors name them)."""

from __future__ import annotations

from chatstore.api.common.errors import bad_param
from chatstore.api.common.protocol import SamplingFields
from chatstore.engine.request import SamplingParams

MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS = 300
_SEED_MASK = (1 << 63) - 1


def to_sampling(body: SamplingFields, default_max_tokens: int) -> SamplingParams:
    both = body.max_tokens is not None and body.max_completion_tokens is not None
    if both and body.max_tokens != body.max_completion_tokens:
        raise bad_param("max_tokens", "max_tokens and max_completion_tokens disagree")
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=None if body.seed is None else body.seed & _SEED_MASK,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias),
        stop=_stop(body.stop),
        ignore_eos=body.ignore_eos,
        n=body.n,
    )


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop sequences")
    if any(not s for s in items):
        raise bad_param("stop", "stop sequences must be non-empty")
    return tuple(items)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_param("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_param("logit_bias", f"key {key[:32]!r} is not a token id") from None
        out[token] = value
    return out
