"""The endpoint picker as Envoy's ext_proc service (envoy.service.ext_proc.v3.ExternalProcessor),
following the Gateway API Inference Extension's endpoint-picker protocol.

One gRPC stream per HTTP request: request headers (answered with CONTINUE, unless there is no
body), then the buffered request body, parsed and scored; the answer sets the header
`x-gateway-destination-endpoint: ip:port` and the same key in dynamic metadata under `envoy.lb`
(the pick first, then fallbacks, comma-separated). The stream's end closes the pick's in-flight count.
With no endpoint, an ImmediateResponse carries an OpenAI-shaped JSON error."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvship.router import prompt
from kvship.router.pool import Pick, Pool
from kvship.router.stats import RouterStats

logger = logging.getLogger("kvship.router")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"


def error_body(message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def immediate_error(status: int, message: str, type_: str, code: str) -> pb.ProcessingResponse:
    headers = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))])
    if status == 503:
        headers.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="retry-after", raw_value=b"1")))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=headers,
        body=error_body(message, type_, code), details=f"kvship_router_{code}"))


def _pick_mutation(pick: Pick) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            # Overwrite: a client's own x-gateway-destination-endpoint must never pick the upstream.
            header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=pick.endpoint.address.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]),
        clear_route_cache=True)
    metadata = struct_pb2.Struct()
    addresses = [pick.endpoint.address, *(e.address for e in pick.fallbacks)]
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: ",".join(addresses)}})
    return common, metadata


class Picker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, pool: Pool, stats: RouterStats, block_chars: int = 64):
        self.pool = pool
        self.stats = stats
        self.block_chars = block_chars

    def _choose(self, body: bytes, path: str) -> pb.ProcessingResponse | Pick:
        parsed = prompt.parse(body, self.block_chars)
        pick = self.pool.pick(parsed.block_hashes)
        if pick is None:
            self.stats.picked("no-endpoint", None)
            return immediate_error(503, "no model server is available to serve this request; retry later",
                                   "service_unavailable_error", "no_endpoint")
        self.stats.picked(pick.reason, pick.endpoint.address)
        logger.debug("%s %s -> %s (%s)", path, parsed.model, pick.endpoint.address, pick.reason)
        return pick

    def Process(self, request_iterator: Iterator[pb.ProcessingRequest],
                context: grpc.ServicerContext) -> Iterator[pb.ProcessingResponse]:
        pick: Pick | None = None
        path = ""
        try:
            for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    hdrs = {h.key: (h.raw_value.decode(errors="replace") if h.raw_value else h.value)
                            for h in req.request_headers.headers.headers}
                    path = hdrs.get(":path", "")
                    if not req.request_headers.end_of_stream:  # the body follows
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                        continue
                    chosen = self._choose(b"", path)
                    if isinstance(chosen, pb.ProcessingResponse):
                        yield chosen
                        return
                    pick = chosen
                    common, metadata = _pick_mutation(pick)
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                                dynamic_metadata=metadata)
                elif kind == "request_body":
                    if pick is not None:  # a streamed body's later chunks: the pick is made
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                        continue
                    chosen = self._choose(req.request_body.body, path)
                    if isinstance(chosen, pb.ProcessingResponse):
                        yield chosen
                        return
                    pick = chosen
                    common, metadata = _pick_mutation(pick)
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                                dynamic_metadata=metadata)
                elif kind == "response_headers":
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        except grpc.RpcError:
            return  # Envoy closed the stream (the request ended or was cancelled): nothing to answer
        except Exception:
            logger.exception("ext_proc stream failed")
            self.stats.picked("error", None)
            yield immediate_error(500, "the endpoint picker failed on this request", "server_error", "picker_error")
        finally:
            if pick is not None:  # Envoy closes the stream when the request ends
                self.pool.done(pick.endpoint)


def add_to_server(picker: Picker, server: grpc.Server) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
