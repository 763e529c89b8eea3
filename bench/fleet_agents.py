"""A fleet of node agents as the restarter's intake meets them, for bench/fleet_scale.py: one TLS
channel per node (its own connection: no subchannel shared between channels), each sending with
the token bound to its node's agent pod, as the agent's sender does: the same reconnect backoff,
a failed call sent again after the sender's backoff (0.5 s doubling to 5 s, with its jitter), a
"retry later" answer after 1 s, until the intake answers ACCEPTED, DUPLICATE or REFUSED.

Runs as its own process, so that its CPU is neither the restarter's nor the bench's, driven by
JSON lines on stdin, answering with JSON lines on stdout (times are CLOCK_MONOTONIC, which every
process on the machine shares):

  {"op": "open", "address", "ca", "server_name", "tokens": {node: token}}
        → {"op": "opened", "channels", "ready", "seconds"}
  {"op": "send", "batch", "faults": [{"id", "node", "namespace", "pod", "uid", "at"}]}
        each fault is sent `at` seconds after the command arrives
        → one {"op": "answer", "batch", "id", "sent", "answered", "verdict", "attempts",
               "call_ms"} per fault (`call_ms`: the answering call's own time), then
          {"op": "sent", "batch"}
  {"op": "stats"} → {"op": "stats", "rss", "fds", "threads"}
  {"op": "close"} → the process ends
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edl_agent._proto.edl.fault.v1 import fault_pb2, fault_pb2_grpc  # noqa: E402
from edl_agent.faults.sender import SenderSettings  # noqa: E402
from edl_agent.runtime.backoff import backoff_delay  # noqa: E402

FINAL = {fault_pb2.VERDICT_ACCEPTED, fault_pb2.VERDICT_DUPLICATE, fault_pb2.VERDICT_REFUSED}
SENDER = SenderSettings("", Path())  # the agent sender's defaults: its backoff and retry_later
GIVE_UP_SECONDS = 900.0  # the agent never gives up (its outbox keeps a fault until answered)
CALL_TIMEOUT = 10.0


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Fleet:
    def __init__(self) -> None:
        self.channels: dict[str, Any] = {}
        self.stubs: dict[str, Any] = {}
        self.tokens: dict[str, str] = {}

    async def open(self, command: dict[str, Any]) -> None:
        started = time.monotonic()
        credentials = grpc.ssl_channel_credentials(Path(command["ca"]).read_bytes())
        options = [
            ("grpc.use_local_subchannel_pool", 1),  # a connection of its own, as on its node
            ("grpc.ssl_target_name_override", command["server_name"]),
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.min_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.tokens = dict(command["tokens"])
        for node in self.tokens:
            channel = grpc.aio.secure_channel(command["address"], credentials, options=options)
            self.channels[node] = channel
            self.stubs[node] = fault_pb2_grpc.FaultIntakeStub(channel)  # type: ignore[no-untyped-call]
        ready = 0
        # Connected a few hundred at a time: the server's TLS handshakes are what they cost.
        nodes = list(self.channels)
        for first in range(0, len(nodes), 250):
            waits = [
                asyncio.wait_for(self.channels[n].channel_ready(), 60)
                for n in nodes[first : first + 250]
            ]
            results = await asyncio.gather(*waits, return_exceptions=True)
            ready += sum(1 for r in results if not isinstance(r, BaseException))
        emit(
            {
                "op": "opened",
                "channels": len(self.channels),
                "ready": ready,
                "seconds": time.monotonic() - started,
            }
        )

    async def send(self, command: dict[str, Any]) -> None:
        began = time.monotonic()
        batch = command["batch"]
        tasks = [asyncio.create_task(self._deliver(batch, f, began)) for f in command["faults"]]
        await asyncio.gather(*tasks)
        emit({"op": "sent", "batch": batch})

    async def _deliver(self, batch: str, fault: dict[str, Any], began: float) -> None:
        await asyncio.sleep(max(0.0, began + float(fault["at"]) - time.monotonic()))
        node = fault["node"]
        message = fault_pb2.Fault(
            id=fault["id"],
            kind=fault_pb2.FAULT_KIND_DEVICE_UNHEALTHY,
            node=node,
            pods=[
                fault_pb2.PodRef(namespace=fault["namespace"], name=fault["pod"], uid=fault["uid"])
            ],
            reason="XID79",
            device_ids=[f"GPU-{fault['pod']}"],
            detail="GPU has fallen off the bus",
            source="agent",
        )
        message.observed_at.GetCurrentTime()
        request = fault_pb2.ReportRequest(faults=[message])
        metadata = (("authorization", f"Bearer {self.tokens[node]}"),)
        sent = time.monotonic()
        attempts = 0
        verdict = ""
        call_ms = 0.0
        failures = 0
        while time.monotonic() - sent < GIVE_UP_SECONDS:
            attempts += 1
            request.sent_at.GetCurrentTime()
            called = time.monotonic()
            try:
                response = await self.stubs[node].Report(
                    request, metadata=metadata, timeout=CALL_TIMEOUT
                )
            except grpc.aio.AioRpcError:
                failures += 1
                delay = backoff_delay(
                    failures,
                    initial=SENDER.backoff_initial,
                    maximum=SENDER.backoff_max,
                    jitter=random.random(),  # noqa: S311 - spreading retries, not secrets
                )
                await asyncio.sleep(delay)
                continue
            failures = 0
            call_ms = (time.monotonic() - called) * 1000
            ack = next((a for a in response.acks if a.fault_id == message.id), None)
            if ack is not None and ack.verdict in FINAL:
                verdict = fault_pb2.Verdict.Name(ack.verdict).removeprefix("VERDICT_")
                if ack.verdict == fault_pb2.VERDICT_REFUSED:
                    verdict += f":{ack.reason}"
                break
            await asyncio.sleep(SENDER.retry_later)
        emit(
            {
                "op": "answer",
                "batch": batch,
                "id": message.id,
                "sent": sent,
                "answered": time.monotonic(),
                "verdict": verdict,
                "attempts": attempts,
                "call_ms": call_ms,
            }
        )

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels.values()))


async def main() -> None:
    fleet = Fleet()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 28)  # the open command carries every token
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    pending: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        command = json.loads(line)
        op = command["op"]
        if op == "open":
            await fleet.open(command)
        elif op == "send":
            task = asyncio.create_task(fleet.send(command))
            pending.add(task)
            task.add_done_callback(pending.discard)
        elif op == "stats":
            me = psutil.Process()
            emit(
                {
                    "op": "stats",
                    "rss": me.memory_info().rss,
                    "fds": me.num_fds(),
                    "threads": me.num_threads(),
                }
            )
        elif op == "close":
            break
    for task in pending:
        task.cancel()
    await fleet.close()


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    asyncio.run(main())
