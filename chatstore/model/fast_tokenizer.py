"""A tokenizer directory of the generic fast class, read with `tokenizers` and jinja2 alone.

Importing transformers costs ~1.2 s of a server's start (its package import and the tokenizer
classes'), more than the model's own load; the tokenizers the server makes itself (a GGUF's,
converted once by default_model.py) are of transformers' generic class (`TokenizersBackend`,
or `PreTrainedTokenizerFast` before transformers 5), whose behaviour is the Rust tokenizer's
plus the chat template. This class does what the server asks of a tokenizer that way:

    encode(text, add_special_tokens=False)   the Rust tokenizer's ids
    decode(ids, skip_special_tokens=...)     the Rust decoder (clean-up of spaces if configured)
    convert_ids_to_tokens(ids)               the vocabulary's pieces
    apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False)
                                             the template rendered in a sandbox set up as
                                             transformers sets up its own (same filters and
                                             globals), messages with None values dropped

Anything else (a call with special tokens added, a chat template asked for as ids or with
transformers' options, a template feature this does not render, an attribute it lacks,
xgrammar's tokenizer reader) goes to the transformers tokenizer, loaded on first use (`hf`).
tests/model/test_fast_tokenizer.py holds every method to transformers' output.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from jinja2 import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import PreTrainedTokenizerBase

# The classes with no behaviour of their own beyond the Rust tokenizer and the template.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # fmt: skip
# Message fields transformers renames before rendering (reasoning under older names): such a
# conversation is rendered by transformers itself.
ALIASED_FIELDS = ("reasoning_content", "thinking", "reasoning")


def generic_tokenizer_config(path: Path) -> dict[str, object] | None:
    """The tokenizer_config.json of `path` when it holds a tokenizer this class reproduces
    (tokenizer.json and a generic class; the chat template in the config or beside it), else
    None."""
    config = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config.is_file():
        return None
    try:
        loaded = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(loaded, dict) or loaded.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    return loaded


class FastTokenizer:
    def __init__(self, path: Path, config: Mapping[str, object] | None = None) -> None:
        """`config`: the directory's tokenizer_config.json as generic_tokenizer_config read it
        (read here when not given)."""
        from tokenizers import Tokenizer

        self.path = path
        self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        if config is None:
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        self._chat_template: str | None = template if isinstance(template, str) else None
        self.special_tokens_map = {
            name: _content(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name)
        }
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._hf: PreTrainedTokenizerBase | None = None
        self._hf_lock = threading.Lock()
        self._compiled: Template | None = None
        self._renders_itself = True  # False: the template needs transformers' own renderer

    # -- what the server uses ------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        self._compiled, self._renders_itself = None, True  # compiled again on next use

    @property
    def decodes_as_backend(self) -> bool:
        """Whether decode(ids, skip_special_tokens=s) is the Rust decoder's (the detokenizer
        then calls that directly)."""
        return not self.clean_up_tokenization_spaces

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens:  # the class's post-processing
            return list(self.hf.encode(text, add_special_tokens=True))
        return list(self.backend_tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        clean = clean_up_tokenization_spaces
        if clean if clean is not None else self.clean_up_tokenization_spaces:
            text = _clean_up_spaces(text)
        return text

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | list[str]:
        if isinstance(ids, int):
            return str(self.backend_tokenizer.id_to_token(ids))
        if skip_special_tokens:
            pieces = self.hf.convert_ids_to_tokens(list(ids), skip_special_tokens=True)
            return [pieces] if isinstance(pieces, str) else list(pieces)
        return [str(self.backend_tokenizer.id_to_token(i)) for i in ids]

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, object]],
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: object,
    ) -> object:
        """The server's call (the text: tokenize=False, nothing else asked) is rendered here;
        any other (ids, a dict, options of transformers') is transformers' own, as it returns
        it, with this tokenizer's template."""
        messages = None if tokenize or kwargs else _plain_messages(conversation)
        compiled = self._template() if messages else None
        if compiled is None:
            kwargs.setdefault("chat_template", self._chat_template)  # as set here
            apply = cast("Callable[..., object]", self.hf.apply_chat_template)
            return apply(
                [dict(m) for m in conversation],
                tools=None if tools is None else [dict(t) for t in tools],
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                **kwargs,
            )
        return compiled.render(
            messages=messages,
            tools=None if tools is None else json.loads(json.dumps(list(tools))),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )

    # -- transformers, for the rest ------------------------------------------------------------

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """transformers' tokenizer of the same directory, loaded (and transformers imported)
        on first use."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(self.path)
            return self._hf

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        return cast("Callable[..., object]", self.hf)(*args, **kwargs)

    def _template(self) -> Template | None:
        """The compiled chat template, or None where transformers must render it (none, or a
        tag of its own extension such as {% generation %})."""
        if self._compiled is None and self._renders_itself and self.chat_template is not None:
            try:
                self._compiled = _sandbox().from_string(self.chat_template)
            except Exception:  # a tag this sandbox lacks: transformers' own renderer
                self._renders_itself = False
        return self._compiled


def _sandbox() -> ImmutableSandboxedEnvironment:
    """A jinja2 sandbox with the options, filters and globals transformers gives templates."""
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: object,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _plain_messages(conversation: Sequence[Mapping[str, object]]) -> list[dict[str, object]] | None:
    """The messages as plain JSON data with None-valued keys dropped (what transformers renders),
    or None where transformers would rewrite them first (reasoning fields, non-dict messages)."""
    messages = []
    for message in conversation:
        if not isinstance(message, Mapping):
            return None
        if any(field in message for field in ALIASED_FIELDS):
            return None
        messages.append({k: v for k, v in message.items() if v is not None})
    try:
        plain: list[dict[str, object]] = json.loads(json.dumps(messages))
    except (TypeError, ValueError):
        return None
    return plain


def _content(token: object) -> str:
    """A special token in tokenizer_config.json: a string, or an AddedToken's fields."""
    return str(token["content"]) if isinstance(token, Mapping) else str(token)


def _clean_up_spaces(text: str) -> str:
    """transformers' clean-up of tokenization spaces (English punctuation and contractions)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):  # fmt: skip
        text = text.replace(before, after)
    return text
