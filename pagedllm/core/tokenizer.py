"""A ``tokenizer.json`` tokenizer that does not import transformers.

Importing transformers costs about 0.6 s and 25 MB, most of a warm start of the default
(GGUF) model after torch. A directory that transformers saved for a fast tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) is read here
with the ``tokenizers`` library alone, for the API the engine and the server use: the
same ids, text and chat prompts as transformers' ``TokenizersBackend`` (tests compare
them). Anything else a caller asks of it (``LLM.get_tokenizer()`` hands it to users) is
answered by the transformers tokenizer of the same directory, built on first use.

:func:`load_json_tokenizer` returns ``None`` for a directory whose settings this class
does not reproduce (a tokenizer class other than the stock fast one, clean-up of
tokenization spaces, special tokens outside the vocabulary...): the caller loads it with
transformers instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagedllm.tokenizer")

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_STOCK_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
# tokenizer_config.json keys that change nothing this class does.
_INERT_KEYS = {
    "backend",
    "tokenizer_class",
    "is_local",
    "local_files_only",
    "model_max_length",
    "padding_side",
    "truncation_side",
    "model_input_names",
    "clean_up_tokenization_spaces",
    "extra_special_tokens",
    "chat_template",
    "added_tokens_decoder",
    "name_or_path",
    "split_special_tokens",
    *SPECIAL_TOKEN_NAMES,
}


def _token_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # a serialised AddedToken
        return value.get("content")
    return str(value)


class JSONTokenizer:
    """A fast tokenizer read from the files transformers saves, without transformers."""

    is_fast = True

    def __init__(self, directory: Path, backend: Any, config: dict[str, Any]) -> None:
        self.name_or_path = str(directory)
        self.backend_tokenizer = backend
        self.init_kwargs = config
        self.model_max_length = config.get("model_max_length", int(1e30))
        self.padding_side = config.get("padding_side", "right")
        self.special_tokens_map = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        self.extra_special_tokens = [
            text
            for token in config.get("extra_special_tokens") or []
            if (text := _token_text(token)) is not None
        ]
        self.chat_template: str | dict[str, str] | None = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            self.chat_template = template_file.read_text(encoding="utf-8")
        self._hf: Any = None

    # --------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(
        self, ids: int | Iterable[int], skip_special_tokens: bool = False
    ) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_token_id") and name[: -len("_id")] in SPECIAL_TOKEN_NAMES:
            return self._special_id(name[: -len("_id")])
        if name in SPECIAL_TOKEN_NAMES:
            return self.special_tokens_map.get(name)
        if name.startswith("__") or name in ("_hf", "backend_tokenizer", "name_or_path"):
            raise AttributeError(name)
        # Everything else transformers' tokenizers offer: from the real one.
        return getattr(self.to_transformers(), name)

    # ----------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return self.to_transformers().encode(
                text, add_special_tokens=add_special_tokens, **kwargs
            )
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):
            return self.to_transformers()(text, add_special_tokens=add_special_tokens, **kwargs)
        encoding = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return _Encoding(input_ids=encoding.ids, attention_mask=encoding.attention_mask)

    def decode(
        self,
        token_ids: int | Iterable[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        # (Fast tokenizers ignore spaces_between_special_tokens, as transformers' do.)
        kwargs.pop("spaces_between_special_tokens", None)
        if kwargs or clean_up_tokenization_spaces:
            return self.to_transformers().decode(
                token_ids,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                **kwargs,
            )
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Iterable[Iterable[int]], **kwargs: Any) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in sequences]

    # ---------------------------------------------------------------- chat

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        from pagedllm.core.chat_template import select_template  # (jinja2: first use)

        return select_template(self.chat_template, chat_template, tools)

    def apply_chat_template(
        self,
        conversation: list[Any],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The chat prompt text (``tokenize=False``) or its encoding, as transformers
        renders it; batches and the other options of transformers' method go to
        transformers."""
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        hf_only = {"return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"}
        options = ("return_assistant_tokens_mask", "sanitize_control_tokens")
        if batched or hf_only & set(kwargs) or any(kwargs.get(k) for k in options):
            return self.to_transformers().apply_chat_template(
                conversation,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=tokenize,
                **kwargs,
            )
        for key in options:
            kwargs.pop(key, None)
        return_dict = kwargs.pop("return_dict", True)
        from pagedllm.core.chat_template import render_chat_template

        text = render_chat_template(
            self.get_chat_template(chat_template, tools),
            conversation,
            special_tokens=self.special_tokens_map,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        if not tokenize:
            return text
        # (transformers 5 returns the encoding, input_ids and attention_mask, unless
        # return_dict=False asks for the ids alone.)
        encoding = self(text, add_special_tokens=False)
        return encoding if return_dict else encoding.input_ids

    # ---------------------------------------------------------------- other

    def to_transformers(self) -> Any:
        """transformers' tokenizer of the same files (imports transformers)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            logger.debug("loading the transformers tokenizer of %s", self.name_or_path)
            self._hf = AutoTokenizer.from_pretrained(self.name_or_path)
        return self._hf

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hf": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"JSONTokenizer({self.name_or_path!r}, vocab={len(self)})"


class _Encoding(dict):
    """What ``tokenizer(text)`` returns: ``input_ids`` and ``attention_mask``, as keys
    and as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def load_json_tokenizer(directory: Path) -> JSONTokenizer | None:
    """The tokenizer saved in ``directory``, or ``None`` where transformers is needed
    to reproduce it (see the module's docstring)."""
    json_file = directory / "tokenizer.json"
    config_file = directory / "tokenizer_config.json"
    if not json_file.is_file() or not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("tokenizer_class", "TokenizersBackend") not in _STOCK_CLASSES:
        return None
    if set(config) - _INERT_KEYS or config.get("clean_up_tokenization_spaces"):
        return None
    if (directory / "special_tokens_map.json").exists() or (
        directory / "added_tokens.json"
    ).exists():
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(json_file))
    except Exception as exc:  # (the Rust library raises its own types)
        logger.debug("tokenizers cannot read %s: %s", json_file, exc)
        return None
    tokenizer = JSONTokenizer(directory, backend, config)
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    if any(text not in added for text in tokenizer.all_special_tokens):
        # transformers would add the missing ones to the vocabulary.
        return None
    return tokenizer
