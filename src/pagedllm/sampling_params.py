"""SamplingParams: what to generate for one request, with vLLM's names and defaults."""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from pagedllm.structured_params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

_SAMPLING_EPS = 1e-5
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_BOOL_FIELDS = ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output")

# A logits processor gets the output token ids so far (and optionally the prompt ids
# first) and the 1-D logits row of this request, and returns the new row.
LogitsProcessor = Callable[..., Any]


def _short(value: Any, limit: int = 40) -> str:
    """A user's value in an error message, cut to a short prefix (never echo a whole payload)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(truncated)"


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    # A constraint on the output (JSON schema, regex, choice, grammar...); ``guided_decoding``
    # is vLLM's older name for it, moved here.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None
    # Filled in by the engine (update_from_generation_config / update_from_tokenizer), read through
    # the properties below; not the user's to set.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._verify_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logprobs is True:  # vLLM accepts a bool meaning "the sampled token only"
            self.logprobs = 0
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 0
        if 0 < self.temperature < _SAMPLING_EPS:
            self.temperature = 0.0
        self._verify()
        self._take_guided_decoding()
        if self.temperature == 0.0:  # greedy: the other sampling knobs do nothing
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """Build from keyword arguments, treating None as "use the default"."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's generation_config eos ids (unless ignore_eos)."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """Each bad word's token ids, with and without a leading space."""
        return self._bad_words_token_ids

    def update_from_generation_config(self, eos_token_ids: set[int]) -> None:
        """The model's generation_config eos ids stop the request too, unless ignore_eos."""
        if not self.ignore_eos:
            self._all_stop_token_ids |= eos_token_ids

    def update_from_tokenizer(self, tokenizer: Any | None) -> None:
        """Tokenize bad_words: each word without and with a leading space (at the start of the text
        and mid-sentence)."""
        if not self.bad_words:
            self._bad_words_token_ids = []
            return
        if tokenizer is None:
            raise ValueError("bad_words needs a tokenizer")
        out: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        self._bad_words_token_ids = out

    def clone(self) -> "SamplingParams":
        # logits processors may hold state or tensors: share them, copy the rest.
        procs = self.logits_processors
        self.logits_processors = None
        try:
            new = copy.deepcopy(self)
        finally:
            self.logits_processors = procs
        new.logits_processors = procs
        return new

    def _take_guided_decoding(self) -> None:
        """The old name's value moves to ``structured_outputs`` (one constraint, one place)."""
        for name in ("structured_outputs", "guided_decoding"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, StructuredOutputsParams):
                raise ValueError(f"{name} must be StructuredOutputsParams or None, got {_short(v)}.")
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("set structured_outputs or guided_decoding (its older name), not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None

    def _verify_types(self) -> None:
        """A wrong type names its field (not a bare "'<' not supported" from a range check)."""
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ValueError(f"{name} must be a number, got {_short(v)}.")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {_short(getattr(self, name))}.")
        for name in ("stop", "stop_token_ids", "bad_words"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, list, tuple)) or (name != "stop" and isinstance(v, str)):
                raise ValueError(f"{name} must be a list, got {_short(v)}.")

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "None or an integer in [-2**63, 2**64)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < -1):
                raise bad(name, "None, -1 (whole vocabulary) or an integer >= 0")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < 1
        ):
            raise bad("truncate_prompt_tokens", "an integer >= 1 or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "a non-empty list of token ids or None")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "a list of non-negative token ids")
        if self.logits_processors is not None and any(not callable(p) for p in self.logits_processors):
            raise bad("logits_processors", "a list of callables")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind")

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in range, logprob counts within the cap."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"{name} must be token ids < vocab_size={vocab_size}, got {ids!r}.")
        if self.logit_bias:
            if any(not 0 <= int(t) < vocab_size for t in self.logit_bias):
                raise ValueError(f"logit_bias keys must be token ids < vocab_size={vocab_size}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs={max_logprobs}, got {v}.")

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            v = getattr(self, f.name)
            if v != f.default and not (f.default is None and v == []):
                shown.append(f"{f.name}={v!r}")
        return f"SamplingParams({', '.join(shown)})"
