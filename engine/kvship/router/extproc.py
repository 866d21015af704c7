"""The endpoint picker as Envoy's ext_proc service (envoy.service.ext_proc.v3.ExternalProcessor),
following the Gateway API Inference Extension's endpoint-picker protocol.

One gRPC stream per HTTP request: request headers (answered with CONTINUE, unless there is no
body), then the buffered request body, parsed and scored; the answer sets the header
`x-gateway-destination-endpoint: ip:port` and the same key in dynamic metadata under `envoy.lb`
(the pick first, then fallbacks, comma-separated). The stream's end closes the pick's in-flight count.
With no ready endpoint the request is held (scale from zero, kvship.router.hold), then picked or
answered with an ImmediateResponse: an OpenAI-shaped JSON 503 with Retry-After. The pick's span
(kvship.router.tracing) becomes the upstream request's `traceparent`."""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvship.router import prompt
from kvship.router.hold import Holding
from kvship.router.kv_events import request_block_hashes
from kvship.router.pool import Pick, Pool
from kvship.router.stats import RouterStats
from kvship.router.tracing import PickTracer

logger = logging.getLogger("kvship.router")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"

# The answer that lets each phase of the HTTP exchange go on unchanged.
_CONTINUE = {"request_headers": pb.HeadersResponse, "response_headers": pb.HeadersResponse,
             "request_body": pb.BodyResponse, "response_body": pb.BodyResponse,
             "request_trailers": pb.TrailersResponse, "response_trailers": pb.TrailersResponse}


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # Overwrite: a client's own x-gateway-destination-endpoint must never pick the upstream.
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def error_body(message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def immediate_error(status: int, message: str, type_: str, code: str,
                    retry_after_s: int | None = None) -> pb.ProcessingResponse:
    headers = [_set_header("content-type", "application/json")]
    if retry_after_s is not None:
        headers.append(_set_header("retry-after", str(retry_after_s)))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=headers),
        body=error_body(message, type_, code), details=f"kvship_router_{code}"))


def pick_response(phase: str, pick: Pick, extra_headers: dict[str, str]) -> pb.ProcessingResponse:
    """The pick, as the answer to the phase that carried the request (its headers, or its body)."""
    sets = [_set_header(DESTINATION_HEADER, pick.endpoint.address)]
    sets += [_set_header(k, v) for k, v in extra_headers.items()]
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets), clear_route_cache=True)
    metadata = struct_pb2.Struct()
    addresses = [pick.endpoint.address, *(e.address for e in pick.fallbacks)]
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: ",".join(addresses)}})
    return pb.ProcessingResponse(**{phase: _CONTINUE[phase](response=common)}, dynamic_metadata=metadata)


class Picker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, pool: Pool, stats: RouterStats, block_chars: int = 64, holding: Holding | None = None,
                 tracer: PickTracer | None = None):
        self.pool = pool
        self.stats = stats
        self.block_chars = block_chars
        self.holding = holding or Holding(pool)
        self.tracer = tracer

    def _no_endpoint(self, held: str) -> pb.ProcessingResponse:
        if held == "full":
            message, retry = "too many requests are waiting for a model server to start; retry later", 1
        elif held == "timeout":
            message = f"no model server became ready within {self.holding.timeout_s:g}s; retry later"
            retry = max(1, math.ceil(self.holding.timeout_s))
        else:
            message, retry = "no model server is available to serve this request; retry later", 1
        self.stats.picked({"full": "hold-full", "timeout": "hold-timeout"}.get(held, "no-endpoint"), None)
        return immediate_error(503, message, "service_unavailable_error", "no_endpoint", retry)

    def _cached_hashes(self, parsed: prompt.ParsedRequest, headers: dict[str, str]) -> list | None:
        """The prompt's blocks as the engines hash them, when they report what they cache."""
        if self.pool.cached is None or self.pool.policy != "prefix":
            return None
        return request_block_hashes(parsed, self.pool.cached, self.pool.healthy(), headers.get("authorization"))

    def _answer(self, phase: str, headers: dict[str, str], body: bytes) -> tuple[pb.ProcessingResponse, Pick | None]:
        span = self.tracer.start(headers) if self.tracer else None
        try:
            held = self.holding.wait()
            parsed = prompt.parse(body, self.block_chars)
            pick = self.pool.pick(parsed.block_hashes, self._cached_hashes(parsed, headers), parsed.model) if held == "ready" else None
            if pick is None:
                if span is not None:
                    span.set_attribute("kvship.router.reason", f"no-endpoint ({held})")
                return self._no_endpoint(held if held != "ready" else "off"), None
            self.stats.picked(pick.reason, pick.endpoint.address)
            logger.debug("%s %s -> %s (%s)", headers.get(":path", ""), parsed.model, pick.endpoint.address,
                         pick.reason)
            extra: dict[str, str] = {}
            if span is not None:
                span.set_attributes({"kvship.router.endpoint": pick.endpoint.address,
                                     "kvship.router.reason": pick.reason,
                                     "gen_ai.request.model": parsed.model or ""})
                extra = self.tracer.headers_for(span)
            return pick_response(phase, pick, extra), pick
        finally:
            if span is not None:
                span.end()

    def Process(self, request_iterator: Iterator[pb.ProcessingRequest],
                context: grpc.ServicerContext) -> Iterator[pb.ProcessingResponse]:
        pick: Pick | None = None
        headers: dict[str, str] = {}
        try:
            for req in request_iterator:
                phase = req.WhichOneof("request")
                if phase == "request_headers":
                    headers = {h.key: (h.raw_value.decode(errors="replace") if h.raw_value else h.value)
                               for h in req.request_headers.headers.headers}
                    if not req.request_headers.end_of_stream:  # the body follows: it decides
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                        continue
                    body = b""  # no body (GET /v1/models): picked on the headers
                elif phase == "request_body" and pick is None:
                    body = req.request_body.body
                else:  # a streamed body's later chunks, the response: the pick is made
                    yield pb.ProcessingResponse(**{phase: _CONTINUE[phase]()})
                    continue
                answer, pick = self._answer(phase, headers, body)
                yield answer
                if pick is None:
                    return
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
