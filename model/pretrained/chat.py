"""Chat prompts: how a checkpoint turns OpenAI-style messages into prompt token ids
(`chat_prompt_ids`). One entry per format in CHAT_FORMATS; a tokenizer's `chat_format` is
its family's entry, or None: its chat template, if it has one.

- "template": the checkpoint's Jinja chat template (tokenizer_config.json or
  chat_template.jinja), rendered sandboxed as Hugging Face renders it.
- "deepseek_v4": DeepSeek-V4's releases ship no template but a Python encoder
  (encoding/encoding_dsv4.py); DeepSeek's own encoder library, `deepseek-recipe`, renders
  the same prompts (SGLang serves V4 through it too). dosa renders chat mode (the answer
  follows "</think>" directly): thinking mode's reasoning would need parsing out of the
  answer, which dosa does not do.
"""

import json


class ChatFormatError(ValueError):
    """The messages cannot be rendered in this format (the server answers 400)."""


class TemplateChat:
    """The checkpoint's Jinja template. Its text is encoded with the checkpoint's BOS
    default, as dosa always has (GLM-5 has no BOS, SmolLM2 adds none)."""

    def __init__(self, tokenizer):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not tokenizer.chat_template:
            raise ChatFormatError("the checkpoint has no chat template")

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._error = TemplateError
        self._template = env.from_string(tokenizer.chat_template)
        self._tokenizer = tokenizer
        inner = getattr(tokenizer, "tokenizer", None)  # the byte tokenizer has no vocabulary
        self._special = {name: inner.id_to_token(i) if inner and i is not None else ""
                         for name, i in (("bos_token", tokenizer.bos_id),
                                         ("eos_token", tokenizer.eos_id))}

    def prompt_ids(self, messages):
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True,
                                         **self._special)
        except self._error as e:
            raise ChatFormatError(f"the chat template rejected these messages: {e}") from None
        return self._tokenizer.encode(text, bos=None)


class DeepseekV4Chat:
    """DeepSeek-V4's encoder (deepseek-recipe) over the checkpoint's own tokenizer.json."""

    # The library knows V4 by its API model names; V4-Flash and V4-Pro share the encoding.
    RECIPE_MODEL = "DeepSeek-V4-Pro"

    def __init__(self, tokenizer):
        try:
            import deepseek_recipe as recipe
        except ImportError:
            raise ChatFormatError("DeepSeek-V4 chat needs the deepseek-recipe package "
                                  "(pip install deepseek-recipe; Linux and macOS)") from None

        special = recipe.SpecialTokens()
        self._recipe = recipe
        self._options = recipe.ConversionOptions().with_special_tokens(special)
        own = recipe.Tokenizer.from_str(tokenizer.tokenizer.to_str())
        self._encoding = (recipe.DeepseekV4Encoding().with_special_tokens(special)
                          .with_tokenizer(own))

    def prompt_ids(self, messages):
        # OpenAI's "developer" role is V4's system role (as SGLang maps it).
        messages = [dict(m, role="system") if m.get("role") == "developer" else m
                    for m in messages]
        body = dict(model=self.RECIPE_MODEL, messages=messages,
                    thinking={"type": "disabled"})
        try:
            converted = self._recipe.ChatCompletionRequest(body).convert(self._options)
        except self._recipe.ConversionError as e:
            raise ChatFormatError(f"{REFUSED}{_recipe_message(e.body)}") from None
        except ValueError as e:  # a message the library cannot read at all
            raise ChatFormatError(f"{REFUSED}{e}") from None
        return list(self._encoding.encode(converted.conversation))


REFUSED = "DeepSeek-V4's chat encoder refused these messages: "


def _recipe_message(body):
    try:
        return json.loads(body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        return str(body)


CHAT_FORMATS = {"template": TemplateChat, "deepseek_v4": DeepseekV4Chat}


def chat_format_of(tokenizer):
    """The CHAT_FORMATS entry `tokenizer` renders chats with, or None: it has none."""
    name = getattr(tokenizer, "chat_format", None)
    if name is None and getattr(tokenizer, "chat_template", None):
        name = "template"
    return name


def chat_prompt_ids(tokenizer, messages):
    """The prompt ids of OpenAI-style `messages` ([{role, content (text)}]) in the
    tokenizer's chat format; ChatFormatError when it has none or refuses them. A format is
    built once per tokenizer (and template)."""
    name = chat_format_of(tokenizer)
    if name is None:
        raise ChatFormatError("the tokenizer has no chat template or chat format")
    key = (name, getattr(tokenizer, "chat_template", None))
    cached = getattr(tokenizer, "_chat_built", None)
    if cached is None or cached[0] != key:
        cached = (key, CHAT_FORMATS[name](tokenizer))
        tokenizer._chat_built = cached
    return cached[1].prompt_ids(messages)


def check_chat_format(name):
    if name is not None and name not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {sorted(CHAT_FORMATS)} or None, "
                         f"got {name!r}")
    return name
