"""`kvship router`: a Gateway API Inference Extension endpoint picker (Envoy ext_proc over gRPC)
beside a real Envoy that carries the bytes. Standard library, grpcio and xds-protos only: no torch."""
