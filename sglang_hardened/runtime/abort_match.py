"""H15: an abort names one request (and its numbered samples), not every rid it prefixes.

SGLang's scheduler ends every queued and running request whose rid *starts with* the rid an
abort names (`req.rid.startswith(recv_req.rid)`, at each queue in `Scheduler.abort_request`
and the grammar queue), so that aborting a batch's rid reaches its `<rid>_<i>` members. A
client may choose its rid, and a client that hangs up aborts its own rid: a tenant that sends
requests with the rids "0" to "f" through a gateway that passes rids on (mini-lb and smg do)
and hangs up ends every other tenant's request in flight, whose server-made rids are uuid4
hex. Here an abort reaches the rid it names and that rid's numbered members only.

Only what a rid says changes: `abort_all`, and the rids SGLang makes itself (uuid4 hex, or a
client's rid with `_<i>` for a batch), are matched as before.
"""

from __future__ import annotations


def aborts(rid: str, named: str) -> bool:
    """Whether an abort naming ``named`` ends the request ``rid``: the same rid, or a member
    ``named_<i>`` SGLang made of it for a batch or for parallel samples."""
    if rid == named:
        return True
    member = rid.removeprefix(named + "_")
    return member != rid and member.isdigit()
