"""Reasoning parsers: ``<think>...</think>`` split into reasoning and content, whole and streamed
(every two-piece split and random chunkings reassemble to the whole split), and the end of the
reasoning found in token ids."""
from __future__ import annotations

import random

import pytest

from pagedllm.reasoning import ReasoningParserManager

# (parser, model text, reasoning, content)
CASES = [
    ("deepseek_r1", "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "Okay, <thinking> about it... done.</think>It is 4.", "Okay, <thinking> about it... done.",
     "It is 4."),  # the template put <think> in the prompt
    ("deepseek_r1", "<think>still going, no end yet", "still going, no end yet", ""),
    ("qwen3", "<think>\nLet me think: 3 × 3 = 9.\n</think>\n\n9", "\nLet me think: 3 × 3 = 9.\n", "\n\n9"),
    ("qwen3", "Nine. No thinking here.", "", "Nine. No thinking here."),
    ("qwen3", "<think>\n\n</think>\n\nDirect answer", "\n\n", "\n\nDirect answer"),
]


def parser(name, tokenizer=None):
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)


def streamed(name, chunks):
    p, text, reasoning, content = parser(name), "", "", ""
    for i, chunk in enumerate(chunks):
        text += chunk
        delta = p.extract_reasoning_content_streaming(text, final=i == len(chunks) - 1)
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
    return reasoning, content


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_whole_and_streamed_splits_agree(name, text, reasoning, content):
    assert parser(name).extract_reasoning_content(text) == (reasoning or None, content or None)
    rng = random.Random(1)
    chunkings = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 10)))
        chunkings.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for chunks in chunkings:
        assert streamed(name, chunks) == (reasoning, content), chunks


def test_reasoning_end_and_content_ids_from_token_ids(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    p = parser("qwen3", tok)
    ids = tok.encode("<think>hmm</think>yes", add_special_tokens=False)
    end = ids.index(tok.convert_tokens_to_ids("</think>"))
    assert not p.is_reasoning_end(ids[:end]) and p.is_reasoning_end(ids[:end + 1])
    assert p.extract_content_ids(ids) == ids[end + 1:] and tok.decode(ids[end + 1:]) == "yes"
    with pytest.raises(ValueError, match="no '</think>' token"):
        parser("deepseek_r1", AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)).is_reasoning_end([1, 2])


def test_unknown_reasoning_parser_names_the_available_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'.*deepseek_r1.*qwen3"):
        ReasoningParserManager.get_reasoning_parser("x")
