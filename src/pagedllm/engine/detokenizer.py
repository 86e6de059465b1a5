"""Turn one request's output tokens into text step by step, and find its stop strings."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

try:  # tokenizers >= 0.22: a stream can start from context ids (`ids=`), which the prompt needs
    from tokenizers.decoders import DecodeStream

    DecodeStream(ids=[], skip_special_tokens=False)
except (ImportError, TypeError):  # older tokenizers: every request takes the Python window path
    DecodeStream = None

# How many prompt tokens start the decode window: enough for the first output token to
# be decoded in context, so sentencepiece's "▁Hello" or byte-level "ĠHello" keeps its
# leading space instead of being stripped as the start of a text.
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character is at most 4 bytes, so at most 3 pending tokens can hold an
# unfinished one. Text still ending in U+FFFD after this many tokens is a real
# replacement character (or invalid bytes), and waiting longer would only grow the window.
_MAX_PENDING_TOKENS = 4

_REPLACEMENT_CHAR = "\ufffd"

# The stream path keeps the ids it decoded in one list; emitted ids this far back are dropped.
_MAX_KEPT_IDS = 1024


def decode_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token on its own, as a logprob entry shows it (special tokens included).

    Cached per tokenizer: a step with logprobs decodes every candidate of every row, and a
    token's text never changes."""
    texts = _token_text_cache(tokenizer)
    text = texts.get(token_id)
    if text is None:
        text = tokenizer.decode([token_id])
        if texts is not _NO_CACHE:
            texts[token_id] = text
    return text


_NO_CACHE: dict[int, str] = {}
_token_texts: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def _token_text_cache(tokenizer: Any) -> dict[int, str]:
    try:
        return _token_texts[tokenizer]
    except KeyError:
        texts: dict[int, str] = {}
        _token_texts[tokenizer] = texts
        return texts
    except TypeError:  # not weak-referenceable: decode every time
        return _NO_CACHE


@dataclass(frozen=True)
class _TokenizerInfo:
    """Facts about a tokenizer that every request needs; costly to compute, so cached."""

    is_fast: bool
    special_ids: frozenset[int]
    # id -> text of tokens added on top of the model vocabulary (special or not).
    added_tokens: dict[int, str]
    added_token_strings: frozenset[str]
    # A fast tokenizer's Rust `tokenizers.Tokenizer` (None for Python tokenizers), and its
    # size with added tokens: ids below it have text, ids at or above it are looked up.
    backend: Any
    backend_vocab_size: int


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
    is_fast = bool(getattr(tokenizer, "is_fast", False))
    backend = getattr(tokenizer, "backend_tokenizer", None) if is_fast else None
    info = _TokenizerInfo(
        is_fast=is_fast,
        special_ids=frozenset(special),
        added_tokens=added,
        added_token_strings=frozenset(added.values()),
        backend=backend,
        backend_vocab_size=backend.get_vocab_size(with_added_tokens=True) if backend is not None else 0,
    )
    try:
        _info_cache[tokenizer] = info
    except TypeError:  # not weak-referenceable: recompute per request, still correct
        pass
    return info


class IncrementalDetokenizer:
    """Decodes one request's output tokens as they arrive, at a cost per token that does
    not grow with the output length, and stops the text at the first stop string.

    Text is built with a sliding window: the context already emitted and the tokens not yet
    emitted. Each step decodes the window with and without the new tokens and emits the
    difference, so decoders that look at neighbours (leading-space stripping, byte
    fallback) see enough context. Text ending in U+FFFD means a UTF-8 character is split
    over byte tokens; it is held until the rest of its bytes arrive. Fast tokenizers run
    this window in Rust (`tokenizers.decoders.DecodeStream`, one call per token; see
    `_StreamPieces`), Python tokenizers (or `use_decode_stream=False`) in `_WindowPieces`;
    both emit the same text.

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
        use_decode_stream: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # An empty stop string would match before any text; it cannot mean anything.
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        info = self._info = _tokenizer_info(tokenizer)
        self._skipped_ids = info.special_ids if skip_special_tokens else frozenset()
        self._added_tokens = info.added_tokens
        # Fast tokenizers: an added token right after another is its raw text (see above).
        self._raw_consecutive_added = info.is_fast and not spaces_between_special_tokens

        self.output_token_ids: list[int] = []
        # Per output token, the text it added to output_text (empty while its character
        # is incomplete, or when skipped). vLLM's Logprob.decoded_token is each token
        # decoded alone instead: use `decode_token` for that.
        self.output_token_decoded: list[str] = []
        # The stop string that ended the text, once one has.
        self.stop_reason: str | None = None

        self._pieces: _StreamPieces | _WindowPieces
        if use_decode_stream and info.backend is not None and DecodeStream is not None:
            self._pieces = _StreamPieces(info)
        else:
            self._pieces = _WindowPieces(tokenizer, info, spaces_between_special_tokens)
        context = self._prompt_context(prompt_token_ids)
        self._last_kept_is_added = bool(context) and context[-1] in self._added_tokens
        self._pieces.start(context)
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
        token_ids, decoded, decode_next = self.output_token_ids, self.output_token_decoded, self._decode_next
        for token_id in new_token_ids:
            token_ids.append(token_id)
            piece = decode_next(token_id)
            decoded.append(piece)
            if not piece:
                continue
            new_text_start = len(self._text)
            self._text += piece
            # vLLM semantics: no stop string may end within the first min_tokens tokens.
            if not self.stop or len(token_ids) <= self.min_tokens:
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
        if not finished and self._stop_holdback_chars:
            end = max(end - self._stop_holdback_chars, 0)
        if not delta:
            return self._text[:end]
        if end <= self._sent_offset:
            return ""
        start, self._sent_offset = self._sent_offset, end
        return self._text[start:end]

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        # Walk back from the end so a long prompt costs only the few tokens we keep.
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(context) == PROMPT_CONTEXT_TOKENS:
                break
            if token_id not in self._skipped_ids and self._pieces.has_text(token_id):
                context.append(token_id)
        context.reverse()
        return context

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skipped_ids:
            return ""
        if not self._raw_consecutive_added:  # the usual case: no added-token rule to track
            return self._pieces.next(token_id) or ""
        is_added = token_id in self._added_tokens
        if is_added and self._last_kept_is_added:
            self._pieces.push_emitted(token_id)
            return self._added_tokens[token_id]
        piece = self._pieces.next(token_id)
        if piece is None:  # out of vocabulary: no text, and no context for the next token
            return ""
        self._last_kept_is_added = is_added
        return piece

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


class _StreamPieces:
    """The text each kept token adds, from tokenizers' Rust `DecodeStream`: one call per token
    that decodes the window and emits the difference, as `_WindowPieces` does in Python.

    The ids are mirrored here (`_prefix`, `_read` as in `_WindowPieces`) for the cases the
    stream does not cover, which take the Python rule once on this window and restart the
    stream after it: text still ending in U+FFFD after `_MAX_PENDING_TOKENS` (invalid bytes,
    which the stream would hold forever), a window whose new text no longer starts with its
    old text (the stream raises), and a window that itself ends in U+FFFD (a stream started
    from it would emit it again)."""

    def __init__(self, info: _TokenizerInfo) -> None:
        self._backend = info.backend
        self._vocab_size = info.backend_vocab_size
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._stream: Any = None

    def has_text(self, token_id: int) -> bool:
        # Models often pad their vocabulary past the tokenizer's; such ids have no text.
        return token_id < self._vocab_size or self._backend.id_to_token(token_id) is not None

    def start(self, context_ids: list[int]) -> None:
        self._ids = list(context_ids)
        self._read = len(self._ids)
        self._restart()

    def next(self, token_id: int) -> str | None:
        """The text `token_id` completes ("" while pending), or None when it has no text."""
        if token_id >= self._vocab_size and not self.has_text(token_id):
            return None
        ids = self._ids
        ids.append(token_id)
        stream = self._stream
        if stream is not None:
            try:
                piece = stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - DecodeStreamError (the window's text changed): Python rule
                piece = None
            else:
                if piece is not None:
                    # The tokens just emitted become the context for the next ones (_advance, inline).
                    self._prefix, self._read = self._read, len(ids)
                    if self._prefix > _MAX_KEPT_IDS:
                        self._drop_emitted()
                    return piece
                if len(ids) - self._read < _MAX_PENDING_TOKENS:
                    return ""
        return self._window_step()

    def push_emitted(self, token_id: int) -> None:
        """Take a token whose text the caller emits itself; it becomes the next context."""
        self._ids.append(token_id)
        self._advance()
        self._restart()

    def _window_step(self) -> str:
        ids, decode = self._ids, self._backend.decode
        prefix_text = decode(ids[self._prefix : self._read], skip_special_tokens=False)
        new_text = decode(ids[self._prefix :], skip_special_tokens=False)
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and len(ids) - self._read < _MAX_PENDING_TOKENS:
            return ""
        self._advance()
        self._restart()
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        # The tokens just emitted become the context for the next ones.
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > _MAX_KEPT_IDS:
            self._drop_emitted()

    def _drop_emitted(self) -> None:
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0

    def _restart(self) -> None:
        window = self._ids[self._prefix : self._read]
        clean = not window or not self._backend.decode(window, skip_special_tokens=False).endswith(_REPLACEMENT_CHAR)
        self._stream = DecodeStream(ids=window, skip_special_tokens=False) if clean else None


class _WindowPieces:
    """The text each kept token adds, in Python: `_prefix_offset` marks the start of the
    context already emitted, `_read_offset` the first token not yet emitted; each token
    decodes the window with and without the pending tokens and emits the difference."""

    def __init__(self, tokenizer: Any, info: _TokenizerInfo, spaces_between_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self._info = info
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._tokens: list[str] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def has_text(self, token_id: int) -> bool:
        # Models often pad their vocabulary past the tokenizer's; such ids have no text.
        return self.tokenizer.convert_ids_to_tokens(token_id) is not None

    def start(self, context_ids: list[int]) -> None:
        self._tokens = [self.tokenizer.convert_ids_to_tokens(i) for i in context_ids]
        self._read_offset = len(self._tokens)

    def next(self, token_id: int) -> str | None:
        """The text `token_id` completes ("" while pending), or None when it has no text."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return None
        self._tokens.append(token)
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

    def push_emitted(self, token_id: int) -> None:
        """Take a token whose text the caller emits itself; it becomes the next context."""
        self._tokens.append(self.tokenizer.convert_ids_to_tokens(token_id))
        self._advance_window()

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
        return (" " if self._spaces_between_special_tokens else "").join(parts)
