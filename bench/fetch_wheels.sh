#!/usr/bin/env bash
# Wheels (Python 3.12, manylinux x86-64) of what the GPU machine's image lacks for the HTTP
# server benchmarks, into .whl/ (git-ignored; carried to the device machine).
set -euo pipefail
cd "$(dirname "$0")/.."
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_24_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 uvicorn==0.54.0 h11==0.16.0 \
  anyio==4.13.0 sniffio==1.3.1 typing-inspection==0.4.2 annotated-types==0.7.0 annotated-doc==0.0.4 \
  httpx==0.28.1 httpcore==1.0.9 prometheus-client==0.26.0 click==8.4.0
du -sh .whl
