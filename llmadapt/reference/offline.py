"""The reference adapter's offline engine: transformers' batch generation (``generate``) in the reference
environment, fp32 or bf16, greedy. Requests are grouped by requested output length, one ``generate`` call per
group with the group's prompts left-padded into one batch, the length forced (``min_new_tokens`` =
``max_new_tokens``): the throughput of plain batched generation, without continuous batching. A streamer notes
when each decoding step's tokens came, so every request has its token times (its group's): TTFT from the call
(the groups before it, then its prefill), TPOT and ITL."""

from __future__ import annotations

import time
from pathlib import Path


class HFOffline:
    forces_length = True

    def __init__(self, workload, checkpoint: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        dtype = torch.bfloat16 if workload.precision == "bf16" else torch.float32
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(self.device).eval()
        config = self.model.config
        self.pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)

    def version(self) -> str:
        import transformers

        return f"transformers {transformers.__version__} (generate)"

    def generate(self, requests) -> list:
        from llmadapt.adapter import Generated

        torch = self.torch
        groups: dict[int, list] = {}
        for r in requests:
            groups.setdefault(r.output_tokens, []).append(r)
        made: dict[int, Generated] = {}
        with torch.no_grad():
            for length, group in groups.items():
                width = max(len(r.prompt_token_ids) for r in group)
                ids = torch.tensor([[self.pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids
                                    for r in group], device=self.device)
                mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                                     for r in group], device=self.device)
                clock = _TokenClock()
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=length,
                                          min_new_tokens=length, do_sample=False, pad_token_id=self.pad,
                                          streamer=clock)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                for r in group:
                    tokens = out.shape[1] - width
                    made[r.index] = Generated(tokens=tokens, token_ns=clock.times[:tokens])
        return [made[r.index] for r in requests]


class _TokenClock:
    """A ``generate`` streamer that notes when each step's tokens came out (generate hands it the prompt first,
    then each step's new tokens, copied to the host: a CUDA step has finished when they arrive)."""

    def __init__(self) -> None:
        self.times: list[int] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.monotonic_ns())
        self._prompt_seen = True

    def end(self) -> None:
        pass
