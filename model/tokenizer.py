"""Byte-level tokenizer: UTF-8 bytes 0..255 plus BOS, EOS and PAD."""

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259


def encode(text, *, bos=True, eos=False):
    """str -> list of ints (one per UTF-8 byte), optionally framed by BOS/EOS."""
    if not isinstance(text, str):
        raise TypeError(f"encode expects str, got {type(text).__name__}")
    ids = list(text.encode("utf-8"))
    return ([BOS] if bos else []) + ids + ([EOS] if eos else [])


def decode(ids):
    """ints -> str; special tokens are dropped, invalid UTF-8 (a cut multi-byte character)
    becomes U+FFFD, so decoding never fails."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
