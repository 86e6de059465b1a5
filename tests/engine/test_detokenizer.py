"""Incremental detokenization and stop strings, against real local tokenizers."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedllm.engine import detokenizer
from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token

TEXTS = [
    "Hello world",
    " leading space, then  two spaces",
    "Chinese 世界你好, emoji 😀🎉, accents café naïve résumé",
    "世界😀é",  # starts with multi-byte characters
    "a real replacement char x\ufffdy stays",
    "line one\nline two\ttabbed",
]


@pytest.fixture(autouse=True, params=["decode_stream", "python_window"])
def text_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both paths of fast tokenizers: tokenizers' Rust DecodeStream (the
    default) and the Python window (what tokenizers without DecodeStream get)."""
    if request.param == "python_window":
        monkeypatch.setattr(detokenizer, "DecodeStream", None)
    return request.param


@pytest.fixture(scope="module")
def smol(smollm2_tokenizer_dir: str) -> Any:
    """SmolLM2's real tokenizer: GPT-2-style byte-level BPE."""
    return transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def llama() -> Any:
    """A tiny Llama-style tokenizer: sentencepiece BPE ("▁" spaces) with <0xNN> byte fallback,
    trained here on English so Chinese and emoji fall back to single-byte tokens."""
    corpus = [
        "The quick brown fox jumps over the lazy dog. Café au lait, naïve résumé.",
        "Hello world! Streaming text one token at a time is fun, isn't it?",
        "Stop strings may span several tokens: END OF TEXT, ###, and more.",
    ] * 20
    trainer_model = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_model.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    trained = json.loads(trainer_model.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    return transformers.LlamaTokenizer(vocab=vocab, merges=merges)


@pytest.fixture(scope="module", params=["smol", "llama"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def _stream(
    detok: IncrementalDetokenizer, token_ids: list[int], *, chunk: int = 1
) -> tuple[list[str], str | None]:
    """Feed tokens `chunk` at a time as engine steps would; return the deltas sent and the stop matched."""
    deltas = []
    for start in range(0, len(token_ids), chunk):
        stop = detok.update(token_ids[start : start + chunk])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_token_by_token_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, _ = _stream(detok, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    # A character split over byte tokens is never sent half-formed.
    assert not any("\ufffd" in d for d in deltas) or "\ufffd" in text


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_after_prompt_equals_decode_of_prompt_plus_output(tokenizer: Any, text: str) -> None:
    prompt_ids = tokenizer.encode("The prompt ends here:", add_special_tokens=False)
    output_ids = tokenizer.encode(" " + text, add_special_tokens=False)
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, _ = _stream(detok, output_ids, chunk=3)
    assert detok.output_text == full[len(prompt_text) :]
    assert "".join(deltas) == detok.output_text


def test_first_output_token_keeps_its_leading_space_after_prompt(llama: Any) -> None:
    prompt_ids = llama.encode("Hello", add_special_tokens=False)
    output_ids = llama.encode("Hello world", add_special_tokens=False)[1:]  # "▁world"
    assert llama.decode(output_ids) == "world"  # decoded alone, sentencepiece drops the space
    detok = IncrementalDetokenizer(llama, prompt_ids)
    detok.update(output_ids)
    assert detok.output_text == " world"


def test_character_split_over_byte_tokens_is_held_until_complete(llama: Any) -> None:
    ids = llama.encode("a😀", add_special_tokens=False)
    assert llama.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    detok = IncrementalDetokenizer(llama, [])
    texts = []
    for token_id in ids:
        detok.update([token_id])
        texts.append(detok.output_text)
    assert texts[-4:] == ["a", "a", "a", "a😀"]
    assert detok.output_token_decoded[-4:] == ["", "", "", "😀"]


def test_invalid_bytes_are_released_once_they_cannot_be_a_pending_character(llama: Any) -> None:
    # 0xFF never appears in UTF-8, so waiting for "the rest of the character" would wait forever.
    ff = llama.convert_tokens_to_ids("<0xFF>")
    detok = IncrementalDetokenizer(llama, [])
    detok.update([ff] * 3)
    assert detok.output_text == ""
    detok.update([ff])
    assert detok.output_text == llama.decode([ff] * 4) == "\ufffd" * 4


def test_cost_per_step_does_not_grow_with_output_length(smol: Any) -> None:
    class WindowSpy:
        """Forwards to the tokenizer, recording the longest token list decoded at once."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner
            self.longest = 0

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            self.longest = max(self.longest, len(tokens))
            return self._inner.convert_tokens_to_string(tokens)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    spy = WindowSpy(smol)
    ids = smol.encode("Streaming 世界 😀 one token at a time. " * 100, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        spy, smol.encode("a long prompt " * 50, add_special_tokens=False), use_decode_stream=False
    )
    for token_id in ids:
        detok.update([token_id])
    assert detok.output_text == smol.decode(ids)
    assert len(ids) > 1000 and spy.longest <= 10


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_stop_string_spanning_tokens_truncates_text(smol: Any, include_stop_str_in_output: bool) -> None:
    ids = smol.encode("Hello world END OF TEXT more words", add_special_tokens=False)
    tokens = smol.convert_ids_to_tokens(ids)
    assert "ĠEND" in tokens and "ĠOF" in tokens  # the stop string spans two tokens
    detok = IncrementalDetokenizer(
        smol, [], stop=["OF TEXT", "D OF"], include_stop_str_in_output=include_stop_str_in_output
    )
    deltas, stop = _stream(detok, ids)
    # "D OF" completes first (at "ĠOF"), though "OF TEXT" is listed first.
    assert stop == "D OF" and detok.stop_reason == "D OF"
    expected = "Hello world END OF" if include_stop_str_in_output else "Hello world EN"
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.update(smol.encode(" after", add_special_tokens=False)) is None
    assert detok.output_text == expected


def test_earliest_stop_string_wins_when_one_step_completes_several(llama: Any) -> None:
    ids = llama.encode("Hello world! Streaming text", add_special_tokens=False)
    detok = IncrementalDetokenizer(llama, [], stop=["text", "world", "Stream"])
    assert detok.update(ids) == "world"
    assert detok.output_text == "Hello "


def test_stop_string_within_one_token_and_at_text_start(smol: Any) -> None:
    ids = smol.encode("a###b", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [], stop=["##"])
    assert detok.update(ids) == "##"
    assert detok.output_text == "a"
    detok = IncrementalDetokenizer(smol, [], stop=["a#"])
    assert detok.update(ids) == "a#"
    assert detok.output_text == ""


def test_delta_mode_holds_back_text_that_may_start_a_stop_string(smol: Any) -> None:
    detok = IncrementalDetokenizer(smol, [], stop=["STOP!"])
    detok.update(smol.encode("Hello world", add_special_tokens=False))
    # 4 characters ("orld") might be the start of "STOP!", so they wait.
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello w"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello w"
    detok.update(smol.encode(" STO", add_special_tokens=False))
    assert detok.get_next_output_text(finished=False, delta=True) == "orld"
    # The stop string never completed: the held text is released at the end.
    detok.update(smol.encode("RM", add_special_tokens=False))
    assert detok.get_next_output_text(finished=True, delta=True) == " STORM"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world STORM"


def test_delta_mode_never_streams_a_stop_string_forming_over_steps(smol: Any) -> None:
    ids = smol.encode("one two three END OF TEXT four", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, [], stop=["END OF TEXT"])
    deltas, stop = _stream(detok, ids)
    assert stop == "END OF TEXT"
    assert "".join(deltas) == "one two three "
    assert not any("E" in d for d in deltas)


def test_include_stop_str_in_output_streams_without_holding_back(smol: Any) -> None:
    detok = IncrementalDetokenizer(smol, [], stop=["STOP!"], include_stop_str_in_output=True)
    detok.update(smol.encode("Hello world", add_special_tokens=False))
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello world"


def test_stop_strings_are_not_checked_within_min_tokens(smol: Any) -> None:
    ids = smol.encode("x END y END z", add_special_tokens=False)
    assert smol.convert_ids_to_tokens(ids) == ["x", "ĠEND", "Ġy", "ĠEND", "Ġz"]
    detok = IncrementalDetokenizer(smol, [], stop=["END"], min_tokens=2)
    assert detok.update(ids) == "END"
    assert detok.output_text == "x END y "  # the first END, in token 2, did not count

    detok = IncrementalDetokenizer(smol, [], stop=["END"], min_tokens=4)
    assert detok.update(ids) is None
    assert detok.output_text == "x END y END z"


def test_stop_string_may_start_within_min_tokens_and_end_after(smol: Any) -> None:
    ids = smol.encode("x END OF y", add_special_tokens=False)
    assert smol.convert_ids_to_tokens(ids) == ["x", "ĠEND", "ĠOF", "Ġy"]
    detok = IncrementalDetokenizer(smol, [], stop=["END OF"], min_tokens=2)
    assert detok.update(ids) == "END OF"
    assert detok.output_text == "x "


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_skipped_or_kept_as_decode_does(smol: Any, skip_special_tokens: bool) -> None:
    prompt_ids = smol.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    output_ids = smol.encode("Héllo <|im_end|><repo_name> 世界<|im_start|>x<|endoftext|>", add_special_tokens=False)
    assert {1, 2, 0, 3} <= set(output_ids)  # <repo_name> (3) is special but not in all_special_ids
    detok = IncrementalDetokenizer(smol, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, _ = _stream(detok, output_ids)
    expected = smol.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_special_tokens_skipped_with_sentencepiece_tokenizer(llama: Any) -> None:
    ids = [1] + llama.encode("Hello world", add_special_tokens=False) + [2]
    detok = IncrementalDetokenizer(llama, [])
    detok.update(ids)
    assert detok.output_text == llama.decode(ids, skip_special_tokens=True) == "Hello world"
    detok = IncrementalDetokenizer(llama, [], skip_special_tokens=False)
    detok.update(ids)
    assert detok.output_text == llama.decode(ids) == "<s> Hello world</s>"


def test_out_of_vocabulary_token_adds_no_text(smol: Any) -> None:
    detok = IncrementalDetokenizer(smol, [])
    detok.update([smol.encode("ok", add_special_tokens=False)[0], len(smol) + 100])
    assert detok.output_text == "ok"
    assert detok.output_token_decoded == ["ok", ""]


@pytest.fixture(scope="module")
def wordpiece() -> Any:
    """A fast tokenizer whose decoder joins tokens with spaces (WordPiece)."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


@pytest.mark.parametrize(
    ("spaces_between_special_tokens", "expected"),
    [(True, "hello [CLS] [SEP] worlds"), (False, "hello [CLS][SEP] worlds")],
)
def test_fast_tokenizer_spaces_between_consecutive_special_tokens(
    wordpiece: Any, spaces_between_special_tokens: bool, expected: str
) -> None:
    ids = [3, 1, 2, 4, 5]
    assert wordpiece.decode(ids) == "hello [CLS] [SEP] worlds"
    detok = IncrementalDetokenizer(
        wordpiece, [], skip_special_tokens=False, spaces_between_special_tokens=spaces_between_special_tokens
    )
    deltas, _ = _stream(detok, ids)
    assert detok.output_text == "".join(deltas) == expected


class CharTokenizer(transformers.PreTrainedTokenizer):
    """A python ("slow") tokenizer: one token per character."""

    def __init__(self, **kwargs: Any) -> None:
        self._vocab = {c: i for i, c in enumerate(["<unk>", *"abcdefghijklmnopqrstuvwxyz ."])}
        self._chars = {i: c for c, i in self._vocab.items()}
        super().__init__(unk_token="<unk>", **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return list(text)

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, 0)

    def _convert_id_to_token(self, index: int) -> str:
        return self._chars.get(index, "<unk>")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


@pytest.mark.parametrize(
    ("skip_special_tokens", "spaces_between_special_tokens", "expected"),
    [
        (True, True, "ab <tool> <call> cd"),
        (False, True, "ab <tool> <call> cd <unk>"),
        (False, False, "ab<tool><call>cd<unk>"),
    ],
)
def test_slow_tokenizer_joins_added_tokens_with_spaces(
    skip_special_tokens: bool, spaces_between_special_tokens: bool, expected: str
) -> None:
    tokenizer = CharTokenizer()
    tokenizer.add_tokens(["<tool>", "<call>"])
    ids = tokenizer.encode("ab<tool><call>cd<unk>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "b", "<tool>", "<call>", "c", "d", "<unk>"]
    detok = IncrementalDetokenizer(
        tokenizer,
        [],
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
    deltas, _ = _stream(detok, ids)
    assert detok.output_text == "".join(deltas) == expected


def test_decode_token_gives_each_tokens_own_text(smol: Any, llama: Any) -> None:
    ids = smol.encode("Hello world", add_special_tokens=False)
    assert [decode_token(smol, i) for i in ids] == ["Hello", " world"]
    assert decode_token(smol, 2) == "<|im_end|>"
    assert decode_token(llama, llama.convert_tokens_to_ids("<0xE4>")) == "\ufffd"


def test_decode_token_decodes_each_id_once(smol: Any) -> None:
    class DecodeCounter:
        def __init__(self) -> None:
            self.calls = 0

        def decode(self, ids: list[int]) -> str:
            self.calls += 1
            return smol.decode(ids)

    counter = DecodeCounter()
    assert [decode_token(counter, i) for i in (2, 2, 3, 2)] == ["<|im_end|>", "<|im_end|>", "<repo_name>", "<|im_end|>"]
    assert counter.calls == 2


# ---- tokenizers' DecodeStream against the Python window, on random ids ------------------------------


@pytest.fixture(scope="module", params=["smol", "llama", "wordpiece"])
def fast_tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def _id_pools(tokenizer: Any) -> dict[str, list[int]]:
    """Ids by kind: whole-text tokens, byte tokens (alone they decode to U+FFFD: split
    characters, invalid bytes), added/special tokens, and ids past the vocabulary."""
    n = len(tokenizer)
    added = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    texts = tokenizer.backend_tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    byte_ids = [i for i, t in enumerate(texts) if "\ufffd" in t]
    whole = [i for i, t in enumerate(texts) if "\ufffd" not in t and i not in added]
    return {"whole": whole, "byte": byte_ids, "added": added, "oov": list(range(n, n + 64))}


def _draw(rng: random.Random, pools: dict[str, list[int]], count: int, weights: dict[str, float]) -> list[int]:
    kinds = [k for k in weights if pools[k]]
    picks = rng.choices(kinds, [weights[k] for k in kinds], k=count)
    return [rng.choice(pools[k]) for k in picks]


def _run(tokenizer: Any, prompt: list[int], output: list[int], chunk: int, **kwargs: Any) -> tuple:
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas, stop = _stream(detok, output, chunk=chunk)
    return detok.output_text, deltas, detok.output_token_decoded, stop


def test_fast_tokenizers_take_the_decode_stream_path(fast_tokenizer: Any, text_path: str) -> None:
    pieces = IncrementalDetokenizer(fast_tokenizer, [])._pieces
    expected = detokenizer._StreamPieces if text_path == "decode_stream" else detokenizer._WindowPieces
    assert type(pieces) is expected
    assert type(IncrementalDetokenizer(fast_tokenizer, [], use_decode_stream=False)._pieces) is detokenizer._WindowPieces
    assert type(IncrementalDetokenizer(CharTokenizer(), [])._pieces) is detokenizer._WindowPieces


@pytest.mark.parametrize("seed", range(3))
def test_decode_stream_streams_what_the_python_window_streams(fast_tokenizer: Any, text_path: str, seed: int) -> None:
    """Random ids as a random model samples them: byte tokens that split or break characters,
    specials, ids past the vocabulary; random prompts (some ending mid-character), settings,
    stop strings and step sizes. Every delta, per-token piece and stop matches."""
    if text_path != "decode_stream":
        pytest.skip("compares the two paths itself")
    rng = random.Random(seed)
    pools = _id_pools(fast_tokenizer)
    weights = {"whole": 0.55, "byte": 0.3, "added": 0.1, "oov": 0.05}
    for _ in range(60):
        prompt = _draw(rng, pools, rng.randint(0, 10), weights)
        output = _draw(rng, pools, rng.randint(1, 40), weights)
        kwargs: dict[str, Any] = dict(
            skip_special_tokens=rng.random() < 0.5, spaces_between_special_tokens=rng.random() < 0.5,
            min_tokens=rng.choice([0, 0, 3]),
        )
        if rng.random() < 0.4:
            kwargs.update(stop=["e", " th", "\ufffd"], include_stop_str_in_output=rng.random() < 0.5)
        chunk = rng.choice([1, 1, 2, 5])
        window = _run(fast_tokenizer, prompt, output, chunk, use_decode_stream=False, **kwargs)
        stream = _run(fast_tokenizer, prompt, output, chunk, **kwargs)
        assert stream == window, (prompt, output, kwargs, chunk)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_text_equals_decode_of_prompt_and_output(
    fast_tokenizer: Any, text_path: str, skip_special_tokens: bool
) -> None:
    """Ids of whole characters (specials and ids past the vocabulary included): the streamed
    text is what `tokenizer.decode` gives the output after the prompt, and no delta holds a
    half character."""
    rng = random.Random(1)
    pools = _id_pools(fast_tokenizer)
    weights = {"whole": 0.85, "added": 0.1, "oov": 0.05}

    def decode(ids: list[int]) -> str:
        return fast_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    for _ in range(40):
        prompt = _draw(rng, pools, rng.randint(0, 8), weights)
        output = _draw(rng, pools, rng.randint(1, 60), weights)
        full, prompt_text = decode(prompt + output), decode(prompt)
        assert full.startswith(prompt_text)
        text, deltas, _, _ = _run(fast_tokenizer, prompt, output, rng.choice([1, 3]),
                                  skip_special_tokens=skip_special_tokens)
        assert text == "".join(deltas) == full[len(prompt_text) :], (prompt, output)
        assert not any("\ufffd" in d for d in deltas)


def test_decode_stream_window_stays_bounded_over_a_long_output(smol: Any, text_path: str) -> None:
    ids = smol.encode("Streaming 世界 😀 one token at a time. " * 300, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, smol.encode("a long prompt " * 50, add_special_tokens=False))
    deltas, _ = _stream(detok, ids)
    assert detok.output_text == "".join(deltas) == smol.decode(ids)
    if text_path == "decode_stream":
        assert len(ids) > 3000 and len(detok._pieces._ids) <= detokenizer._MAX_KEPT_IDS + 8
