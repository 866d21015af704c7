"""The endpoint picker on a loopback gRPC port, and a client that speaks Envoy's side of ext_proc
(a helper module, not a conftest: tests elsewhere import tests/conftest.py by that name)."""
from __future__ import annotations

import json
from concurrent import futures

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvship.router.extproc import Picker, add_to_server
from kvship.router.hold import Holding
from kvship.router.pool import Pool, endpoint_from_url
from kvship.router.stats import RouterStats
from kvship.router.tracing import PickTracer

ADDRESSES = ["127.0.0.1:18001", "127.0.0.1:18002", "127.0.0.1:18003"]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class PickerServer:
    def __init__(self, pool: Pool, block_chars: int = 64, holding: Holding | None = None,
                 tracer: PickTracer | None = None):
        self.pool = pool
        self.holding = holding or Holding(pool)
        self.stats = RouterStats(pool, self.holding)
        self.executor = futures.ThreadPoolExecutor(max_workers=8)
        self.server = grpc.server(self.executor)
        add_to_server(Picker(pool, self.stats, block_chars, self.holding, tracer), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def exchange(self, body: dict | None, path: str = "/v1/chat/completions",
                 traceparent: str | None = TRACEPARENT, timeout: float = 10) -> list[pb.ProcessingResponse]:
        """One HTTP request's ext_proc stream, as Envoy sends it with a buffered body."""
        method = "POST" if body is not None else "GET"
        headers = [base_pb2.HeaderValue(key=":method", raw_value=method.encode()),
                   base_pb2.HeaderValue(key=":path", raw_value=path.encode())]
        if traceparent:
            headers.append(base_pb2.HeaderValue(key="traceparent", raw_value=traceparent.encode()))
        reqs = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers),
                                                                    end_of_stream=body is None))]
        if body is not None:
            reqs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(),
                                                                      end_of_stream=True)))
        return list(self.stub.Process(iter(reqs), timeout=timeout))

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0).wait(5)
        self.executor.shutdown(wait=True)


def chat(system: str, user: str) -> dict:
    return {"model": "m", "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def set_headers(response: pb.ProcessingResponse) -> dict[str, str]:
    """The request headers the pick sets (the response to the request's headers or its body)."""
    common = response.request_body.response if response.HasField("request_body") else response.request_headers.response
    assert common.clear_route_cache
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def picked(responses: list[pb.ProcessingResponse]) -> tuple[str, list[str]]:
    """The destination header and the `envoy.lb` metadata list of the response that carries the pick."""
    final = responses[-1]
    meta = final.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return set_headers(final)["x-gateway-destination-endpoint"], meta.string_value.split(",")


def picker_factory():
    """A test's pickers (a generator for a fixture: `yield from`), all closed at its end."""
    made: list[PickerServer] = []

    def make(addresses=ADDRESSES, policy="prefix", **kw) -> PickerServer:
        p = PickerServer(Pool([endpoint_from_url(a) for a in addresses], policy), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
