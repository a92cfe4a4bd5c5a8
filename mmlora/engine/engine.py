"""Engine: add requests, step (schedule -> run -> sample -> postprocess), abort; ``generate`` and
``stream`` (mmlora.engine.batch_api) and adapter management (mmlora.engine.adapter_api) are mixed in.
With the overlap scheduler (mmlora.engine.overlap) a step launches the next forward before it reads
the last one's tokens back.

Not thread-safe: one thread drives ``step``. ``mmlora.engine.background.BackgroundEngine`` runs it
on a thread for the server and the app.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from mmlora.config import EngineConfig
from mmlora.distributed.launch import Workers
from mmlora.distributed.state import WorkerFailure, all_reduce_min, shutdown_tp
from mmlora.distributed.step import Command, send_header
from mmlora.engine.adapter_api import AdapterAPI
from mmlora.engine.batch_api import BatchAPI
from mmlora.engine.detokenizer import ids_decoder
from mmlora.engine.fault_isolation import StepGuard, describe_fault
from mmlora.engine.grammar import GrammarCompiler
from mmlora.engine.model_runner import ModelRunner
from mmlora.engine.overlap import InFlightStep, launch_step, overlap_eligible, overlap_enabled
from mmlora.engine.prompt_logprobs import start_prompt_logprobs
from mmlora.engine.request import Request, Status
from mmlora.engine.sampler import bad_row_message
from mmlora.engine.sampling_params import RequestOutput, SamplingParams
from mmlora.engine.scheduler import ScheduledBatch, Scheduler
from mmlora.engine.setup import build_engine_parts
from mmlora.engine.token_intake import append_token, request_output
from mmlora.engine.tp_worker import join_group, worker_main
from mmlora.hub import hub_root
from mmlora.kvcache.prefix_cache import PrefixCache
from mmlora.lora.refs import AdapterRef
from mmlora.lora.registry import AdapterEntry
from mmlora.multimodal.prompt import text_prompt_ids
from mmlora.preflight import check_engine_config

logger = logging.getLogger(__name__)

PreparedPrompt = tuple[list[int], Any]  # (token ids, the model's multimodal inputs or None)


class Engine(BatchAPI, AdapterAPI):
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(**kwargs)
        elif kwargs:
            config = config.replace(**kwargs)
        check_engine_config(config)  # every mistake that needs no weights, before any is read
        self.config = config
        self._closed = False
        self._workers: Workers | None = None
        tp = config.parallel.tp_size
        if tp > 1:  # workers are spawned copies of this program; this process is rank 0
            self._workers = Workers(worker_main, tp, config)
        try:
            if self._workers is not None:
                join_group(0, tp, self._workers.port, config)
            parts = build_engine_parts(config)
        except BaseException as exc:
            if self._workers is None:
                raise
            workers, self._workers = self._workers, None
            workers.join(0)  # kills them: they may wait in a setup step rank 0 never reaches
            shutdown_tp()
            if isinstance(exc, WorkerFailure):
                raise workers.failure(exc, grace_s=0) from exc
            raise
        self.device = parts.device
        self.model = parts.model
        self.hf_config = parts.hf_config
        self.tokenizer = parts.tokenizer
        self._decode_ids = ids_decoder(parts.tokenizer)
        self.lora = parts.lora
        self.kv_cache = parts.kv_cache
        self.max_model_len = parts.max_model_len
        self.model_name = config.model.served_model_name or parts.source.name
        # What /v1/models calls the base's root: "org/name@<commit>" for a hub model, else as given.
        self.model_root = hub_root(parts.source.folder) or config.model.model
        self.is_multimodal = self.model.is_multimodal
        self.multimodal = parts.multimodal
        self.runner = ModelRunner(self.model, self.kv_cache, parts.attention, self.lora, self.device)
        if self._workers is not None:
            all_reduce_min(0, self.device)  # every worker built its shard and waits for commands
        # Under tensor parallelism every rank captures the same graphs (rank 0 tells the workers).
        if not config.scheduler.disable_cuda_graph and self.device.type == "cuda":
            self.runner.enable_cuda_graphs(config.scheduler.max_running_requests, self.max_model_len)
            if not config.scheduler.disable_mixed_cuda_graph:
                self.runner.enable_mixed_graphs(
                    config.scheduler.max_num_batched_tokens,
                    config.scheduler.max_running_requests,
                    self.max_model_len,
                )
        if not config.scheduler.disable_cpu_graph and self.device.type == "cpu":
            self.runner.enable_cpu_graphs(config.scheduler.max_running_requests, self.max_model_len)
        prefix_cache = PrefixCache(self.kv_cache.allocator, enabled=not config.cache.disable_radix)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache.allocator, self.lora, prefix_cache)
        self.eos_ids = parts.eos_ids
        vocab_size = self.model.lm_head.weight.shape[0]
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size, sorted(self.eos_ids))
        # Unseeded requests sample from the engine's own generator, not the process-wide one: results
        # then do not depend on what else in the process draws random numbers.
        self.generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.step_guard = StepGuard(
            self.runner, self.generator, vocab_size, frozenset(self.eos_ids)
        )  # a failing request fails alone
        self.overlap = overlap_enabled(config, self.device)
        self._inflight: InFlightStep | None = None  # the launched step not read back yet (overlap)
        self._requests: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._pending_unloads: list[AdapterEntry] = []
        self._ids = itertools.count()
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished_total": 0}

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | dict | None = None,
        lora: str | AdapterRef | None = None,
        images: Sequence[Any] | None = None,
        request_id: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        client_id: str | None = None,
        prepared: PreparedPrompt | None = None,
        logprob_start_len: int = -1,
    ) -> str:
        """Validate and queue one request; raises ValueError naming what is wrong.

        ``client_id`` names who the request is billed to for fair scheduling (default: its adapter).
        ``prepared`` is what ``prepare_prompt`` returned for this request's prompt (tokenized ahead,
        off this thread, by the server); prompt, input_ids and images are then not read again.
        With ``return_logprob``, prompt-token logprobs are returned from token ``logprob_start_len`` on
        (SGLang's meaning; -1: the last prompt token only).
        """
        self._check_open()
        sp = SamplingParams.from_any(sampling_params)
        if sp.n != 1:
            raise ValueError("sampling_params.n: add_request takes n=1; generate() expands n")
        if sp.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"sampling_params.max_new_tokens: {sp.max_new_tokens} is more than max_model_len={self.max_model_len}"
            )
        vocab = self.model.arch.vocab_size
        if any(t >= vocab for t in sp.stop_token_ids):  # could never match: a typo, not a no-op
            raise ValueError(
                f"sampling_params.stop_token_ids: every id must be below the vocabulary size {vocab}"
            )
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 20:
            raise ValueError("top_logprobs_num: must be an integer in [0, 20]")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.scheduler.max_queued_requests:
            raise OverflowError(
                f"the queue is full ({self.config.scheduler.max_queued_requests} waiting requests)"
            )
        ids, mm_inputs = prepared if prepared is not None else self.prepare_prompt(prompt, input_ids, images)
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room in max_model_len={self.max_model_len}")
        blocks = self.kv_cache.allocator.blocks_needed(len(ids) + 1, 0)
        if blocks > self.kv_cache.allocator.num_blocks:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit in the KV cache")
        if client_id is not None and not (isinstance(client_id, str) and 0 < len(client_id) <= 256):
            raise ValueError("client_id: must be a non-empty string of at most 256 characters")
        grammar = self.grammars.state_for(sp.constraint)  # the server has compiled it off this thread
        entry = self.lora.resolve(lora)
        req = Request(
            rid, ids, sp, entry, return_logprob, top_logprobs_num, client_id, mm_inputs, grammar=grammar
        )
        if return_logprob:
            start_prompt_logprobs(req, logprob_start_len)
        self.scheduler.check_client_queue(self.scheduler.client_of(req))
        if entry is not None:
            self.lora.acquire(entry)
        if sp.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(sp.seed)
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

    def prepare_prompt(
        self, prompt: str | None, input_ids: Sequence[int] | None, images: Any
    ) -> PreparedPrompt:
        """Token ids and multimodal inputs of a prompt; reads only the tokenizer and image processor, so
        any thread may call it while the engine steps."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of text (prompt) and input_ids")
        if images and not self.is_multimodal:
            raise ValueError(f"images: the model {self.model_name!r} is text-only and takes no images")
        if self.multimodal is not None:
            return self.multimodal.prepare_prompt(self.tokenizer, prompt, input_ids, images or [])
        return text_prompt_ids(self.tokenizer, prompt, input_ids, self.model.arch.vocab_size), None

    def abort(self, request_id: str) -> None:
        if request_id in self._requests:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; the outputs of every request that progressed or finished. Raises
        WorkerFailure, naming the worker, when a tensor-parallel rank died or stopped answering."""
        self._check_open()
        if self._workers is None:
            return self._step()
        try:
            return self._step()
        except WorkerFailure as exc:
            raise self._workers.failure(exc) from exc

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group (nothing to do at tp_size 1)."""
        if self._workers is None:
            return
        workers, self._workers = self._workers, None
        try:
            send_header(Command.STOP)
        except WorkerFailure:
            logger.warning("a tensor-parallel worker was already gone at shutdown")
        workers.join(self.config.parallel.dist_timeout_s)
        shutdown_tp()

    def close(self) -> None:
        """Release what the engine holds on its device, even while something still references the
        engine: decode graphs, KV cache, adapter slots and host cache, model weights (moved to the meta
        device); stop the tensor-parallel workers. Idempotent; the engine takes no work afterwards.
        ``with Engine(...) as engine:`` closes it on leaving the block."""
        if self._closed:
            return
        self._closed = True
        if self._inflight is not None:  # its kernels read the memory freed below
            self._inflight.read()
            self._inflight = None
        self.shutdown()
        self._requests.clear()
        self.runner.close()
        self.lora.close()
        self.kv_cache.close()
        self.model.to("meta")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed (Engine.close): build a new one")

    def _step(self) -> list[RequestOutput]:
        ended = [self._requests[rid] for rid in self._aborts if rid in self._requests]
        self._aborts.clear()
        for req in ended:
            self._finish(req, "abort")
        batch, failed = self.scheduler.schedule()
        for req in failed:
            self._finish(req, "abort")
        outputs = [request_output(req) for req in ended + failed]
        if not self.overlap:
            if len(batch):
                outputs += self._run_serial(batch)
        else:
            eligible = len(batch) > 0 and overlap_eligible(batch.requests)
            prev = self._inflight
            self._inflight = (
                launch_step(self.step_guard, batch, prev.tokens if prev else None) if eligible else None
            )
            if self._inflight is not None:
                # Pages of known tokens now, so the next admissions find them (a later launch reads them).
                self.scheduler.after_forward(batch.requests)
            if prev is not None:
                outputs += self._read_back(prev)
            if len(batch) and self._inflight is None:  # not launched: step it serially, its tokens known now
                live = [k for k, req in enumerate(batch.requests) if not req.finished]
                if live:
                    part = ScheduledBatch([batch.requests[k] for k in live], [batch.num_new[k] for k in live])
                    outputs += self._run_serial(part)
            if not self._requests and self._inflight is not None:
                self._inflight.read()  # rows of finished requests only: wait for them, drop them
                self._inflight = None
        self._finish_unloads()
        return outputs

    def _run_serial(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Run ``batch``'s forward and sampling to completion and take in its tokens."""
        sampled, prompt_only, faulty = self.step_guard.run(batch)
        self.scheduler.after_forward(batch.requests)  # cache the pages the forward filled
        outputs = self._finish_prompt_only(prompt_only)
        now = time.monotonic()
        for req, token, logprobs in sampled:
            try:
                self._append_token(req, token, logprobs, now)
            except Exception as e:  # e.g. detokenizing or a grammar refusing the token: this request only
                faulty.append((req, describe_fault(e)))
                continue
            outputs.append(request_output(req))
        for req, message in faulty:
            outputs.append(self._fail(req, message))
        return outputs

    def _read_back(self, step: InFlightStep) -> list[RequestOutput]:
        """Take in an overlapped step's tokens (waiting for the device if it is still running). Rows of
        requests that finished meanwhile (an earlier token stopped them, or an abort) are dropped."""
        tokens = step.read()
        self.scheduler.after_forward(step.batch.requests)  # pages whose last token was pending at launch
        outputs = self._finish_prompt_only([r for r in step.prompt_only if not r.finished])
        now = time.monotonic()
        for k, req in enumerate(step.requests):
            if req.finished:
                continue
            req.pending.pop(0)
            token = tokens[k]
            if token < 0:
                outputs.append(self._fail(req, bad_row_message(token, req)))
                continue
            try:
                self._append_token(req, token, step.logprobs[k], now)
            except Exception as e:  # as in _run_serial: this request only
                outputs.append(self._fail(req, describe_fault(e)))
                continue
            outputs.append(request_output(req))
        return outputs

    def _finish_prompt_only(self, requests: list[Request]) -> list[RequestOutput]:
        """max_new_tokens=0: prompt logprobs only, done once the prompt ran."""
        for req in requests:
            self.counters["prompt_tokens_total"] += len(req.prompt_ids)
            self._finish(req, "length")
        return [request_output(req) for req in requests]

    def _fail(self, req: Request, message: str) -> RequestOutput:
        req.error, req.finish_reason = message, "abort"
        self._finish(req, "abort")
        return request_output(req)

    def _append_token(self, req: Request, token: int, logprobs: torch.Tensor, now: float) -> None:
        if req.first_token_time is None:
            self.counters["prompt_tokens_total"] += len(req.prompt_ids)
        self.counters["generation_tokens_total"] += 1
        append_token(req, token, logprobs, now, self.eos_ids, self.max_model_len, self._decode_ids)
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason)

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is not Status.FINISHED:
            req.finish_reason = req.finish_reason or reason
            req.status = Status.FINISHED
            req.finish_time = time.monotonic()
            self.scheduler.remove(req)
            if req.lora is not None:
                self.lora.release(req.lora)
            self._requests.pop(req.rid, None)
            self.counters["requests_finished_total"] += 1

    def stats(self) -> dict[str, Any]:
        sched, alloc = self.scheduler, self.kv_cache.allocator
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_cache_usage": alloc.usage,
            "kv_tokens_total": alloc.num_blocks * alloc.block_size,
            "running_loras": sorted({r.lora_name for r in sched.running if r.lora is not None}),
            "waiting_loras": sorted({r.lora_name for r in sched.waiting if r.lora is not None}),
            "max_loras": self.lora.num_slots,
            "slots_used": self.lora.slots_used,
            "lora_slot_loads_total": self.lora.slot_loads,
            # What lora_stage_slots (auto by default) gave: stage positions, 0 without a stage.
            "lora_stage_positions": self.lora.stage.capacity if self.lora.stage is not None else 0,
            "num_preemptions_total": sched.num_preemptions,
            "prefill_tokens_computed_total": sched.num_prefill_tokens,
            "clients": sched.client_stats(),
            **sched.prefix_cache.stats(),
            **self.counters,
        }

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run or wait, whose pages it may hold."""
        if self._requests:
            return False
        self.scheduler.prefix_cache.flush()
        return True

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the model {self.model_name!r} has no chat template")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
