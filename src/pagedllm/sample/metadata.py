"""Sampling metadata: each request's sampling values as row columns, and one step's tensors built from them.

A request's sampling values (temperature, top-p/k, min-p, penalties, logprobs, bias...) are
written once, into the row of the input batch that holds it, when it is added
(``SAMPLING_COLUMNS``). A step then gathers the sampling rows' values from those columns
with numpy indexing; only the features some row of the step uses are built (a per-row
bitmask says which), and only what depends on the output so far (penalty histories, banned
tokens, logits processors' inputs) is read from the request states.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np
import torch

from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

# The optional sampler inputs, one bit each in a row's "features" column.
FEATURES = ("top_p", "top_k", "min_p", "logprobs", "presence", "frequency", "repetition", "allowed", "bias",
            "ban", "procs", "seed")
BIT = {name: 1 << i for i, name in enumerate(FEATURES)}
# Features that read the exact output history, so an in-flight step must land first.
HISTORY_BITS = BIT["presence"] | BIT["frequency"] | BIT["repetition"] | BIT["procs"] | BIT["ban"]
# The output histories are handed to the sampler for penalties and logits processors.
_OUTPUT_BITS = BIT["presence"] | BIT["frequency"] | BIT["repetition"] | BIT["procs"]
NO_LOGPROBS = -2  # the "logprobs" column of a request that asked for none (-1 means all)


def sampling_features(p: SamplingParams) -> frozenset[str]:
    """Which optional sampler inputs a request needs, so a step builds only those."""
    f = set()
    if p.top_p < 1.0:
        f.add("top_p")
    if p.top_k > 0:
        f.add("top_k")
    if p.min_p > 0.0:
        f.add("min_p")
    if p.logprobs is not None:
        f.add("logprobs")
    if p.presence_penalty != 0.0:
        f.add("presence")
    if p.frequency_penalty != 0.0:
        f.add("frequency")
    if p.repetition_penalty != 1.0:
        f.add("repetition")
    if p.allowed_token_ids:
        f.add("allowed")
    if p.logit_bias:
        f.add("bias")
    if p.min_tokens > 0 or p.bad_words_token_ids:
        f.add("ban")
    if p.logits_processors:
        f.add("procs")
    if p.seed is not None:
        f.add("seed")
    return frozenset(f)


def feature_bits(p: SamplingParams) -> int:
    return sum(BIT[name] for name in sampling_features(p))


class SamplingColumn(NamedTuple):
    """One sampling value per row: its array dtype, the value of an empty row, and how a
    request's value is computed from its params (and the vocabulary size) when it is added."""

    name: str
    dtype: Any
    default: Any
    value: Callable[[SamplingParams, int], Any]


SAMPLING_COLUMNS: tuple[SamplingColumn, ...] = (
    SamplingColumn("temperature", np.float32, 1.0, lambda p, v: p.temperature),
    # Kept beside the float32 temperature: greedy is decided on the Python float, as before.
    SamplingColumn("greedy", np.bool_, False, lambda p, v: p.temperature == 0.0),
    SamplingColumn("features", np.int64, 0, lambda p, v: feature_bits(p)),
    SamplingColumn("top_p", np.float32, 1.0, lambda p, v: p.top_p),
    SamplingColumn("top_k", np.int64, 0, lambda p, v: min(p.top_k or v, v)),
    SamplingColumn("min_p", np.float32, 0.0, lambda p, v: p.min_p),
    SamplingColumn("presence", np.float32, 0.0, lambda p, v: p.presence_penalty),
    SamplingColumn("frequency", np.float32, 0.0, lambda p, v: p.frequency_penalty),
    SamplingColumn("repetition", np.float32, 1.0, lambda p, v: p.repetition_penalty),
    SamplingColumn("logprobs", np.int64, NO_LOGPROBS, lambda p, v: NO_LOGPROBS if p.logprobs is None else p.logprobs),
    SamplingColumn("allowed_token_ids", object, None, lambda p, v: list(p.allowed_token_ids or ()) or None),
    SamplingColumn("logit_bias", object, None,
                   lambda p, v: {int(k): float(val) for k, val in p.logit_bias.items()} if p.logit_bias else None),
)


class SamplingCounts:
    """How many requests of the batch are greedy, use any optional feature, or read their
    history: where no row (or every row) does, a step answers without gathering columns."""

    def __init__(self) -> None:
        self.requests = self.greedy = self.featured = self.history = 0

    def add(self, columns: Mapping[str, np.ndarray], row: int, sign: int = 1) -> None:
        """Count the request in ``row`` (``sign=-1``: uncount it, before the row is reused)."""
        bits = int(columns["features"][row])
        self.requests += sign
        self.greedy += sign * bool(columns["greedy"][row])
        self.featured += sign * (bits != 0)
        self.history += sign * (bits & HISTORY_BITS != 0)


class RequestView(Protocol):
    """What a step reads of a request state beyond the columns: its history so far."""

    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None

    @property
    def output_token_ids(self) -> list[int]: ...


def banned_tokens(p: SamplingParams, output: Sequence[int]) -> list[int]:
    """Tokens a request may not sample now: stop/EOS before min_tokens, and the last token of
    any bad word whose other tokens were just generated."""
    banned: list[int] = []
    if len(output) < p.min_tokens:
        banned.extend(p.all_stop_token_ids)
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(output) >= len(prefix) and (not prefix or output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


class SamplingMetadataBuilder:
    """Builds a step's SamplingMetadata from the row columns of an input batch.

    ``columns`` maps each SAMPLING_COLUMNS name to its per-row array; ``token_ids`` and
    ``num_prompt_tokens`` are the batch's per-row token array and prompt lengths (for
    repetition penalties' prompt tokens); ``counts`` its running SamplingCounts. All are
    read, never written.
    """

    def __init__(self, columns: Mapping[str, np.ndarray], counts: SamplingCounts, token_ids: np.ndarray,
                 num_prompt_tokens: np.ndarray, vocab_size: int, device: torch.device) -> None:
        self.columns = columns
        self.counts = counts
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.vocab_size = vocab_size
        self.device = device

    def temperature(self, rows: np.ndarray) -> np.ndarray:
        """The rows' temperatures (float32), for the caller to upload with the step's inputs."""
        return self.columns["temperature"][rows]

    def needs_history(self, rows: np.ndarray) -> np.ndarray | None:
        """Per row: whether its sampling reads the exact output history (None: no row does)."""
        if not self.counts.history:
            return None
        return (self.columns["features"][rows] & HISTORY_BITS) != 0

    def build(self, states: Sequence[RequestView], rows: np.ndarray, temperature: torch.Tensor) -> SamplingMetadata:
        """The metadata of ``states`` (held in ``rows``), ``temperature`` already on the device."""
        cols, counts = self.columns, self.counts
        if counts.greedy in (0, counts.requests):  # the batch's requests (a superset of rows) all agree
            all_greedy = counts.greedy > 0
            all_random = not all_greedy
        else:
            greedy = cols["greedy"][rows]
            all_greedy, all_random = bool(greedy.all()), not greedy.any()
        md = SamplingMetadata(temperature=temperature, all_greedy=all_greedy, all_random=all_random)
        if not counts.featured:
            return md
        row_bits = cols["features"][rows]
        bits = int(np.bitwise_or.reduce(row_bits))
        if not bits:
            return md
        if bits & BIT["seed"]:
            md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        if bits & _OUTPUT_BITS:
            md.output_token_ids = [s.output_token_ids for s in states]
        self._add_tensors(md, bits, rows)
        if bits & BIT["allowed"]:
            md.allowed_token_ids_mask = self._allowed_mask(rows).to(self.device)
        if bits & (BIT["bias"] | BIT["ban"] | BIT["procs"]):
            self._add_row_edits(md, states, rows, row_bits)
        return md

    def _add_tensors(self, md: SamplingMetadata, bits: int, rows: np.ndarray) -> None:
        """The per-row numeric settings some row of the step uses."""
        cols, dev = self.columns, self.device

        def column(name: str) -> torch.Tensor:
            return torch.from_numpy(cols[name][rows]).to(dev)

        if bits & BIT["top_p"]:
            md.top_p = column("top_p")
        if bits & BIT["top_k"]:
            md.top_k = column("top_k")
        if bits & BIT["min_p"]:
            md.min_p = column("min_p")
        if bits & BIT["logprobs"]:
            wanted = cols["logprobs"][rows]
            wanted = wanted[wanted != NO_LOGPROBS]
            md.max_num_logprobs = -1 if (wanted == -1).any() else int(wanted.max())
        if bits & BIT["presence"]:
            md.presence_penalties = column("presence")
        if bits & BIT["frequency"]:
            md.frequency_penalties = column("frequency")
        if bits & BIT["repetition"]:
            md.repetition_penalties = column("repetition")
            md.prompt_token_ids = self.padded_prompts(rows).to(dev)

    def padded_prompts(self, rows: np.ndarray) -> torch.Tensor:
        """[rows, longest prompt] prompt token ids, padded with vocab_size (which no scatter keeps)."""
        lengths = self.num_prompt_tokens[rows]
        width = int(lengths.max())
        prompts = self.token_ids[rows, :width]
        prompts[np.arange(width)[None, :] >= lengths[:, None]] = self.vocab_size
        return torch.from_numpy(prompts)

    def _allowed_mask(self, rows: np.ndarray) -> torch.Tensor:
        mask = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool)
        for i, allowed in enumerate(self.columns["allowed_token_ids"][rows]):
            if allowed:
                mask[i] = True
                mask[i, allowed] = False
        return mask

    def _add_row_edits(self, md: SamplingMetadata, states: Sequence[RequestView], rows: np.ndarray,
                       row_bits: np.ndarray) -> None:
        """Logit bias, banned tokens and logits processors: rare, applied row by row."""
        biases = self.columns["logit_bias"][rows]
        for i, (s, bias, b) in enumerate(zip(states, biases, row_bits.tolist())):
            if bias is not None:
                md.logit_bias[i] = bias
            if b & BIT["ban"]:
                banned = banned_tokens(s.sampling_params, s.output_token_ids)
                if banned:
                    md.banned_token_ids[i] = banned
            if b & BIT["procs"]:
                md.logits_processors[i] = (s.sampling_params.logits_processors, s.token_ids[:s.num_prompt_tokens])
