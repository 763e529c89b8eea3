"""A stand-in for kubelet's pod-resources server: `v1.PodResourcesLister` on a real unix socket,
answering `List` with whatever assignments the test sets (or failing, or hanging, when told to).

Attribution through the real pod-resources API is proven against a real kubelet (tests/cluster,
marker `kubelet`). This stand-in stays for tests without root or a control plane and for a
kubelet that misbehaves on purpose: one that fails List, or lists devices no pod could hold."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from edl_agent._proto.podresources.v1 import api_pb2, api_pb2_grpc
from tests.unix_grpc import UnixGrpcServer

# (namespace, pod) → container → resource → device ids, as kubelet would assign them.
Assignments = Mapping[tuple[str, str], Mapping[str, Mapping[str, Sequence[str]]]]


class _Lister(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.response = api_pb2.ListPodResourcesResponse()
        self.failure: grpc.StatusCode | None = None
        self.calls = 0
        self.answer = threading.Event()  # cleared: every List hangs until it is set
        self.answer.set()

    def List(
        self, request: api_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.ListPodResourcesResponse:
        with self.lock:
            self.calls += 1
        self.answer.wait()
        with self.lock:
            failure, response = self.failure, self.response
        if failure is not None:
            context.abort(failure, "stand-in told to fail")
        return response


class PodResourcesStandIn:
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.lister = _Lister()
        self._server = UnixGrpcServer(self.socket, self._add_services)

    def _add_services(self, server: grpc.Server) -> None:
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self.lister, server)  # type: ignore[no-untyped-call]

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self.lister.answer.set()  # a hung List must not hold up the server's stop
        self._server.stop()

    def hang(self) -> None:
        """Every List from now on waits, unanswered, until `answer_again`."""
        self.lister.answer.clear()

    def answer_again(self) -> None:
        self.lister.answer.set()

    def assign(self, assignments: Assignments) -> None:
        pods = [
            api_pb2.PodResources(
                namespace=namespace,
                name=pod,
                containers=[
                    api_pb2.ContainerResources(
                        name=container,
                        devices=[
                            api_pb2.ContainerDevices(resource_name=resource, device_ids=list(ids))
                            for resource, ids in resources.items()
                        ],
                    )
                    for container, resources in containers.items()
                ],
            )
            for (namespace, pod), containers in assignments.items()
        ]
        with self.lister.lock:
            self.lister.response = api_pb2.ListPodResourcesResponse(pod_resources=pods)

    def fail_with(self, code: grpc.StatusCode | None) -> None:
        with self.lister.lock:
            self.lister.failure = code

    @property
    def calls(self) -> int:
        with self.lister.lock:
            return self.lister.calls
