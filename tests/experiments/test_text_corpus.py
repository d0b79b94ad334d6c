"""The real-text corpus for pretrained models: a stable split that holds the eval text out."""

from experiments import text_corpus as tc
from model.pretrained import ByteTokenizer


def test_split_is_disjoint_deterministic_and_holds_out_the_eval_text():
    names = tc.list_documents()
    assert any(n.startswith("stdlib/") for n in names)
    train, heldout = tc.split_documents(names)
    assert set(train).isdisjoint(heldout) and sorted(train + heldout) == sorted(names)
    assert (train, heldout) == tc.split_documents(list(reversed(names)))
    assert not any("pydoc_data" in n for n in train)  # the evaluation text is never trained on
    assert "pydoc_data/topics" in tc.HELDOUT_TEXT


def test_token_stream_ends_documents_with_eos(tmp_path):
    tok = ByteTokenizer()
    names = [n for n in tc.list_documents() if n.startswith("stdlib/")][:3]
    stream = tc.token_stream(tok, names, cache=tmp_path)
    assert (stream == tok.eos_id).sum() == 3 and stream[-1] == tok.eos_id
    assert (tc.token_stream(tok, names, cache=tmp_path) == stream).all()  # from the cache
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 1
