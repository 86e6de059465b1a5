"""Turn one request's output tokens into text step by step, and find its stop strings."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

# How many prompt tokens start the decode window: enough for the first output token to
# be decoded in context, so sentencepiece's "▁Hello" or byte-level "ĠHello" keeps its
# leading space instead of being stripped as the start of a text.
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character is at most 4 bytes, so at most 3 pending tokens can hold an
# unfinished one. Text still ending in U+FFFD after this many tokens is a real
# replacement character (or invalid bytes), and waiting longer would only grow the window.
_MAX_PENDING_TOKENS = 4

_REPLACEMENT_CHAR = "\ufffd"


def decode_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token on its own, as a logprob entry shows it (special tokens included)."""
    return tokenizer.decode([token_id])


@dataclass(frozen=True)
class _TokenizerInfo:
    """Facts about a tokenizer that every request needs; costly to compute, so cached."""

    is_fast: bool
    special_ids: frozenset[int]
    # id -> text of tokens added on top of the model vocabulary (special or not).
    added_tokens: dict[int, str]
    added_token_strings: frozenset[str]


# Keyed by tokenizer object: a served model's tokenizer is built once and never changes.
_info_cache: weakref.WeakKeyDictionary[Any, _TokenizerInfo] = weakref.WeakKeyDictionary()


def _tokenizer_info(tokenizer: Any) -> _TokenizerInfo:
    try:
        return _info_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    added_tokens_decoder = tokenizer.added_tokens_decoder
    added = {int(i): str(t) for i, t in added_tokens_decoder.items()}
    # `all_special_ids` lists only the named special tokens; fast tokenizers' decode also
    # skips every added token flagged special (e.g. SmolLM2's <repo_name>), so take both.
    special = set(tokenizer.all_special_ids)
    special.update(int(i) for i, t in added_tokens_decoder.items() if getattr(t, "special", False))
    info = _TokenizerInfo(
        is_fast=bool(getattr(tokenizer, "is_fast", False)),
        special_ids=frozenset(special),
        added_tokens=added,
        added_token_strings=frozenset(added.values()),
    )
    try:
        _info_cache[tokenizer] = info
    except TypeError:  # not weak-referenceable: recompute per request, still correct
        pass
    return info


class IncrementalDetokenizer:
    """Decodes one request's output tokens as they arrive, at a cost per token that does
    not grow with the output length, and stops the text at the first stop string.

    Text is built with a sliding window over token strings: `_prefix_offset` marks the
    start of the context already emitted, `_read_offset` the first token not yet emitted.
    Each step decodes the window with and without the new tokens and emits the difference,
    so decoders that look at neighbours (leading-space stripping, byte fallback) see enough
    context. Text ending in U+FFFD means a UTF-8 character is split over byte tokens; it
    is held until the rest of its bytes arrive.

    Special tokens:
    - `skip_special_tokens` drops them (all of `all_special_ids` plus added tokens flagged
      special, as `tokenizer.decode` does).
    - Fast tokenizers place every kept token through their own decoder, so the text equals
      `tokenizer.decode(ids, skip_special_tokens=...)`. With
      `spaces_between_special_tokens=False`, an added token right after another added
      token is emitted as its raw text, dropping any separator the decoder puts between
      tokens (WordPiece's space, or the space join of a tokenizer without decoder).
    - Python ("slow") tokenizers decode added tokens as their raw text, outside
      `convert_tokens_to_string`, joined to their neighbours by a space when
      `spaces_between_special_tokens` (transformers 4 slow-tokenizer decode).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # An empty stop string would match before any text; it cannot mean anything.
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._info = _tokenizer_info(tokenizer)

        self.output_token_ids: list[int] = []
        # Per output token, the text it added to output_text (empty while its character
        # is incomplete, or when skipped). vLLM's Logprob.decoded_token is each token
        # decoded alone instead: use `decode_token` for that.
        self.output_token_decoded: list[str] = []
        # The stop string that ended the text, once one has.
        self.stop_reason: str | None = None

        self._last_kept_is_added = False
        self._tokens: list[str] = self._prompt_context_tokens(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._text = ""
        self._sent_offset = 0
        # A stop string still forming may be at most len-1 characters of the text's tail.
        self._stop_holdback_chars = (
            max((len(s) for s in self.stop), default=1) - 1 if not include_stop_str_in_output else 0
        )

    @property
    def output_text(self) -> str:
        """The whole text so far; cut at the stop string once one matched."""
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens and extend the text; return the stop string matched, if any.

        On a match the text is cut at the stop string (after it with
        `include_stop_str_in_output`) and tokens after the matching one are not decoded;
        later calls do nothing, since the request is over.
        """
        if self.stop_reason is not None:
            return None
        for token_id in new_token_ids:
            new_text_start = len(self._text)
            self.output_token_ids.append(token_id)
            piece = self._decode_next(token_id)
            self.output_token_decoded.append(piece)
            self._text += piece
            # vLLM semantics: no stop string may end within the first min_tokens tokens.
            if not piece or not self.stop or len(self.output_token_ids) <= self.min_tokens:
                continue
            stop = self._find_stop(new_text_start)
            if stop is not None:
                return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now: all of it, or with `delta` only what was not sent before.

        Until the request finishes, the last len(longest stop)-1 characters are held back
        so a stop string still forming is never streamed out.
        """
        end = len(self._text)
        if not finished:
            end = max(end - self._stop_holdback_chars, 0)
        if not delta:
            return self._text[:end]
        if end <= self._sent_offset:
            return ""
        start, self._sent_offset = self._sent_offset, end
        return self._text[start:end]

    def _prompt_context_tokens(self, prompt_token_ids: list[int]) -> list[str]:
        # Walk back from the end so a long prompt costs only the few tokens we keep.
        context: list[str] = []
        for token_id in reversed(prompt_token_ids):
            if len(context) == PROMPT_CONTEXT_TOKENS:
                break
            token = self._token_string(token_id)
            if token is not None:
                if not context:
                    self._last_kept_is_added = token_id in self._info.added_tokens
                context.append(token)
        context.reverse()
        return context

    def _token_string(self, token_id: int) -> str | None:
        """The token's vocabulary string, or None when it is skipped or out of vocabulary."""
        if self.skip_special_tokens and token_id in self._info.special_ids:
            return None
        # Models often pad their vocabulary past the tokenizer's; such ids have no text.
        return self.tokenizer.convert_ids_to_tokens(token_id)

    def _decode_next(self, token_id: int) -> str:
        token = self._token_string(token_id)
        if token is None:
            return ""
        is_added = token_id in self._info.added_tokens
        self._tokens.append(token)
        if (
            is_added
            and self._last_kept_is_added
            and self._info.is_fast
            and not self.spaces_between_special_tokens
        ):
            self._last_kept_is_added = True
            self._advance_window()
            return self._info.added_tokens[token_id]
        self._last_kept_is_added = is_added

        window = self._tokens[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        prefix_text = self._tokens_to_text(window[:read])
        new_text = self._tokens_to_text(window)
        pending = len(self._tokens) - self._read_offset
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and pending < _MAX_PENDING_TOKENS:
            return ""
        self._advance_window()
        return new_text[len(prefix_text) :]

    def _advance_window(self) -> None:
        # The tokens just emitted become the context for the next ones.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)

    def _tokens_to_text(self, tokens: list[str]) -> str:
        if self._info.is_fast or not self._info.added_tokens:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizers: added tokens are literal text the model vocabulary's
        # convert_tokens_to_string does not know, so decode the runs between them.
        added = self._info.added_token_strings
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in added:
                if run:
                    parts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(parts)

    def _find_stop(self, new_text_start: int) -> str | None:
        """Search the text reachable by the newest piece; on a match cut the text there."""
        best_index, best_stop = -1, None
        for stop in self.stop:
            # A match must end inside the new text, so it starts at most len-1 chars before.
            index = self._text.find(stop, max(new_text_start - len(stop) + 1, 0))
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self._text = self._text[:end]
        self.stop_reason = best_stop
        return best_stop
