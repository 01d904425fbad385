"""The tokenizer built from code: deterministic, small, one token per digit, versioned, loadable by AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from sao.models.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TokenizerConfig,
    build_tokenizer,
    chat_template_version,
    save_tokenizer,
    tokenizer_version,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_build_is_deterministic(tokenizer):
    again = build_tokenizer()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert tokenizer_version(again) == tokenizer_version(tokenizer)


def test_vocabulary_fits_the_policy(tokenizer):
    assert len(tokenizer) <= 512
    assert len(tokenizer) == TokenizerConfig().vocab_size


def test_special_tokens_are_single_ids_in_declared_order(tokenizer):
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.encode(token, add_special_tokens=False) == [expected_id]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"


def test_digits_are_one_token_each_whatever_surrounds_them(tokenizer):
    digit_ids = {d: tokenizer.encode(d, add_special_tokens=False) for d in "0123456789"}
    assert all(len(ids) == 1 for ids in digit_ids.values())
    for text, number in [("4096", "4096"), ("x=4096;", "4096"), ("What is 4096?", "4096"), (" 4096 ", "4096")]:
        tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
        digits = [t for t in tokens if any(c.isdigit() for c in t)]
        assert digits == list(number), tokens


@pytest.mark.parametrize("text", ["print(483*27+915)", "Verily, thou art fair ~ <3", "naïve café 東京 🚀", "a\n\tb  c"])
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_common_words_are_merged(tokenizer):
    assert len(tokenizer.encode("print", add_special_tokens=False)) == 1
    assert len(tokenizer.encode("assistant", add_special_tokens=False)) == 1


def test_auto_tokenizer_loads_the_saved_directory(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    assert (tmp_path / "tokenizer_config.json").exists()
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenizer_version(loaded) == tokenizer_version(tokenizer)
    assert chat_template_version(loaded) == chat_template_version(tokenizer)
    text = "<|im_start|>user\nWhat is 12 * 34 + 56?<|im_end|>\n"
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)


def test_tokenizer_version_changes_with_the_tokenizer_only(tokenizer):
    smaller = build_tokenizer(TokenizerConfig(vocab_size=400))
    assert tokenizer_version(smaller) != tokenizer_version(tokenizer)
    assert chat_template_version(smaller) == chat_template_version(tokenizer)


def test_template_version_changes_with_the_template_only(tokenizer):
    edited = build_tokenizer()
    edited.chat_template = CHAT_TEMPLATE.replace("<tool_response>{{", "<tool_response> {{")
    assert chat_template_version(edited) != chat_template_version(tokenizer)
    assert tokenizer_version(edited) == tokenizer_version(tokenizer)


def test_versions_are_short_hex_hashes(tokenizer):
    for version in (tokenizer_version(tokenizer), chat_template_version(tokenizer)):
        assert len(version) == 16
        int(version, 16)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="vocab_size"):
        TokenizerConfig(vocab_size=100)
    with pytest.raises(ValueError, match="min_frequency"):
        TokenizerConfig(min_frequency=0)


def test_a_tokenizer_without_a_template_has_no_template_version(tokenizer):
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        chat_template_version(bare)


def test_template_variables_are_set_at_the_top_of_the_chat_template():
    """Each value a JSON value, read back by the template as it was given, winning over a rendering's
    own; a dict of named templates gets them in each; names and values a template cannot take refused."""
    import pytest

    from sao.models.tokenizer import with_template_variables
    from tests.rollout.test_chat_endpoint import qwen_style_tokenizer

    given = {"flag": False, "n": 2.5, "s": 'a "b"\\\n\u00e9\U0001f600', "nothing": None, "items": [1, {"k\u00e9": True}],
             "big": 10**30, "small": 1e-05}
    template = "\n{{ [flag, n, s, nothing, items, big, small] | tojson }}"  # its own first newline kept
    tokenizer = with_template_variables(qwen_style_tokenizer(template), given)
    assert tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, flag=True) == "\n" + json.dumps(
        [False, 2.5, 'a "b"\\\n\u00e9\U0001f600', None, [1, {"k\u00e9": True}], 10**30, 1e-05], ensure_ascii=False)
    named = qwen_style_tokenizer("x")
    named.chat_template = {"default": "{{ flag }}", "tool_use": "{{ flag }}!"}
    assert with_template_variables(named, {"flag": 1}).chat_template == {
        "default": "{%- set flag = 1 %}\n{{ flag }}", "tool_use": "{%- set flag = 1 %}\n{{ flag }}!"}
    assert with_template_variables(named, {}) is named and with_template_variables(named, None) is named
    for bad, match in (({"1st": 1}, "a name is a letter"), ({"none": 1}, "a word of Jinja's own"),
                       ({"namespace": 1}, "one of Jinja's own functions"),
                       ({"bos_token": "x"}, "every rendering gives"), ({"tools": []}, "every rendering gives"),
                       ({"x": float("inf")}, "not a JSON value"),
                       ({"x": {1: 2}}, "not a JSON value"), ({"x": object()}, "not a JSON value")):
        with pytest.raises(ValueError, match=match):
            with_template_variables(qwen_style_tokenizer("x"), bad)
