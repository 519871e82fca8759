"""The serve section: the request stream the load generator sends (lengths, arrivals, where requests come from),
the SLOs, and the engine's arguments."""

from __future__ import annotations

from typing import Any

import attrs

from llmadapt.spec.fields import above, at_least, choice, share

ARRIVALS = ("constant", "poisson", "gamma", "closed", "trace")
SOURCE_KINDS = ("synthetic", "sharegpt", "prompts", "random", "shared_prefix", "multi_turn", "mooncake")
LENGTH_DISTS = ("fixed", "uniform", "normal", "dataset")
APIS = ("completions", "chat")


@attrs.frozen
class LengthSpec:
    """A token-length distribution. Samples are clipped to [low, high] and drawn from the workload's seed."""

    dist: str = attrs.field(default="fixed", validator=choice(LENGTH_DISTS))
    """fixed (= mean), uniform (low..high), normal (mean, std), dataset (lengths of data.path's prompts/answers)."""
    mean: int = attrs.field(default=32, validator=at_least(1))
    low: int = attrs.field(default=1, validator=at_least(1))
    high: int = attrs.field(default=128, validator=at_least(1))
    std: float = attrs.field(default=0.0, validator=at_least(0.0))


@attrs.frozen
class ArrivalSpec:
    """When requests are sent."""

    process: str = attrs.field(default="poisson", validator=choice(ARRIVALS))
    """constant, poisson, gamma (shape = burstiness; 1 = Poisson, < 1 burstier), closed (fixed concurrency),
    trace (replay a JSONL of send_time_s, input_len, output_len)."""
    rate: float = attrs.field(default=4.0, validator=at_least(0.0))
    """Requests per second (open-loop processes)."""
    burstiness: float = attrs.field(default=1.0, validator=at_least(0.0))
    concurrency: int = attrs.field(default=4, validator=at_least(1))
    """Requests in flight at all times (closed loop)."""
    trace: str | None = None


@attrs.frozen
class SourceSpec:
    """Where a serving run's requests come from (docs/serving.md, "Request streams"); the default, 'synthetic',
    draws prompt and output lengths from serve.input_len and serve.output_len. Files are the user's own (nothing is
    downloaded), read and checked before anything starts (llmadapt.streamfiles); left out of the hashes at the
    default."""

    kind: str = attrs.field(default="synthetic", validator=choice(SOURCE_KINDS))
    """synthetic; sharegpt (a ShareGPT-layout conversation file: first human turn as prompt, the gpt turn's length
    as output length); prompts (a JSONL of prompts, with optional answers); random (lengths uniform within
    range_ratio of serve.input_len.mean and serve.output_len.mean, as vLLM's --random-range-ratio); shared_prefix
    (prefixes x suffixes prompts); multi_turn (conversations whose turns carry their history); mooncake (replay of
    a Mooncake-layout trace: timestamp ms, input_length, output_length, hash_ids)."""
    path: str | None = None
    """The file (sharegpt, prompts, mooncake; multi_turn reads a ShareGPT file's turns when given)."""
    prompt_field: str = "prompt"
    """prompts: the field holding each line's prompt."""
    answer_field: str = "answer"
    """prompts: the optional field holding an answer, whose length in tokens is the output length (a line without
    one gets serve.output_len's)."""
    min_input_len: int = attrs.field(default=1, validator=at_least(1))
    """File streams: entries whose prompt is shorter (tokens of the canonical tokenizer) are left out."""
    max_input_len: int | None = attrs.field(default=None, validator=at_least(1))
    min_output_len: int = attrs.field(default=1, validator=at_least(1))
    max_output_len: int | None = attrs.field(default=None, validator=at_least(1))
    range_ratio: float = attrs.field(default=0.0, validator=at_least(0.0))
    """random: lengths uniform in [mean * (1 - r), mean * (1 + r)]; below 1."""
    prefixes: int = attrs.field(default=1, validator=at_least(1))
    """shared_prefix: distinct prefixes, each followed by ``suffixes`` distinct suffixes."""
    suffixes: int = attrs.field(default=1, validator=at_least(1))
    prefix_len: int = attrs.field(default=64, validator=at_least(1))
    suffix_len: int = attrs.field(default=16, validator=at_least(1))
    turns: int = attrs.field(default=3, validator=at_least(1))
    """multi_turn without a file: turns per conversation (serve.input_len new tokens and serve.output_len answer
    tokens each)."""
    think_s: float = attrs.field(default=0.0, validator=at_least(0.0))
    """multi_turn: seconds between a turn's answer and the next turn's send."""
    time_scale: float = attrs.field(default=1.0, validator=above(0))
    """mooncake: the trace's time gaps multiplied by this (0.5 replays twice as fast)."""
    block_size: int = attrs.field(default=512, validator=at_least(1))
    """mooncake: tokens per hash id (512 in Mooncake's traces): requests that share a hash id share that block."""


@attrs.frozen
class SloSpec:
    """Service-level objectives for goodput: a request counts if it meets every one given."""

    ttft_ms: float | None = attrs.field(default=None, validator=above(0))
    tpot_ms: float | None = attrs.field(default=None, validator=above(0))
    e2el_ms: float | None = attrs.field(default=None, validator=above(0))


@attrs.frozen
class EngineSpec:
    """Arguments of the serving engine, by one name on every engine: each adapter declares which it takes
    (``Supports.engine``) and passes them as its engine's own flags; the defaults leave the engine's own defaults
    (and the adapter's). Recorded with the workload in every trace's header."""

    tensor_parallel: int = attrs.field(default=1, validator=at_least(1))
    """Tensor-parallel degree inside the engine (vLLM's --tensor-parallel-size)."""
    quantization: str = "none"
    """The engine's weight quantization method, by its name (vLLM's --quantization, e.g. 'fp8'); 'none': off."""
    kv_cache_bytes: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least(1)))
    """KV-cache size (vLLM's --kv-cache-memory-bytes); None: the adapter's default."""
    max_batched_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least(1)))
    """Tokens per engine step (vLLM's --max-num-batched-tokens; the reference server's --cb-max-batch-tokens)."""
    max_sequences: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least(1)))
    """Sequences in one batch (vLLM's --max-num-seqs)."""
    scheduling: str = attrs.field(default="fcfs", validator=choice(("fcfs", "priority")))
    """Scheduling policy (vLLM's --scheduling-policy)."""
    prefix_caching: bool | None = attrs.field(default=None,
                                              validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    """Reuse the KV cache of prompt prefixes seen before (vLLM's --enable-prefix-caching / --no-enable-prefix-caching);
    None: the engine's default (vLLM: on)."""

    def given(self) -> dict[str, Any]:
        """The arguments set away from their defaults."""
        default = EngineSpec()
        return {f.name: getattr(self, f.name) for f in attrs.fields(EngineSpec)
                if getattr(self, f.name) != getattr(default, f.name)}

    def label(self) -> str:
        """The arguments set, as a configuration's name: 'max_sequences=4,prefix_caching=false'; '' for none."""
        return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.given().items())


QUALITY_TEXTS = 16
"""The held-out texts shipped (llmadapt/resources/quality-texts.jsonl)."""


@attrs.frozen
class QualitySpec:
    """Quality beside speed (llmadapt.runtime.quality): after the measured requests, fixed held-out texts sent to
    the engine greedily, its answers and top-k log-probabilities scored against transformers' fp32 decoding of the
    same checkpoint. Off (``texts = 0``) by default."""

    texts: int = attrs.field(default=0, validator=[at_least(0), attrs.validators.le(QUALITY_TEXTS)])
    """How many of the packaged held-out texts to send (0: no quality probe; at most the texts shipped)."""
    output_tokens: int = attrs.field(default=24, validator=at_least(1))
    """Greedy tokens asked for per text (the engine may stop earlier at its end-of-sequence token)."""
    top_logprobs: int = attrs.field(default=20, validator=at_least(1))
    """Log-probabilities asked for per position (vLLM allows 20 by default)."""
    min_share: float = attrs.field(default=0.99, validator=share)
    """The gate: a row whose same-top-token share (or, where the engine returns no log-probabilities, identical-
    response share) falls below this share of the reference's is marked."""
    output_tolerance: float = attrs.field(default=0.10, validator=share)
    """The gate: a row whose output tokens per request differ from the reference's by more than this share is
    marked."""


@attrs.frozen
class ServeSpec:
    """Serving: the request stream the load generator sends, the same to every engine."""

    arrival: ArrivalSpec = attrs.field(factory=ArrivalSpec)
    requests: int = attrs.field(default=32, validator=at_least(1))
    """Measured requests (warm-up requests come on top)."""
    duration_s: float | None = attrs.field(default=None, validator=above(0))
    """Stop scheduling after this many seconds (requests still bounds the count)."""
    warmup_requests: int = attrs.field(default=2, validator=at_least(0))
    max_concurrency: int | None = attrs.field(default=None, validator=at_least(1))
    """Cap on requests in flight for open-loop processes (none: unbounded)."""
    input_len: LengthSpec = attrs.field(factory=lambda: LengthSpec(mean=32))
    output_len: LengthSpec = attrs.field(factory=lambda: LengthSpec(mean=16))
    ignore_eos: bool = True
    """Force the output length where the engine allows it (recorded either way)."""
    api: str = attrs.field(default="completions", validator=choice(APIS))
    slo: SloSpec = attrs.field(factory=SloSpec)
    request_timeout_s: float = attrs.field(default=120.0, validator=at_least(0.001))
    max_failed_share: float = attrs.field(default=0.0, validator=share)
    """The share of measured requests that may fail or be truncated before the run is 'degraded' (exit 1 from
    `llmadapt run`); 0: any failed request degrades it. A judgement of the result, not part of the workload's
    hash."""
    scrape_interval_s: float = attrs.field(default=1.0, validator=at_least(0.05))
    """How often the engine's own metrics are sampled."""
    send_spin_ms: float = attrs.field(default=5.0, validator=at_least(0))
    """Open loops: each request's task yield-spins this long before its send time, for a sub-millisecond
    send lag (the event loop's timer alone woke >1.5 ms late for ~1 % of sends on an idle VM); it keeps
    most of a core busy at hundreds of requests/s. 0 (the timer only, as `vllm bench serve` does) where
    the engine shares the client's CPUs."""
    url: str | None = None
    """Attach to a running server at this URL instead of starting one (adapters that can)."""
    engine: EngineSpec = attrs.field(factory=EngineSpec)
    mode: str = attrs.field(default="online", validator=choice(("online", "offline")))
    """'online': requests sent over the engine's API at their arrival times (the load generator); 'offline': the
    whole request set handed to the engine's offline API at once (vLLM's LLM.generate, transformers' generate),
    for tokens per second without a server (llmadapt.runtime.offline)."""
    stream: int = attrs.field(default=0, validator=at_least(0))
    """Which of the workload's request streams (prompts, lengths, arrival times) to send; 0: the usual one. Load
    sweeps give each load point its own, so that no prompt reaches one engine twice (a prefix cache would answer
    it from memory), and the same point the same stream on every engine."""
    source: SourceSpec = attrs.field(factory=SourceSpec)
    """Where the requests come from: synthetic lengths, a conversation or prompt file, shared prefixes, multi-turn
    conversations, a replayed trace (SourceSpec)."""
    profile: bool = False
    """Ask the engine for its own torch profile over the run (from before the first request to after the last),
    broken down per engine step into the training breakdown's operator classes plus sampling, the scheduler and
    the engine's Python (llmadapt.runtime.engine_profile); engines that can say so (`Supports.engine_profile`: vllm,
    and hf under its profiler launcher llmadapt.reference.profiled_serve)."""
    quality: QualitySpec = attrs.field(factory=QualitySpec)
    """Quality beside speed: held-out texts sent greedily after the measured requests (QualitySpec)."""
