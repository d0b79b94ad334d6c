from hypothesis import given
from hypothesis import strategies as st

from model import tokenizer


@given(st.text())
def test_round_trip_any_string(text):
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == tokenizer.BOS and ids[-1] == tokenizer.EOS
    assert all(0 <= i < tokenizer.VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_decode_never_fails_on_cut_characters():
    ids = tokenizer.encode("é", bos=False)[:1]
    assert tokenizer.decode(ids) == "\ufffd"
