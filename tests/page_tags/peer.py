"""One side of the H8 two-process tests, run in the sandbox env (real torch, real Mooncake over TCP
or real NIXL over UCX, DRAM, on 127.0.0.1).

    peer.py BACKEND decode  PLAN   allocate, print where to write, wait a line, print the checks
    peer.py BACKEND prefill PLAN   read decode's line, stamp, move the tag rows, print the rc

BACKEND is mooncake or nixl. PLAN (JSON): {"pages": N, "requests": [{"room", "dst", "src",
"sent"}], "race"}; "sent" lists the indices into dst/src that the transfer carries (the
rest are lost). The decode side (allocate, check) is the same for both; only how the rows move
differs. NIXL runs the runtime's own adapters (`page_tags.nixl.register`, `send_tags`) on a
manager that holds just what they read.

With "race", prefill sends two requests through the runtime's own seams
(`page_tags.seams.register`, `before_send`, `tag_layer` for Mooncake;
`page_tags.nixl.send_tags` for NIXL) so that the second stamp lands between the first one's
stamp and its write: the interleavings two requests that share cached prefix pages can meet.
"workers": from two threads, as two transfer workers serving two decode ranks do; "queued"
(NIXL): from one worker, the first write still queued (`race_queued`).

With "heads" (Mooncake), decode's rows hold that many head slots and prefill runs one rank per
head, as upstream's head-sliced sender between unequal TP sizes does (prefill TP = heads, decode
TP 1): each rank stamps and moves its own head's slot (`before_send`, `slice_tags`), and a
request's "sent" lists what each rank's transfer carries (`sliced`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys
import threading
import types
import uuid

from sglang_hardened.runtime.page_tags.rows import DecodePageTags, TagBuffer


def mooncake_engine(buffer: TagBuffer):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    ptr, nbytes, _ = buffer.buf_info()
    if engine.register_memory(ptr, nbytes) != 0:
        raise SystemExit("mooncake: register_memory failed")
    return engine


def nixl_manager(role: str):
    """A NIXL agent (UCX) with the runtime's tag buffer registered, as `NixlKVManager` has it."""
    from nixl._api import nixl_agent, nixl_agent_config

    from sglang_hardened.runtime.page_tags import nixl as page_tags_nixl

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))
    kv_args = types.SimpleNamespace(kv_item_lens=[16], kv_data_lens=[16 * PLAN["pages"]], gpu_id=0, total_kv_head_num=1)
    manager = types.SimpleNamespace(kv_args=kv_args, agent=agent, is_mla_backend=False, attn_tp_size=1, decode_kv_args_table={},
                                    disaggregation_mode=types.SimpleNamespace(value=role))
    page_tags_nixl.register(manager)
    return manager


def decode(backend: str) -> None:
    if backend == "nixl":
        manager = nixl_manager("decode")
        tags = manager.hardened_tags
        where = {"metadata": base64.b64encode(manager.agent.get_agent_metadata()).decode(),
                 "agent": manager.agent.name}
    else:
        tags = DecodePageTags(PLAN["pages"], heads=PLAN.get("heads", 1))
        engine = mooncake_engine(tags.buffer)
        where = {"session": f"127.0.0.1:{engine.get_rpc_port()}"}
    tags.fail_closed = False
    epochs = {r["room"]: tags.allocate(r["room"], r["dst"]) for r in PLAN["requests"]}
    ptr, _, row = tags.buffer.buf_info()
    print(json.dumps(where | {"ptr": ptr, "row": row, "epochs": epochs}), file=OUT, flush=True)
    sys.stdin.readline()  # prefill is done
    verdicts = [tags.check(r["room"], r["dst"]) for r in PLAN["requests"]]
    rows = {r["room"]: tags.buffer.rows[r["dst"]].tolist() for r in PLAN["requests"]}
    print(json.dumps({"verdicts": verdicts, "rows": rows}), file=OUT, flush=True)


@dataclasses.dataclass
class Chunk:
    """The one field of SGLang's TransferKVChunk that the seam reads."""

    prefill_kv_indices: list[int]


def mooncake_manager(decode_side: dict):
    """A Mooncake engine with the runtime's tag buffer registered by its own seam, as
    `MooncakeKVManager` has it, and decode's tag rows as its one registered session."""
    from mooncake.engine import TransferEngine

    from sglang_hardened.runtime.page_tags import seams as page_tags_seams

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    kv_args = types.SimpleNamespace(kv_item_lens=[16], kv_data_lens=[16 * PLAN["pages"]], gpu_id=0,
                                    kv_data_ptrs=[0], total_kv_head_num=1)
    manager = types.SimpleNamespace(kv_args=kv_args, raw=engine, disaggregation_mode=types.SimpleNamespace(value="prefill"),
                                    is_mla_backend=False, attn_tp_size=1,
                                    engine=types.SimpleNamespace(batch_register=engine.batch_register_memory,
                                                                 batch_transfer_sync=engine.batch_transfer_sync_write),
                                    decode_kv_args_table={decode_side["session"]: types.SimpleNamespace(
                                        hardened_h8=decode_side["ptr"], hardened_h8_row=decode_side["row"])})
    page_tags_seams.register(manager)
    return manager


def nixl_prefill(decode_side: dict):
    """Prefill's NIXL manager with decode's agent added: (manager, decode's agent name)."""
    manager = nixl_manager("prefill")
    peer = manager.agent.add_remote_agent(base64.b64decode(decode_side["metadata"]))
    manager.decode_kv_args_table[peer] = types.SimpleNamespace(hardened_h8=decode_side["ptr"],
                                                               hardened_h8_row=decode_side["row"], gpu_id=0)
    return manager, peer


def sends(decode_side: dict, session: str) -> list[tuple]:
    """The seams' (chunk, req, decode pages) for each request of the plan."""
    return [(Chunk([r["src"][j] for j in r["sent"]]),
             types.SimpleNamespace(room=r["room"], agent_name=session, hardened_h8=decode_side["epochs"][str(r["room"])]),
             [r["dst"][j] for j in r["sent"]]) for r in PLAN["requests"]]


def wait_done(agent, handles: list) -> None:
    """Until every posted NIXL write is DONE; one that fails fails the peer."""
    while any((state := agent.check_xfer_state(h)) != "DONE" for h in handles):
        assert state != "ERR"


def race_workers(backend: str, decode_side: dict) -> None:
    """Two transfer workers, one request each: the second stamps its pages after the first has
    stamped and before the first one's write reads its rows."""
    from sglang_hardened.runtime.page_tags import nixl as page_tags_nixl, seams as page_tags_seams

    first_stamped, second_stamped = threading.Event(), threading.Event()
    rcs: list[int] = []

    def stamped() -> None:
        """Between a worker's stamp and its write: the first waits for the second's stamp."""
        if threading.current_thread().name == "first":
            first_stamped.set()
            second_stamped.wait(10)
        else:
            second_stamped.set()

    if backend == "nixl":
        manager, session = nixl_prefill(decode_side)
        post = manager.agent.initialize_xfer

        def initialize_xfer(*args):
            stamped()
            return post(*args)

        manager.agent.initialize_xfer = initialize_xfer

        def send(chunk, req, dst_pages) -> None:
            page_tags_nixl.send_tags(manager, chunk, req, dst_pages)  # waits for its write (0.5.19-0.5.22)
            rcs.append(0)
    else:
        manager, session = mooncake_manager(decode_side), decode_side["session"]

        def send(chunk, req, dst_pages) -> None:
            page_tags_seams.before_send(manager, chunk, req, dst_pages)
            stamped()
            (src_ptr, dst_ptr, item_len), = page_tags_seams.tag_layer(manager, session, manager.kv_args.kv_data_ptrs)
            rcs.append(manager.raw.batch_transfer_sync_write(
                session, [src_ptr + p * item_len for p in chunk.prefill_kv_indices],
                [dst_ptr + p * item_len for p in dst_pages], [item_len] * len(dst_pages)))

    first, second = (threading.Thread(target=send, args=args, name=name)
                     for args, name in zip(sends(decode_side, session), ("first", "second")))
    first.start()
    first_stamped.wait(10)
    second.start()
    first.join()
    second.join()
    print(json.dumps({"rc": max(rcs, key=abs) if len(rcs) == 2 else "a sender raised"}), file=OUT, flush=True)


def race_queued(decode_side: dict) -> None:
    """One NIXL worker as on 0.5.23: each write joins its chunk's handles and nobody waits before
    the next chunk is stamped. The first write stays queued until its state is first asked for
    (the agent's post is deferred to then: a write behind others on a busy link)."""
    from sglang_hardened.runtime.page_tags import nixl as page_tags_nixl

    manager, session = nixl_prefill(decode_side)
    agent, queued = manager.agent, set()
    post, state = agent.transfer, agent.check_xfer_state

    def transfer(handle) -> str:
        queued.add(handle)
        return "PROC"

    def check_xfer_state(handle) -> str:
        if handle in queued:
            queued.discard(handle)
            post(handle)
        return state(handle)

    agent.transfer, agent.check_xfer_state = transfer, check_xfer_state
    handles: list = []
    for chunk, req, dst_pages in sends(decode_side, session):
        page_tags_nixl.send_tags(manager, chunk, req, dst_pages, handles)
    wait_done(agent, handles)
    print(json.dumps({"rc": 0}), file=OUT, flush=True)


def sliced(decode_side: dict) -> None:
    """Prefill's ranks, one per decode head slot, each sending its head's slice of a request's
    pages through the seams upstream's head-sliced send calls (a rank's own manager and engine):
    a request's "sent" lists, per rank, the indices into dst/src that its transfer carries."""
    from concurrent.futures import ThreadPoolExecutor

    from sglang_hardened.runtime.page_tags import seams as page_tags_seams

    session, heads, rcs = decode_side["session"], PLAN["heads"], []
    with ThreadPoolExecutor(2) as executor:
        for rank in range(heads):
            manager = mooncake_manager(decode_side)
            for r in PLAN["requests"]:
                req = types.SimpleNamespace(room=r["room"], hardened_h8=decode_side["epochs"][str(r["room"])])
                page_tags_seams.before_send(manager, Chunk(r["src"]), req, r["dst"])
                src, dst = ([pages[j] for j in r["sent"][rank]] for pages in (r["src"], r["dst"]))
                futures = page_tags_seams.slice_tags(manager, executor, session, src, dst, 0, rank, 1, heads)
                rcs += [f.result() for f in futures]
    print(json.dumps({"rc": max(rcs, key=abs)}), file=OUT, flush=True)


def prefill(backend: str) -> None:
    decode_side = json.loads(sys.stdin.readline())
    if PLAN.get("heads"):
        sliced(decode_side)
        return
    if PLAN.get("race") == "workers":
        race_workers(backend, decode_side)
        return
    if PLAN.get("race") == "queued":
        race_queued(decode_side)
        return
    if backend == "nixl":
        from sglang_hardened.runtime.page_tags import nixl as page_tags_nixl

        manager, session = nixl_prefill(decode_side)
        handles: list = []
        for i, (chunk, req, dst_pages) in enumerate(sends(decode_side, session)):
            # the first waited for (0.5.19-0.5.22), the rest joined
            page_tags_nixl.send_tags(manager, chunk, req, dst_pages, handles if i else None)
        wait_done(manager.agent, handles)
        print(json.dumps({"rc": 0}), file=OUT, flush=True)
        return
    buffer = TagBuffer(PLAN["pages"])
    engine = mooncake_engine(buffer)
    ptr, _, item_len = buffer.buf_info()
    src, dst = [], []
    for r in PLAN["requests"]:
        buffer.stamp(r["src"], r["room"], decode_side["epochs"][str(r["room"])])
        src += [ptr + r["src"][i] * item_len for i in r["sent"]]
        dst += [decode_side["ptr"] + r["dst"][i] * item_len for i in r["sent"]]
    rc = engine.batch_transfer_sync_write(decode_side["session"], src, dst, [item_len] * len(src))
    print(json.dumps({"rc": rc}), file=OUT, flush=True)


if __name__ == "__main__":
    from sglang_hardened.runtime.page_tags import seams as page_tags_seams

    # upstream's transfer queue count (4), given here: reading it from sglang costs this peer 3 s
    page_tags_seams.send_lanes = lambda: 4
    OUT = os.fdopen(os.dup(1), "w")  # the protocol's lines; the libraries' own chatter goes to stderr
    os.dup2(2, 1)
    PLAN = json.loads(sys.argv[3])
    {"decode": decode, "prefill": prefill}[sys.argv[2]](sys.argv[1])
