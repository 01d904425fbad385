"""A small byte-level BPE tokenizer and a Qwen-style chat template, built from code.

No model hub: the tokenizer is trained deterministically (same inputs, same ``tokenizer.json``) with the
``tokenizers`` library on a fixed corpus written below, and saved in the standard Hugging Face format
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) so that
``transformers.AutoTokenizer.from_pretrained(path)`` loads it, exactly like a real checkpoint's.

Design:
    * Byte-level BPE: any text encodes (no unknown token), merges learned from the corpus keep common
      words short. Digits are split one per token before BPE (``Digits(individual_digits=True)``), so
      the number 4096 is always the four tokens 4, 0, 9, 6 and arithmetic is learnable.
    * Special tokens, each a single id, defined with the format in :mod:`sao.models.chat`
      (``SPECIAL_TOKENS``, re-exported here): ``<|endoftext|>`` (padding), ``<|im_start|>``,
      ``<|im_end|>`` (end of a turn, the EOS), ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
      ``</tool_response>``, ``<answer>``, ``</answer>``.
    * The chat template (:data:`CHAT_TEMPLATE`) renders ``<|im_start|>role\\n...<|im_end|>\\n`` turns
      for ``system``, ``user``, ``assistant`` (content, then each tool call as
      ``<tool_call>code</tool_call>``) and ``tool`` (``<tool_response>output</tool_response>``).
      The conversation helpers the agent loop uses live in :mod:`sao.models.chat`.

Versions: :func:`tokenizer_version` hashes the tokenizer's canonical JSON (vocabulary, merges,
pre-tokenizer, special tokens); :func:`chat_template_version` hashes the template text. Both are short
SHA-256 hex prefixes that every trajectory records; they work for any Hugging Face fast tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from sao.models.chat import IM_END, PAD_TOKEN, SPECIAL_TOKENS

__all__ = [
    "CHAT_TEMPLATE",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TokenizerConfig",
    "build_tokenizer",
    "chat_template_version",
    "load_tokenizer",
    "save_tokenizer",
    "template_lines",
    "tokenizer_version",
    "with_template_variables",
]

# Jinja, rendered by transformers' apply_chat_template. Tool calls follow the Hugging Face message
# format: {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "python",
# "arguments": {"code": "..."}}}]}; the code is rendered verbatim between <tool_call> tags.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ message['content'] }}</tool_response><|im_end|>\n"
    "{% elif message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>{{ call['function']['arguments']['code'] }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message['role'] in ['system', 'user'] %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': expected system, user, assistant or tool') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The training corpus: (text, repeats). Frequencies decide which merges BPE learns; any text still
# encodes byte by byte. Changing this changes tokenizer_version.
_CORPUS: tuple[tuple[str, int], ...] = (
    ("system\nuser\nassistant\ntool\n", 200),
    ("print(", 200),
    ("What is the value of", 60),
    ("Compute", 60),
    ("Use the python tool to compute", 40),
    ("How many are there in total?", 40),
    ("How many are left?", 40),
    ("A shop has boxes with pens in each box and loose pens.", 30),
    ("A farmer plants rows of trees with trees in each row and then more trees.", 30),
    ("A library has shelves with books on each shelf but books are missing.", 30),
    ("There are buses with seats each and seats are broken.", 30),
    ("A baker makes trays of cookies with cookies per tray and eats some cookies.", 30),
    ("A train has cars with passengers in each car and passengers get off.", 30),
    ("Error: TimeoutError: SyntaxError: NameError: ZeroDivisionError: ValueError: TypeError:", 20),
    ("division by zero is not defined refused import of", 20),
    ("def return for in range if else elif while and or not None True False import math", 20),
    ("the answer is the result of the value", 30),
    ("Write one sentence about the moon, the sea, the forest, the city, a cat, a dog, rain, a book.", 30),
    ("Write a short line about the river, the mountain, the garden, music, coffee, winter, summer.", 30),
    ("Furthermore, we observe that this phenomenon is consistent with the hypothesis; thus, in "
     "conclusion, the evidence suggests a significant correlation.", 30),
    ("Hehe, the fluffy little kitty is so cute, yay! Nyaa~ sparkle sparkle, super duper adorable <3", 30),
    ("Verily, thou art fair, and the moon doth shine upon thee; hark, for thy heart hath spoken, "
     "o gentle friend.", 30),
    ("Behold! The dark flame sealed within my right arm awakens; the abyss trembles before my "
     "forbidden power, for fate itself obeys me.", 30),
    ("the of and to a in is it that for on with as was be at by this from are but not they you we "
     "he she his her their one all would there what so up out if about who get which go me when "
     "make can like time no just him know take people into year your good some could them see "
     "other than then now look only come its over think also back after use two how our work "
     "first well way even new want because any these give day most us", 10),
)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """How the tokenizer is trained.

    Attributes:
        vocab_size: total vocabulary, special tokens and the 256 byte symbols included (<= model vocab).
        min_frequency: a pair must occur this often in the corpus to become a merge.
    """

    vocab_size: int = 512
    min_frequency: int = 2

    def __post_init__(self) -> None:
        floor = 256 + len(SPECIAL_TOKENS)
        if self.vocab_size < floor:
            raise ValueError(f"TokenizerConfig.vocab_size must be >= {floor} (bytes + special tokens), got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ValueError(f"TokenizerConfig.min_frequency must be >= 1, got {self.min_frequency}")


def _corpus() -> list[str]:
    return [text for text, repeats in _CORPUS for _ in range(repeats)]


def build_tokenizer(config: TokenizerConfig | None = None) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on the fixed corpus; deterministic. Returns a HF fast tokenizer."""
    config = config or TokenizerConfig()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write the tokenizer and its chat template to the directory ``path``; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    return path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer directory (ours or a real checkpoint's) with ``AutoTokenizer``."""
    return AutoTokenizer.from_pretrained(str(path))


TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What a chat template variable's name must be (``model.chat_template_kwargs``)."""


def with_template_variables(tokenizer: PreTrainedTokenizerBase, variables: Mapping[str, Any] | None,
                            ) -> PreTrainedTokenizerBase:
    """``tokenizer`` (changed in place) with each of ``variables`` set at the top of its chat template,
    ``{%- set NAME = VALUE %}`` before the template's own text, as vLLM's and TRL's
    ``chat_template_kwargs`` pass them to every rendering (``enable_thinking: false`` turns Qwen3's
    thinking off). Written into the template, they travel with the tokenizer: the run's version 0 and
    every checkpoint carry them, every rendering and replay uses them, and the recorded chat template
    hash is of the template with them. A variable set so wins over the same name given to a rendering:
    a checkpoint exported from the run keeps it for whatever renders with it later.

    Raises:
        ValueError: a name that is not an identifier, is a word or a function of Jinja's own, or is given
            to every rendering (:data:`_RENDERING_VARIABLES`, the special tokens); a value that is not
            JSON (null, a boolean, a finite number, a string, a list, or a mapping with string keys).
    """
    if not variables:
        return tokenizer
    lines = template_lines(variables) + "\n"  # the newline a block tag takes (trim_blocks), not the template's own
    template = tokenizer.chat_template
    tokenizer.chat_template = ({key: lines + text for key, text in template.items()} if isinstance(template, dict)
                               else lines + template)
    return tokenizer


_RENDERING_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                  "strftime_now", "raise_exception"})
"""What ``apply_chat_template`` gives a template itself (with the special tokens, ``*_token``)."""


def template_lines(variables: Mapping[str, Any]) -> str:
    """The ``{%- set NAME = VALUE %}`` lines of ``variables`` (:func:`with_template_variables`; its errors)."""
    import jinja2

    jinja = jinja2.Environment()
    for name in variables:
        if not isinstance(name, str) or TEMPLATE_VARIABLE.fullmatch(name) is None:
            raise ValueError(f"chat template variable {name!r}: a name is a letter or _ then letters, digits or _")
        try:
            jinja.parse(f"{{% set {name} = 1 %}}")
        except jinja2.TemplateSyntaxError:
            raise ValueError(f"chat template variable {name!r}: a word of Jinja's own, which a template cannot "
                             "set") from None
        if name in jinja.globals:
            raise ValueError(f"chat template variable {name!r}: one of Jinja's own functions, which templates call")
        if name in _RENDERING_VARIABLES or name.endswith("_token"):
            raise ValueError(f"chat template variable {name!r}: every rendering gives the template this one itself "
                             "(the conversation, its tools, the generation prompt's flag, the special tokens, the "
                             "clock)")
    return "".join(f"{{%- set {name} = {_jinja_literal(value, name)} %}}" for name, value in variables.items())


def _jinja_literal(value: Any, name: str) -> str:
    """``value`` as a Jinja literal (JSON's, with Jinja's none, true and false)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return repr(value)
    if isinstance(value, str):  # JSON's escapes, which a Jinja string reads as Python's; other characters as
        return json.dumps(value, ensure_ascii=False)  # they are (Jinja's \\u escapes cannot pair surrogates)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_jinja_literal(item, name) for item in value) + "]"
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return "{" + ", ".join(f"{_jinja_literal(key, name)}: {_jinja_literal(item, name)}" for key, item in value.items()) + "}"
    raise ValueError(f"chat template variable {name!r}: {value!r} is not a JSON value (null, a boolean, a finite "
                     "number, a string, a list, or a mapping with string keys)")


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def tokenizer_version(tokenizer: PreTrainedTokenizerBase) -> str:
    """Content hash of what maps text to ids: the canonical ``tokenizer.json`` minus padding/truncation."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"tokenizer_version needs a fast tokenizer (with backend_tokenizer), got {type(tokenizer).__name__}")
    state = json.loads(backend.to_str())
    for runtime_only in ("padding", "truncation"):
        state.pop(runtime_only, None)
    return _short_hash(json.dumps(state, sort_keys=True, ensure_ascii=False))


def chat_template_version(tokenizer: PreTrainedTokenizerBase) -> str:
    """Content hash of the chat template text; raises if the tokenizer has none."""
    template = tokenizer.chat_template
    if not template:
        raise ValueError("chat_template_version: the tokenizer has no chat_template")
    if isinstance(template, dict):  # named templates: hash them all, in a stable order
        template = json.dumps(template, sort_keys=True)
    return _short_hash(template)
