"""One side of the H8 two-process tests, run in the sandbox env (real torch, real Mooncake over TCP
or real NIXL over UCX, DRAM, on 127.0.0.1).

    peer.py BACKEND decode  PLAN   allocate, print where to write, wait a line, print the checks
    peer.py BACKEND prefill PLAN   read decode's line, stamp, move the tag rows, print the rc

BACKEND is mooncake or nixl. PLAN (JSON): {"pages": N, "requests": [{"room", "dst", "src",
"sent"}]}; "sent" lists the indices into dst/src that the transfer carries (the rest are lost).
The decode side (allocate, check) is the same for both; only how the rows move differs. NIXL runs
the runtime's own adapters (`page_tags_nixl.register`, `send_tags`) on a manager that holds just
what they read.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys
import types
import uuid

from sglang_hardened.runtime.page_tags import DecodePageTags, TagBuffer


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

    from sglang_hardened.runtime import page_tags_nixl

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))
    kv_args = types.SimpleNamespace(kv_item_lens=[16], kv_data_lens=[16 * PLAN["pages"]], gpu_id=0)
    manager = types.SimpleNamespace(kv_args=kv_args, agent=agent, decode_kv_args_table={},
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
        tags = DecodePageTags(PLAN["pages"])
        engine = mooncake_engine(tags.buffer)
        where = {"session": f"127.0.0.1:{engine.get_rpc_port()}"}
    tags.fail_closed = False
    epochs = {r["room"]: tags.allocate(r["room"], r["dst"]) for r in PLAN["requests"]}
    print(json.dumps(where | {"ptr": tags.buffer.buf_info()[0], "epochs": epochs}), file=OUT, flush=True)
    sys.stdin.readline()  # prefill is done
    verdicts = [tags.check(r["room"], r["dst"]) for r in PLAN["requests"]]
    rows = {r["room"]: tags.buffer.rows[r["dst"]].tolist() for r in PLAN["requests"]}
    print(json.dumps({"verdicts": verdicts, "rows": rows}), file=OUT, flush=True)


@dataclasses.dataclass
class Chunk:
    """The one field of SGLang's TransferKVChunk that the seam reads."""

    prefill_kv_indices: list[int]


def prefill(backend: str) -> None:
    decode_side = json.loads(sys.stdin.readline())
    if backend == "nixl":
        from sglang_hardened.runtime import page_tags_nixl

        manager = nixl_manager("prefill")
        peer = manager.agent.add_remote_agent(base64.b64decode(decode_side["metadata"]))
        manager.decode_kv_args_table[peer] = types.SimpleNamespace(hardened_h8=decode_side["ptr"], gpu_id=0)
        handles: list = []
        for i, r in enumerate(PLAN["requests"]):  # the first waited for (0.5.19-0.5.22), the rest joined
            req = types.SimpleNamespace(room=r["room"], agent_name=peer,
                                        hardened_h8=decode_side["epochs"][str(r["room"])])
            chunk = Chunk([r["src"][j] for j in r["sent"]])
            page_tags_nixl.send_tags(manager, chunk, req, [r["dst"][j] for j in r["sent"]],
                                     handles if i else None)
        while any((state := manager.agent.check_xfer_state(h)) != "DONE" for h in handles):
            assert state != "ERR"
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
    OUT = os.fdopen(os.dup(1), "w")  # the protocol's lines; the libraries' own chatter goes to stderr
    os.dup2(2, 1)
    PLAN = json.loads(sys.argv[3])
    {"decode": decode, "prefill": prefill}[sys.argv[2]](sys.argv[1])
