"""Chat prompts (model.pretrained.chat): DeepSeek-V4 through DeepSeek's encoder library, in
the form the release's encoding/encoding_dsv4.py renders (chat mode: BOS, the system text,
"<｜User｜>" turns, "<｜Assistant｜></think>" before each answer, EOS after each past
answer); GLM-5 through its Jinja template; V3.2 and the byte tokenizer refused, naming why."""

import json
import pathlib

import pytest

from model.pretrained.chat import ChatFormatError, chat_prompt_ids
from model.pretrained.tokenizer import ByteTokenizer, tokenizer_from_hf_folder

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


def _tokenizer(folder, chat_format):
    config = json.loads((folder / "config.json").read_text())
    return tokenizer_from_hf_folder(folder, config, chat_format)


def _text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special=False)


def test_deepseek_v4_renders_the_release_encoders_chat_mode():
    tok = _tokenizer(FIXTURES / "deepseek_v4" / "tiny", "deepseek_v4")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Again"}]
    ids = chat_prompt_ids(tok, messages)
    assert _text(tok, ids) == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi there"
                               "<｜Assistant｜></think>Hello<｜end▁of▁sentence｜>"
                               "<｜User｜>Again<｜Assistant｜></think>")
    special = {t: tok.tokenizer.token_to_id(t) for t in
               ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "</think>")}
    assert ids[0] == special["<｜begin▁of▁sentence｜>"] == tok.bos_id
    assert ids[-2:] == [special["<｜Assistant｜>"], special["</think>"]]  # one token each
    # OpenAI's developer role is V4's system prompt.
    developer = chat_prompt_ids(tok, [{"role": "developer", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}])
    system = chat_prompt_ids(tok, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}])
    assert developer == system


def test_deepseek_v4_refuses_what_its_encoder_refuses():
    tok = _tokenizer(FIXTURES / "deepseek_v4" / "tiny", "deepseek_v4")
    with pytest.raises(ChatFormatError, match="wizard"):
        chat_prompt_ids(tok, [{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatFormatError, match="tool_call_id"):
        chat_prompt_ids(tok, [{"role": "tool", "content": "x"}])


def test_a_template_renders_and_a_family_without_chat_is_refused():
    glm = _tokenizer(FIXTURES / "dsa" / "glm_moe_dsa", None)
    ids = chat_prompt_ids(glm, [{"role": "user", "content": "Hi"}])
    assert _text(glm, ids).endswith("<|user|>\nHi<|assistant|>")
    v32 = _tokenizer(FIXTURES / "dsa" / "deepseek_v32", None)
    for tok in (v32, ByteTokenizer()):
        with pytest.raises(ChatFormatError, match="no chat template or chat format"):
            chat_prompt_ids(tok, [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="chat_format must be one of"):
        _tokenizer(FIXTURES / "deepseek_v4" / "tiny", "deepseek_v9")
