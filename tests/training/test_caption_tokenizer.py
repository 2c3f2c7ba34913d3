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


def test_two_builds_are_the_same_files(tmp_path):
    # The token ids index the text encoders' embedding rows: a retrained model's tokenizer must come out the
    # same. (The `tokenizers` library's BPE trainer did not: it breaks ties in hash order.)
    for name in ("a", "b"):
        build_caption_tokenizer(tmp_path / name, pad_token="!")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def test_the_shipped_tokenizers_are_what_the_builder_makes(tmp_path):
    from meshserve.models.sdxl.embedded import FOLDER

    for name, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        build_caption_tokenizer(tmp_path / name, pad_token=pad)
        assert (tmp_path / name / "tokenizer.json").read_bytes() == (
            FOLDER / name / "tokenizer.json"
        ).read_bytes()
