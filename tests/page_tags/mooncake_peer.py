"""One side of the H8 Mooncake test, run in the sandbox env (real torch + Mooncake, TCP on 127.0.0.1).

    mooncake_peer.py decode  PLAN   allocate, print where to write, wait a line, print the checks
    mooncake_peer.py prefill PLAN   read decode's line, stamp, move the tag rows, print the rc

PLAN (JSON): {"pages": N, "requests": [{"room", "dst", "src", "sent"}]}; "sent" lists
the indices into dst/src that the transfer carries (the rest are lost).
"""

from __future__ import annotations

import json
import sys

from mooncake.engine import TransferEngine

from sglang_hardened.runtime.page_tags import DecodePageTags, TagBuffer


def engine_with(buffer: TagBuffer) -> tuple[TransferEngine, int, int]:
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    ptr, nbytes, item_len = buffer.buf_info()
    if engine.register_memory(ptr, nbytes) != 0:
        raise SystemExit("mooncake: register_memory failed")
    return engine, ptr, item_len


def decode(plan: dict) -> None:
    tags = DecodePageTags(plan["pages"], fail_closed=False)
    engine, ptr, _ = engine_with(tags.buffer)
    epochs = {r["room"]: tags.allocate(r["room"], r["dst"]) for r in plan["requests"]}
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "ptr": ptr, "epochs": epochs}), flush=True)
    sys.stdin.readline()  # prefill is done
    verdicts = tags.check_many([(r["room"], r["dst"]) for r in plan["requests"]])
    rows = {r["room"]: tags.buffer.rows[r["dst"]].tolist() for r in plan["requests"]}
    print(json.dumps({"verdicts": verdicts, "rows": rows}), flush=True)


def prefill(plan: dict) -> None:
    decode_side = json.loads(sys.stdin.readline())
    buffer = TagBuffer(plan["pages"])
    engine, ptr, item_len = engine_with(buffer)
    src, dst = [], []
    for r in plan["requests"]:
        buffer.stamp(r["src"], r["room"], decode_side["epochs"][str(r["room"])])
        src += [ptr + r["src"][i] * item_len for i in r["sent"]]
        dst += [decode_side["ptr"] + r["dst"][i] * item_len for i in r["sent"]]
    rc = engine.batch_transfer_sync_write(decode_side["session"], src, dst, [item_len] * len(src))
    print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    {"decode": decode, "prefill": prefill}[sys.argv[1]](json.loads(sys.argv[2]))
