"""The reference adapter's offline engine: transformers' batch generation (``generate``) in the reference
environment, fp32 or bf16, greedy. Requests are grouped by requested output length, one ``generate`` call per
group with the group's prompts left-padded into one batch, the length forced (``min_new_tokens`` =
``max_new_tokens``): the throughput of plain batched generation, without continuous batching."""

from __future__ import annotations

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

    def generate(self, requests) -> list[int]:
        torch = self.torch
        groups: dict[int, list] = {}
        for r in requests:
            groups.setdefault(r.output_tokens, []).append(r)
        made: dict[int, int] = {}
        with torch.no_grad():
            for length, group in groups.items():
                width = max(len(r.prompt_token_ids) for r in group)
                ids = torch.tensor([[self.pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids
                                    for r in group], device=self.device)
                mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                                     for r in group], device=self.device)
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=length,
                                          min_new_tokens=length, do_sample=False, pad_token_id=self.pad)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                for r in group:
                    made[r.index] = out.shape[1] - width
        return [made[r.index] for r in requests]
