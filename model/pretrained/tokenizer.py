"""Per-checkpoint tokenizers built with the `tokenizers` library, and the interface the rest
of dosa uses for any tokenizer (the byte tokenizer included): encode / decode / bos_id /
eos_id / vocab_size."""

import json
import pathlib

from model.pretrained.llama import PretrainedFormatError

# GGUF token types (llama.cpp's llama_token_type): these are matched whole, never split.
CONTROL, USER_DEFINED = 3, 4


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's BOS/EOS ids and chat format.
    bos_id may be None (GLM-5 has none); eos_id is one id or a list (GLM-5 stops at any of
    three): `eos_id` is the first, `stop_ids` all of them. chat_format: the family's entry
    of model.pretrained.chat.CHAT_FORMATS, or None: the chat template, if any."""

    def __init__(self, tokenizer, *, bos_id, eos_id, chat_template=None, add_bos=False,
                 chat_format=None):
        from model.pretrained.chat import check_chat_format

        self.tokenizer = tokenizer
        eos = [int(e) for e in (eos_id if isinstance(eos_id, (list, tuple)) else [eos_id])]
        self.bos_id, self.eos_id, self.stop_ids = bos_id, eos[0], frozenset(eos)
        self.chat_template = chat_template
        self.chat_format = check_chat_format(chat_format)
        self.add_bos = add_bos  # what the checkpoint asks for by default
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text, *, bos=None, eos=False):
        """str -> list of token ids; bos=None follows the checkpoint's default."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if bos is None else bos
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids, *, skip_special=True):
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)


class ByteTokenizer:
    """model.tokenizer (UTF-8 bytes + BOS/EOS/PAD) behind the same interface."""

    def __init__(self):
        from model import tokenizer as byte

        self._byte = byte
        self.bos_id, self.eos_id, self.vocab_size = byte.BOS, byte.EOS, byte.VOCAB_SIZE
        self.stop_ids = frozenset({byte.EOS})
        self.chat_template = self.chat_format = None
        self.add_bos = True

    def encode(self, text, *, bos=None, eos=False):
        return self._byte.encode(text, bos=self.add_bos if bos is None else bos, eos=eos)

    def decode(self, ids, *, skip_special=True):
        return self._byte.decode(ids)


def _byte_level_bpe(vocab, merges, pre):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's byte-level regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default", None):
        tok.pre_tokenizer = byte_level
    else:
        raise PretrainedFormatError(f"tokenizer.ggml.pre {pre!r} is not supported (dosa builds "
                                    "'smollm' and 'gpt2'); load the Hugging Face folder with its "
                                    "tokenizer.json instead")
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_from_gguf_metadata(metadata, *, source):
    """HFTokenizer from a GGUF file's tokenizer.ggml.* metadata (metadata(key, default))."""
    from tokenizers import AddedToken

    model = metadata("tokenizer.ggml.model")
    if model != "gpt2":
        raise PretrainedFormatError(f"{source}: tokenizer.ggml.model {model!r} is not "
                                    "supported (dosa builds byte-level BPE, 'gpt2')")
    tokens = list(metadata("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in metadata("tokenizer.ggml.merges")]
    tok = _byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges,
                          metadata("tokenizer.ggml.pre", None))
    types = metadata("tokenizer.ggml.token_type", None)
    if types is not None:
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)]
        tok.add_special_tokens(special)
    return HFTokenizer(tok, bos_id=int(metadata("tokenizer.ggml.bos_token_id")),
                       eos_id=int(metadata("tokenizer.ggml.eos_token_id")),
                       chat_template=metadata("tokenizer.chat_template", None),
                       add_bos=bool(metadata("tokenizer.ggml.add_bos_token", False)))


def tokenizer_from_hf_folder(path, config, chat_format=None):
    """chat_format: the family's (model.pretrained.chat), where its checkpoints ship no
    template; None: the folder's template, if any."""
    from tokenizers import Tokenizer

    path = pathlib.Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:
        raise PretrainedFormatError(f"{file}: not a readable tokenizer ({e})") from e
    extra = {}
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        extra = json.loads(cfg_file.read_text())
    # Newer checkpoints keep the template in its own file.
    template = extra.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    bos = config.get("bos_token_id", 1)
    return HFTokenizer(tok, bos_id=None if bos is None else int(bos),
                       eos_id=config.get("eos_token_id", 2), chat_template=template,
                       add_bos=bool(extra.get("add_bos_token", False)) and bos is not None,
                       chat_format=chat_format)
