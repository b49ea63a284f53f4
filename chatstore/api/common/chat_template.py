"""Messages -> prompt token ids, with the model's own chat template.

Two ways to build a turn's prompt:

* `render(messages)`: the whole conversation through the template (what an OpenAI client that
  resends its history gets). The store then reuses the longest token prefix it holds.
* `continue_ids(history_ids, history, new)`: the session API's path. The session's saved token
  ids are kept verbatim and only the text the template adds after them is tokenized, so the
  prompt extends the saved KV exactly (re-tokenizing a reply can split it differently):

      history_ids = [ prompt of turn k | reply tokens (+ EOS) ]
      next prompt = history_ids + encode(closing of the reply + new user turn + assistant header)

  When the template renders a message the same whatever precedes it (checked once, on a probe
  conversation), only the last reply is rendered to find that tail: a turn's cost does not grow
  with the length of the conversation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


class RichPrompt(NamedTuple):
    """A conversation as the template's own tool support takes it (api/tools/rendering.py):
    messages with `tool_calls` / `tool_call_id`, and the tool schemas for `tools=`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


_PROBE_HISTORY = [
    {"role": "system", "content": "S."},
    {"role": "user", "content": "Q1?"},
    {"role": "assistant", "content": "A1."},
    {"role": "user", "content": "Q2?"},
    {"role": "assistant", "content": "A2."},
]
_PROBE_NEW = [{"role": "user", "content": "Q3?"}]


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._eos_text = {t: str(tokenizer.decode([t])) for t in eos_token_ids}
        self.local_tail = False
        whole = self._tail(_PROBE_HISTORY, _PROBE_NEW)
        self.local_tail = True
        local = self._tail(_PROBE_HISTORY, _PROBE_NEW)
        self.local_tail = whole is not None and whole == local

    def render_text(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert isinstance(text, str)  # tokenize=False: the text, not ids
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, messages: list[Message]) -> list[int]:
        return self.encode(self.render_text(messages))

    def render_rich(self, prompt: RichPrompt) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            prompt.messages,
            tools=None if prompt.tools is None else list(prompt.tools),  # the schemas, as given
            add_generation_prompt=True,
            tokenize=False,
        )
        assert isinstance(text, str)  # tokenize=False: the text, not ids
        return self.encode(text)

    def continue_ids(
        self, history_ids: list[int], history: list[Message], new: list[Message]
    ) -> list[int]:
        """Prompt ids for `history + new`, reusing `history_ids` verbatim when the template
        allows; falls back to a full render when it does not (or history is empty)."""
        if not history_ids or not history or history[-1]["role"] != "assistant":
            return self.render(history + new)
        tail = self._tail(history, new)
        if tail is None:
            return self.render(history + new)
        eos_text = self._eos_text.get(history_ids[-1])
        if eos_text is not None:  # the saved ids already end with the reply's EOS
            if not tail.startswith(eos_text):
                return self.render(history + new)
            tail = tail[len(eos_text) :]
        return list(history_ids) + self.encode(tail)

    def _tail(self, history: list[Message], new: list[Message]) -> str | None:
        """The text the template puts after the last reply's content when `new` follows it,
        e.g. "<|im_end|>\\n<|im_start|>user\\n...<|im_start|>assistant\\n"; None if unclear."""
        context = history[-1:] if self.local_tail else history
        reply = context[-1]["content"]
        closed = self.render_text(context, add_generation_prompt=False)
        full = self.render_text(context + new)
        end = closed.rfind(reply) + len(reply) if reply else -1
        if not reply or end < len(reply) or not full.startswith(closed):
            return None
        return closed[end:] + full[len(closed) :]
