#!/usr/bin/env bash
# Wheels (Python 3.12, manylinux x86-64) of what the GPU machine's image lacks (the HTTP
# server; xgrammar for constrained decoding; gguf and compressed-tensors for the quantized-weight tests) into .whl/ (git-ignored; carried to the device
# machine). Versions are constraints.txt's (the CI pins), so the two never drift apart.
set -euo pipefail
cd "$(dirname "$0")/.."
names="fastapi starlette pydantic pydantic_core uvicorn h11 anyio sniffio typing_inspection annotated_types
       annotated_doc httpx httpcore prometheus_client click typing_extensions idna certifi
       opentelemetry_api opentelemetry_sdk opentelemetry_semantic_conventions xgrammar apache_tvm_ffi
       gguf compressed_tensors loguru pytest_timeout pyzmq msgpack"
pins=$(python3 -c '
import sys
want = {n.lower().replace("-", "_") for n in sys.argv[1].split()}
for line in sys.stdin:
    name = line.split("==")[0].lower().replace("-", "_")
    if "==" in line and name in want:
        print(line.strip())' "$names" <constraints.txt)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_24_x86_64)
rm -rf .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl $pins
du -sh .whl && ls .whl
