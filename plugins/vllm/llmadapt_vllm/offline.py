"""vLLM's offline engine: ``vllm.LLM`` and ``LLM.generate`` over the whole request set at once (continuous
batching inside one process), greedy, output lengths forced (``ignore_eos``), with the server's settings
(dtype, context length, seed, KV-cache size, eager mode, the workload's engine arguments)."""

from __future__ import annotations

import os
from pathlib import Path

from .server import DTYPES, KV_CACHE_BYTES, KV_CACHE_ENV, socket_dir

# serve.engine's arguments as LLM(...) keywords
ENGINE_KWARGS = {"tensor_parallel": "tensor_parallel_size", "quantization": "quantization",
                 "max_batched_tokens": "max_num_batched_tokens", "max_sequences": "max_num_seqs",
                 "scheduling": "scheduling_policy", "prefix_caching": "enable_prefix_caching"}


class VLLMOffline:
    forces_length = True

    def __init__(self, workload, checkpoint: Path) -> None:
        # as the server: engine sockets in a short private folder, loopback only, no usage reports, offline hub
        os.environ.update({"TMPDIR": str(socket_dir()), "VLLM_HOST_IP": "127.0.0.1",
                           "VLLM_LOOPBACK_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        from vllm import LLM

        engine = workload.serve.engine
        kv = engine.kv_cache_bytes or int(os.environ.get(KV_CACHE_ENV) or KV_CACHE_BYTES)
        extra = {ENGINE_KWARGS[k]: v for k, v in engine.given().items() if k in ENGINE_KWARGS}
        self.llm = LLM(model=str(checkpoint), dtype=DTYPES[workload.precision],
                       max_model_len=workload.model.max_position_embeddings, seed=workload.seed,
                       kv_cache_memory_bytes=kv, enforce_eager=True,
                       disable_log_stats=False,  # each output then carries its request's times (RequestStateStats)
                       **extra)

    def version(self) -> str:
        import vllm

        return f"vllm {vllm.__version__} (LLM.generate)"

    def generate(self, requests) -> list:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
        params = [SamplingParams(max_tokens=r.output_tokens, ignore_eos=True, temperature=0.0) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_generated(o) for o in outputs]


def _generated(output):
    """The request's token count and, from the engine core's request stats (monotonic seconds, the clock of
    time.monotonic_ns on this machine), when its first and last tokens came."""
    from llmadapt.adapter import Generated

    tokens, stats = len(output.outputs[0].token_ids), getattr(output, "metrics", None)
    if stats is None or not getattr(stats, "first_token_ts", 0) or not getattr(stats, "last_token_ts", 0):
        return tokens
    return Generated(tokens=tokens, first_token_ns=int(stats.first_token_ts * 1e9),
                     last_token_ns=int(stats.last_token_ts * 1e9))
