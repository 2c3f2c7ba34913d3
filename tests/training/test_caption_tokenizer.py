"""The trained model's tokenizers: every caption word one token, read by transformers' CLIPTokenizer."""

from transformers import CLIPTokenizer

from meshserve.training.caption_tokenizer import WORDS, build_caption_tokenizer
from meshserve.training.shapes import Scene


def test_every_caption_word_is_one_token(tmp_path):
    vocab = build_caption_tokenizer(tmp_path / "tok")
    tokenizer = CLIPTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tokenizer) == vocab
    for word in WORDS:
        assert tokenizer.tokenize(word) == [f"{word}</w>"], word
    caption = Scene("orange", "triangle", "white", size="small", position="at the bottom right").caption
    ids = tokenizer(caption).input_ids
    assert len(ids) == len(caption.split()) + 2  # <|startoftext|> ... <|endoftext|>
    # A word it never saw still tokenizes, byte by byte, as CLIP's tokenizer does.
    assert tokenizer.tokenize("dog") == ["d", "o", "g</w>"]
