"""Time vLLM's own per-request front-end work in process (run by ``tools/frontend_costs.py``, not by hand).

Runs inside a virtualenv that has vLLM installed (``VLLM_TARGET_DEVICE=cpu``; no GPU, no engine): it builds
the render server's state (``init_render_app_state``, exactly what ``vllm launch render`` serves from) on
the model directory it is given and times, per prompt length, the pieces every ``vllm serve`` request
pays around its engine step:

- ``parse``: the OpenAI body validated into vLLM's request model (what FastAPI does before the handler);
- ``render``: ``OnlineRenderer.render_chat`` / ``render_completion`` (chat template + tokenization on the
  renderer's single worker thread, the call ``OpenAIServingChat`` and ``OpenAIServingCompletion`` make);
- ``parse_ids`` / ``render_ids``: the same prompt sent as token ids (validated, not tokenized);
- ``tokenize``: the tokenizer's ``encode`` alone (to split render from tokenization);
- ``to_core``: ``InputProcessor.process_inputs`` + msgpack encode (API server) + msgpack decode +
  ``Request`` creation with the prefix-cache block hasher (engine core input thread);
- ``ipc``: one-way ZeroMQ hop of the encoded request between two processes (ROUTER/DEALER over ipc://,
  the sockets ``vllm serve`` uses), and of a one-token output (PUSH/PULL);
- ``output_*``: ``OutputProcessor.add_request`` (the detokenizer primed with the prompt), then the first
  and the second token's output decoded from msgpack and processed (detokenization, ``RequestOutput``).

Reads a JSON job on stdin (``model``, ``max_model_len``, ``prompts``: ``{label: {"chat": body, "completion":
body}}``, ``runs``) and prints one JSON object: per label and piece, wall and CPU seconds of every run.
CPU time (``time.process_time``, all threads) is what a core that is not shared would take; wall time
includes waiting for a core on a busy machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

Sample = dict[str, list[float]]


def _sample(wall: list[float], cpu: list[float]) -> Sample:
    return {"wall_s": wall, "cpu_s": cpu}


async def _timed_async(fn: Callable[[], Awaitable[Any]], runs: int) -> tuple[Sample, Any]:
    wall, cpu, out = [], [], None
    await fn()  # warm-up (first call compiles the template, fills caches)
    for _ in range(runs):
        c0, t0 = time.process_time(), time.perf_counter()
        out = await fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return _sample(wall, cpu), out


def _timed(fn: Callable[[], Any], runs: int) -> tuple[Sample, Any]:
    wall, cpu, out = [], [], None
    fn()
    for _ in range(runs):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return _sample(wall, cpu), out


# ------------------------------------------------------------------------------------------ ZeroMQ hop
def _echo(input_path: str, output_path: str, identity: bytes, reply: list[bytes]) -> None:
    """The engine side: a DEALER receiving requests, a PUSH answering each with ``reply`` (an output)."""
    import zmq
    from vllm.utils.network_utils import make_zmq_socket

    ctx = zmq.Context()
    inp = make_zmq_socket(ctx, input_path, zmq.DEALER, identity=identity, bind=False)
    out = make_zmq_socket(ctx, output_path, zmq.PUSH, bind=False)
    inp.send(b"ready")
    while True:
        frames = inp.recv_multipart(copy=False)
        if bytes(frames[0].buffer) == b"stop":
            break
        out.send_multipart(reply)
    ctx.destroy(linger=0)


def ipc_hop(payloads: dict[str, list[Any]], reply: list[bytes], runs: int) -> dict[str, Sample]:
    """ZeroMQ between two processes, as ``vllm serve`` wires its API server and engine core (ROUTER to
    DEALER for requests, PUSH to PULL for outputs, ipc:// sockets).  Each trip sends a payload and gets
    ``reply`` (a one-token output) back.  ``output_one_way``: half the round trip of a one-token request;
    per payload: its round trip minus that half (the request's own one-way time)."""
    import zmq
    from vllm.utils.network_utils import make_zmq_socket

    tmp = tempfile.mkdtemp(prefix="vllm-ipc-")
    inp_path, out_path = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx = zmq.Context()
    router = make_zmq_socket(ctx, inp_path, zmq.ROUTER, bind=True)
    pull = make_zmq_socket(ctx, out_path, zmq.PULL, bind=True)
    identity = b"\x00\x00"
    proc = mp.get_context("spawn").Process(
        target=_echo, args=(inp_path, out_path, identity, reply), daemon=True
    )
    proc.start()
    router.recv_multipart()  # the engine side is connected

    def trips(frames: list[Any]) -> list[float]:
        out = []
        for i in range(runs + 3):
            t0 = time.perf_counter()
            router.send_multipart([identity, b"\x00", *frames], copy=False)
            pull.recv_multipart(copy=False)
            if i >= 3:  # the first trips warm the sockets
                out.append(time.perf_counter() - t0)
        return out

    small = trips(reply)
    half = sorted(small)[len(small) // 2] / 2
    out: dict[str, Sample] = {"output_one_way": {"wall_s": [t / 2 for t in small], "cpu_s": []}}
    for label, frames in payloads.items():
        out[label] = {"wall_s": [t - half for t in trips(frames)], "cpu_s": []}
    router.send_multipart([identity, b"stop"])
    proc.join(10)
    ctx.destroy(linger=0)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ the probe
class Probe:
    """vLLM's serving objects, built as the render server builds them, and the timing of one prompt."""

    def __init__(self, state: Any, vllm_config: Any, runs: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.runs = runs
        self.online = state.online_renderer
        self.tokenizer = self.online.renderer.get_tokenizer()
        self.processor = InputProcessor(vllm_config, self.online.renderer)
        cache = vllm_config.cache_config
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(cache.block_size or 16, hash_fn)
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
        self.out_encoder, self.out_decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
        self.counter = iter(range(10**9))

    def core_request(self, engine_input: Any) -> Any:
        """``InputProcessor.process_inputs`` and the id assignment ``AsyncLLM.add_request`` does next."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=16, output_kind=RequestOutputKind.DELTA)
        req = self.processor.process_inputs(f"r{next(self.counter)}", engine_input, params, ("generate",))
        self.processor.assign_request_id(req)
        return req

    def outputs(self, engine_input: Any, tokens: tuple[int, int]) -> list[float]:
        """Wall and CPU seconds of: ``OutputProcessor.add_request`` (its detokenizer primed with the
        prompt), then the first and the second token's output decoded from msgpack and processed."""
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

        op = OutputProcessor(self.tokenizer, log_stats=False)
        req = self.core_request(engine_input)
        collector = RequestOutputCollector(RequestOutputKind.DELTA, req.request_id)
        marks = [(time.perf_counter(), time.process_time())]
        op.add_request(req, None, None, 0, collector)
        marks.append((time.perf_counter(), time.process_time()))
        for token in tokens:
            outs = EngineCoreOutputs(outputs=[EngineCoreOutput(req.request_id, [token])])
            op.process_outputs(self.out_decoder.decode(self.out_encoder.encode(outs)).outputs)
            collector.output = None  # the handler took it
            marks.append((time.perf_counter(), time.process_time()))
        return [d for a, b in itertools.pairwise(marks) for d in (b[0] - a[0], b[1] - a[1])]

    async def length(self, bodies: dict[str, Any]) -> tuple[dict[str, Any], list[bytes], list[int]]:
        """Every piece for one prompt: (samples per piece, the encoded request, the prompt's ids)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.v1.request import Request

        runs, online = self.runs, self.online
        row: dict[str, Any] = {}
        raw_chat = json.dumps(bodies["chat"])
        raw_cmpl = json.dumps(bodies["completion"])
        row["parse_chat"], chat_req = _timed(
            lambda: ChatCompletionRequest.model_validate_json(raw_chat), runs
        )
        row["parse_completion"], cmpl_req = _timed(
            lambda: CompletionRequest.model_validate_json(raw_cmpl), runs
        )
        row["render_chat"], chat_out = await _timed_async(lambda: online.render_chat(chat_req), runs)
        row["render_completion"], cmpl_out = await _timed_async(
            lambda: online.render_completion(cmpl_req), runs
        )
        engine_input = cmpl_out[0]
        ids = list(engine_input["prompt_token_ids"])
        # The same prompt sent as token ids (no tokenization: validation of the id list only).
        raw_ids = json.dumps({**bodies["completion"], "prompt": ids})
        row["parse_ids"], ids_req = _timed(lambda: CompletionRequest.model_validate_json(raw_ids), runs)
        row["render_ids"], _ = await _timed_async(lambda: online.render_completion(ids_req), runs)
        row["prompt_tokens_completion"] = len(ids)
        row["prompt_tokens_chat"] = len(chat_out[1][0]["prompt_token_ids"])
        text = bodies["completion"]["prompt"]
        row["tokenize"], _ = _timed(lambda: self.tokenizer.encode(text), runs)
        row["process_inputs"], core_req = _timed(lambda: self.core_request(engine_input), runs)
        row["encode"], frames = _timed(lambda: self.encoder.encode(core_req), runs)
        row["decode"], decoded = _timed(lambda: self.decoder.decode(frames), runs)
        row["request_and_hashes"], _ = _timed(
            lambda: Request.from_engine_core_request(decoded, self.hasher), runs
        )
        last_two = (ids[-1], ids[-2])
        self.outputs(engine_input, last_two)  # warm-up
        fo = [self.outputs(engine_input, last_two) for _ in range(runs)]
        for i, name in enumerate(("output_add_request", "output_first_token", "output_next_token")):
            row[name] = _sample([f[2 * i] for f in fo], [f[2 * i + 1] for f in fo])
        return row, [bytes(f) for f in frames], ids


async def probe(job: dict[str, Any]) -> dict[str, Any]:
    from starlette.datastructures import State
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    # The render server's start-up (vllm/entrypoints/launchers/render/entry.py), without its HTTP server.
    argv = ["--model", job["model"], "--max-model-len", str(job["max_model_len"])]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None
    envs.VLLM_CPU_KVCACHE_SPACE = 0
    vllm_config = VllmConfig(
        model_config=model_config,
        structured_outputs_config=engine_args.create_structured_outputs_config(),
    )
    state = State()
    await init_render_app_state(vllm_config, state, args)
    p = Probe(state, vllm_config, int(job["runs"]))

    results: dict[str, Any] = {
        "vllm_config": {
            "prefix_caching_hash_algo": vllm_config.cache_config.prefix_caching_hash_algo,
            "block_size": vllm_config.cache_config.block_size,
            "renderer_num_workers": model_config.renderer_num_workers,
            "tokenizer": type(p.tokenizer).__name__,
        },
        "lengths": {},
    }
    payloads: dict[str, list[bytes]] = {}
    ids: list[int] = []
    for label, bodies in job["prompts"].items():
        results["lengths"][label], payloads[label], ids = await p.length(bodies)
        print(f"probe: {label} done", file=sys.stderr, flush=True)

    one_token = EngineCoreOutputs(outputs=[EngineCoreOutput("r0", [ids[-1]])])
    results["ipc"] = ipc_hop(payloads, [bytes(f) for f in p.out_encoder.encode(one_token)], max(p.runs, 20))
    return results


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    job = json.load(sys.stdin)
    results = asyncio.run(probe(job))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
