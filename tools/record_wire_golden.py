"""Record golden KV-event payloads with each vLLM release's own code (dev tool; ``make golden-wire``).

For every release the project supports, the release's ``vllm/distributed/kv_events.py`` (fetched by
``vllm_release_files``, loaded by ``vllm_isolated``) builds a fixed set of event batches with *its own*
classes, and *its own* ``ZmqEventPublisher`` sends them over in-process ZeroMQ; the recorder keeps what a
subscriber receives (topic, seq, payload) and what a DEALER gets back from the publisher's replay ROUTER.

Each batch is described by the events as the release's objects hold them (``msgspec.structs.asdict``): that
is what the payload means, and what a decoder must get back.  Fields a release lacks are not set; hash
values are the forms the release's block pool could send (see ``hash_forms``).

Output (committed), under ``tests/fixtures/wire/``:

* ``vllm-<first release>.json`` per group of releases whose recordings are identical byte for byte (same
  classes, same publisher framing): ``releases``, ``schema``, ``batches`` (name, ts, dp_rank, hex payload,
  expected events), ``pub`` and ``replay`` frames;
* ``index.json``: release -> file, and per group what changed from the group before.

Run: ``.venv/bin/python tools/record_wire_golden.py [--check]`` (``--check``: fail if the committed
fixtures differ from a fresh recording instead of writing them).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_isolated import load_kv_events

RELEASES = (
    "0.9.0", "0.10.0", "0.10.2", "0.11.0", "0.13.0", "0.16.0", "0.20.0", "0.23.0",
    "0.24.0", "0.25.0", "0.26.0", "0.28.0", "0.30.0", "0.32.0", "0.33.0",
)  # fmt: skip
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "wire"
TOPIC = "kv@golden-pod@model"
TS0 = 1700000000.0
REPLAY_FROM = 1
"""The replay request's start seq: batches from 1 on come back (seq 0 does not), then the end marker."""

H1, H2, H3 = 0x1111, 0x2222, 0x3333
DIGEST = bytes(range(0xA0, 0xC0))  # a 32-byte sha256-sized digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)


def _is_old_hash(release: str) -> bool:
    """0.9.x and 0.10.0 (no ``ExternalBlockHash``): ``BlockHash.hash_value`` of Python's ``hash()`` by
    default, a signed 64-bit int.  From 0.10.2 on: the digest's last 8 bytes as an unsigned int, or with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` the raw digest bytes (``maybe_convert_block_hash``)."""
    return tuple(int(p) for p in release.split(".")) < (0, 10, 2)


def hash_forms(release: str) -> list[Any]:
    """Three chained block hashes in the forms the release could send (the third's parent is the second)."""
    if _is_old_hash(release):
        return [-1, -(2**63), 2**63 - 1]
    return [2**64 - 1, DIGEST, 2**63]


def _stored(**kw: Any) -> dict[str, Any]:
    """A GPU store as the KV-cache manager publishes it: group 0, labelled with its spec kind (0.23+)."""
    base: dict[str, Any] = {
        "parent_block_hash": None,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return {"type": "BlockStored", **base, **kw}


def _removed(hashes: list[Any], **kw: Any) -> dict[str, Any]:
    """A GPU eviction as the block pool sends it: one hash, ``group_idx`` = the KV-cache group (0.20+)."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0, **kw}


Plan = list[tuple[str, int | None, list[dict[str, Any]]]]


def scenario(release: str, fields: dict[str, set[str]]) -> Plan:
    """``(name, dp_rank, events)`` of each batch; a field is passed only where the release has it, and a
    batch needing a field the release lacks (offload media before 0.10.2, 0.23's group metadata) is left
    out for that release."""
    toks = list(range(1, 49))
    hashes = hash_forms(release)
    batches: Plan = [
        (
            "stored_chain",
            0,
            [
                _stored(block_hashes=[H1, H2], token_ids=toks[:32], block_size=16, extra_keys=[None, None]),
                _stored(
                    block_hashes=[H3],
                    parent_block_hash=H2,
                    token_ids=toks[32:],
                    block_size=16,
                    extra_keys=[None],
                ),
            ],
        ),
        (
            "lora_salt",
            1,
            [
                _stored(
                    block_hashes=[0x4444, 0x5555],
                    token_ids=list(range(101, 133)),
                    block_size=16,
                    lora_id=7,
                    lora_name="sql-lora",
                    extra_keys=[("sql-lora", "salt-A"), ("sql-lora",)],
                )
            ],
        ),
        ("removed", 0, [_removed([H3]), _removed([H2])]),
        ("eviction_run", 0, [_removed([0x100000000 + i]) for i in range(17)]),  # 17: an array16 header
        ("cleared", 0, [{"type": "AllBlocksCleared"}]),
        # rank left unset: what the release's publisher makes of it (0.33 fills in its own rank)
        ("publisher_rank", None, [_removed([H1])]),
        (
            "hash_forms",
            0,
            [
                _stored(block_hashes=hashes[:2], token_ids=toks[:32], block_size=16),
                _stored(
                    block_hashes=hashes[2:], parent_block_hash=hashes[1], token_ids=toks[32:], block_size=16
                ),
                _removed([hashes[0]]),
            ],
        ),
        (
            "offload",
            0,
            [
                # offload placeholders: the GPU blocks' hashes, no tokens (block_size 0 on 0.33); the values
                # are the simulator's CPU tier's, not a connector's (0.33's OffloadingConnector sends one hash
                # per event with its offload group: see the report of issue 23)
                _stored(
                    block_hashes=[H1, H2],
                    token_ids=[],
                    block_size=0 if release == "0.33.0" else 16,
                    medium="CPU",
                    group_idx=None,
                    kv_cache_spec_kind=None,
                ),
                _stored(
                    block_hashes=[H3],
                    parent_block_hash=H2,
                    token_ids=[],
                    block_size=0 if release == "0.33.0" else 16,
                    medium="STORAGE",
                    group_idx=None,
                    kv_cache_spec_kind=None,
                ),
                _removed([H1, H2], medium="CPU", group_idx=None),  # the connector's: no group
            ],
        ),
        (
            "all_fields",
            0,
            [
                _stored(
                    block_hashes=[0x6666],
                    token_ids=list(range(200, 216)),
                    block_size=16,
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=1024,
                    locality="LOCAL",
                    ownership="tier-2",
                    session_id="sess-9",
                    lookahead_token_ids=[[216, 217]],
                    extra_keys=[None],
                ),
                _removed([0x6666], group_idx=1, locality="LOCAL", ownership="tier-2"),
            ],
        ),
    ]
    needs = {"offload": "medium", "all_fields": "kv_cache_spec_kind"}
    return [b for b in batches if needs.get(b[0], "block_hashes") in fields["BlockStored"]]


def _build(mod: ModuleType, ev: dict[str, Any]) -> msgspec.Struct:
    cls = getattr(mod, ev["type"])
    have = {f.name for f in msgspec.structs.fields(cls)}
    obj: msgspec.Struct = cls(**{k: v for k, v in ev.items() if k != "type" and k in have})
    return obj


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def _describe(ev: msgspec.Struct) -> dict[str, Any]:
    tag = type(ev).__struct_config__.tag
    return {"type": tag, **{k: _jsonable(v) for k, v in msgspec.structs.asdict(ev).items()}}


def schema(mod: ModuleType) -> dict[str, Any]:
    """The release's classes as the wire sees them: fields (``*`` = has a default) and event shape."""

    def fields(cls: type) -> list[str]:
        return [
            f.name
            + (
                "*"
                if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
                else ""
            )
            for f in msgspec.structs.fields(cls)
        ]

    cfg = mod.KVCacheEvent.__struct_config__
    return {
        "batch": fields(mod.KVEventBatch),
        "event_shape": "array" if cfg.array_like else "map",
        "omit_defaults": cfg.omit_defaults,
        "BlockStored": fields(mod.BlockStored),
        "BlockRemoved": fields(mod.BlockRemoved),
        "AllBlocksCleared": fields(mod.AllBlocksCleared),
    }


def _recv(sock: zmq.Socket[bytes], what: str) -> list[bytes]:
    if not sock.poll(5000):
        raise TimeoutError(f"no {what} from the release's publisher within 5 s")
    return sock.recv_multipart()


def record(release: str) -> dict[str, Any]:
    mod = load_kv_events(release)
    fields = {
        c: {f.name for f in msgspec.structs.fields(getattr(mod, c))} for c in ("BlockStored", "KVEventBatch")
    }
    plan = scenario(release, fields)
    ctx = zmq.Context.instance()  # the publisher's own context: inproc endpoints need the same one
    tag = release.replace(".", "_")
    pub_ep, rep_ep = f"inproc://golden-pub-{tag}", f"inproc://golden-replay-{tag}"
    kwargs: dict[str, Any] = {"endpoint": pub_ep, "replay_endpoint": rep_ep, "topic": TOPIC}
    if "data_parallel_rank" in inspect.signature(mod.ZmqEventPublisher).parameters:
        kwargs["data_parallel_rank"] = 0
    publisher = mod.ZmqEventPublisher(**kwargs)
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.connect(pub_ep)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)  # the subscription must reach the PUB before the first batch
        batches: list[dict[str, Any]] = []
        sent: list[tuple[str, msgspec.Struct]] = []
        for i, (name, rank, events) in enumerate(plan):
            objs = [_build(mod, ev) for ev in events]
            kw: dict[str, Any] = {"ts": TS0 + i, "events": objs}
            if "data_parallel_rank" in fields["KVEventBatch"] and rank is not None:
                kw["data_parallel_rank"] = rank
            batch = mod.KVEventBatch(**kw)
            publisher.publish(batch)
            sent.append((name, batch))
        pub_frames = [_recv(sub, "batch") for _ in sent]
        for seq, frames in enumerate(pub_frames):
            assert frames[0] == TOPIC.encode() and int.from_bytes(frames[1], "big") == seq, frames[:2]
        decoder = msgspec.msgpack.Decoder(mod.KVEventBatch)
        for (name, batch), frames in zip(sent, pub_frames, strict=True):
            assert decoder.decode(frames[2]) == batch, f"{release} {name}: the release cannot read its bytes"
            batches.append(
                {
                    "name": name,
                    "ts": batch.ts,
                    "dp_rank": getattr(batch, "data_parallel_rank", None),
                    "payload": frames[2].hex(),
                    "events": [_describe(e) for e in batch.events],
                }
            )
        dealer.connect(rep_ep)
        dealer.send_multipart([b"", REPLAY_FROM.to_bytes(8, "big")])
        replay: list[list[str]] = []
        while True:
            frames = _recv(dealer, "replay reply")
            replay.append([f.hex() for f in frames])
            if b"\xff" * 8 in frames:
                break
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        publisher.shutdown()
    return {
        "schema": schema(mod),
        "topic": TOPIC,
        "batches": batches,
        "pub": [[f.hex() for f in frames[:2]] for frames in pub_frames],
        "replay_from": REPLAY_FROM,
        "replay": replay,
    }


def _changes(prev: dict[str, Any] | None, cur: dict[str, Any]) -> list[str]:
    """What differs on the wire from the group before (for index.json)."""
    if prev is None:
        return ["first release supported"]
    out: list[str] = []
    a, b = prev["schema"], cur["schema"]
    for key in ("batch", "BlockStored", "BlockRemoved"):
        added = [f for f in b[key] if f.rstrip("*") not in {g.rstrip("*") for g in a[key]}]
        if added:
            out.append(f"{key} gains {', '.join(added)}")
    if a["event_shape"] != b["event_shape"]:
        out.append(f"events become {b['event_shape']}s")
    if len(prev["replay"][0]) != len(cur["replay"][0]):
        out.append(f"replay frames {len(prev['replay'][0])} -> {len(cur['replay'][0])} (topic frame)")
    pa = {x["name"]: x["payload"] for x in prev["batches"]}
    if not out and any(pa.get(x["name"]) != x["payload"] for x in cur["batches"]):
        out.append("values the release's block pool can send differ (hash forms)")
    return out or ["payloads differ"]


def _dump(obj: dict[str, Any]) -> str:
    """JSON with one top-level key, one batch, one frame list per line (small diffs, readable)."""
    lines = []
    for k, v in obj.items():
        if isinstance(v, list) and v and isinstance(v[0], dict | list):
            inner = ",\n  ".join(json.dumps(x) for x in v)
            lines.append(f' "{k}": [\n  {inner}\n ]')
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def render() -> dict[str, str]:
    """File name -> JSON text of every fixture."""
    groups: list[tuple[list[str], dict[str, Any]]] = []
    for release in RELEASES:
        rec = record(release)
        if groups and groups[-1][1] == rec:
            groups[-1][0].append(release)
        else:
            groups.append(([release], rec))
    files: dict[str, str] = {}
    index: dict[str, Any] = {"releases": {}, "groups": []}
    prev = None
    for releases, rec in groups:
        name = f"vllm-{releases[0]}.json"
        files[name] = _dump({"releases": releases, **rec})
        for r in releases:
            index["releases"][r] = name
        index["groups"].append({"file": name, "releases": releases, "changes": _changes(prev, rec)})
        prev = rec
    files["index.json"] = json.dumps(index, indent=1) + "\n"  # small: plain indented JSON
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed fixtures, write nothing")
    args = ap.parse_args()
    files = render()
    if args.check:
        stale = [n for n, text in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        extra = sorted({p.name for p in OUT.glob("*.json")} - set(files))
        if stale or extra:
            print(f"golden wire fixtures out of date: {stale + extra}", file=sys.stderr)
            return 1
        print(f"{len(files)} golden wire fixtures match a fresh recording")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.json"):
        if old.name not in files:
            old.unlink()
    for n, text in files.items():
        (OUT / n).write_text(text)
    print(f"wrote {len(files)} files to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
