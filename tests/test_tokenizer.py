"""Tokenizer (GGUF and HF folder) and IncrementalDetokenizer."""
import copy
import random

import pytest

from kvflow.detokenizer import IncrementalDetokenizer
from kvflow.tokenizer import Tokenizer, flatten_content

TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces, trailing  \n\n\ttabs and\r\nnewlines  ",
    "Numbers: 2024, 3.14159, 1,000,000 and x**2 + y_1 = 42",
    "def f(x):\n    return {'a': [1, 2]}  # don't, we'll, I'm",
    "Chinese 你好，世界！ Japanese こんにちは Korean 안녕하세요",
    "Emoji 🎉👍🏽🇫🇷 👨‍👩‍👧 and accents: café, naïve, Ångström, Straße, ñandú",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> <repo_name>",
    "",
]
MULTIBYTE = [
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "🎉🎊🥳 party 👍🏽 thumbs 👨‍👩‍👧‍👦 family 🇯🇵🇫🇷 flags",
    "Crème brûlée, naïve façade, Ångström, Øresund, Ελληνικά, русский, עברית, العربية",
    "mixed: a你b好c🎉d é ü ß \u200b zero-width and \U0001F600",
]


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_path):
    """transformers' own GGUF tokenizer (slow to build: it walks the file with its own reader)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


# --------------------------------------------------------------------------- tokenizer

@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers_gguf_tokenizer(smollm2_tokenizer, reference_tokenizer):
    tok, ref = smollm2_tokenizer, reference_tokenizer
    for text in TEXTS + MULTIBYTE:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.chat_template == ref.chat_template
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (ref.bos_token_id, ref.eos_token_id, len(ref))
    assert tok.convert_ids_to_tokens([1, 2, 28120]) == ref.convert_ids_to_tokens([1, 2, 28120])


def test_smollm2_special_ids_and_roundtrip(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert 2 in tok.eos_token_ids
    assert tok.encode("<|im_start|>") == [1]  # special tokens stay whole
    assert tok.id_to_piece(1) == "<|im_start|>"
    for text in TEXTS + MULTIBYTE:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_chat_template_renders_chatml(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.render_chat(messages, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    no_prompt = tok.render_chat(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    # default system prompt when none is given
    assert "<|im_start|>system\n" in tok.render_chat([{"role": "user", "content": "x"}])


def test_chat_content_parts_are_flattened(smollm2_tokenizer):
    tok = smollm2_tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "Hello\nworld"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    assert flatten_content(None) == ""
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_missing_chat_template_is_value_error(smollm2_tokenizer):
    hf = copy.deepcopy(smollm2_tokenizer.hf)
    hf.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_hf_folder_and_gguf_tokenizers_agree(tmp_path):
    from tiny_models import make_tiny_hf_model, write_gguf_from_hf

    hf_dir = make_tiny_hf_model(tmp_path / "hf", "llama")
    gguf_path = write_gguf_from_hf(hf_dir, tmp_path / "tiny.gguf")
    a, b = Tokenizer.from_model(hf_dir), Tokenizer.from_model(gguf_path)
    for text in TEXTS + MULTIBYTE:
        assert a.encode(text) == b.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    assert (a.eos_token_ids, a.bos_token_id, a.vocab_size) == (b.eos_token_ids, b.bos_token_id, b.vocab_size)


# --------------------------------------------------------------------------- detokenizer

def _stream(tok, ids, chunks, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    assert i >= len(ids)
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", MULTIBYTE + TEXTS)
def test_detokenizer_token_by_token_roundtrip(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    for skip in (True, False):
        detok, deltas = _stream(tok, ids, [1] * len(ids), skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.text
        assert not any("\ufffd" in d for d in deltas)  # never a broken character


def test_detokenizer_random_chunks_invariant(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rng = random.Random(0)
    ids = tok.encode("".join(MULTIBYTE + TEXTS))
    for _ in range(20):
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.choice([0, 1, 1, 2, 3, 5, 8]))
        skip = rng.random() < 0.5
        detok, deltas = _stream(tok, ids, chunks, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.text
        assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_random_token_ids_invariant(smollm2_tokenizer):
    """Arbitrary ids (broken byte sequences, special tokens): deltas still add up to the full decode."""
    tok = smollm2_tokenizer
    rng = random.Random(1)
    byte_tokens = [i for i in range(17, 400)]  # single-byte and short pieces, many partial UTF-8
    for _ in range(30):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.7 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.5
        detok, deltas = _stream(tok, ids, [rng.choice([1, 2, 3]) for _ in ids], skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_holds_back_split_utf8(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the emoji's bytes span several tokens
    detok = IncrementalDetokenizer(tok)
    outs = [detok.add([i]) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🎉"


def test_stop_string_held_back_and_not_returned(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is 42. END of story, more text")
    detok, deltas = _stream(tok, ids, [1] * len(ids), stop=["END"])
    assert detok.stop_str == "END" and detok.stopped
    assert "".join(deltas) == detok.text == "The answer is 42. "
    assert not any("E" in d for d in deltas)
    assert detok.add(tok.encode(" more")) == "" and detok.flush() == ""


def test_stop_string_split_across_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("alpha beta###STOP### gamma delta")
    stop = "#STOP#"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds the stop string
    detok = IncrementalDetokenizer(tok, stop=[stop, "never"])
    seen = ""
    for i in ids:
        seen += detok.add([i])
        assert "alpha beta##".startswith(seen)  # nothing past the stop, nor its start, ever leaks
    seen += detok.flush()
    assert detok.stop_str == stop and seen == detok.text == "alpha beta##"


def test_stop_string_included_when_asked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("one two three four")
    detok, deltas = _stream(tok, ids, [1] * len(ids), stop=["three", "two"], include_stop_str_in_output=True)
    assert detok.stop_str == "two" and "".join(deltas) == "one two"  # earliest match wins


def test_partial_stop_prefix_released_at_flush(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello wor")
    detok = IncrementalDetokenizer(tok, stop=["world"])
    out = "".join(detok.add([i]) for i in ids)
    assert out == "Hello " and detok.flush() == "wor" and detok.stop_str is None
    assert detok.text == "Hello wor"


def test_stop_string_found_in_multi_token_add(smollm2_tokenizer):
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, stop=["\n\n"])
    assert detok.add(tok.encode("first line\n\nsecond")) == "first line"
    assert detok.stop_str == "\n\n" and detok.add([42]) == "" and detok.flush() == ""
