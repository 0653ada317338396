#!/usr/bin/env bash
# Build .whl/ in the repository root: the wheels benchmarks/gpu_run.sh installs (into /tmp/site) on a CUDA machine
# that has torch but cannot reach a package index. Run it on a machine with network access; carry .whl/ along.
#
#   benchmarks/gpu_wheels.sh            for the GPU machine's Python (default PY_VERSION=3.12), x86_64 Linux
#
# The list is hivemind 1.1.12's dependency closure and the test tools, less what an image with torch, numpy, scipy,
# msgpack, uvloop, grpcio and pytest-timeout already holds (docs/measurement.md); pytest is pinned to 8
# (pytest-forked breaks under pytest 9) and protobuf to the release hivemind's generated modules were checked with here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-python3}
# compiled, or tagged for the platform: downloaded for the GPU machine's Python
BINARY=(
  hivemind==1.1.12 blake3==1.0.11 cffi==2.1.1 cryptography==50.0.2 grpcio-tools==1.85.1 mmh3==5.3.1 protobuf==7.36.2
  pydantic-core==2.50.5
)
# pure Python: downloaded, or built here from a source release where PyPI has no wheel (prefetch-generator, varint)
PURE=(
  annotated-types==0.8.0 base58==2.1.1 configargparse==1.9.0 morphys==1.0 netaddr==1.3.0 prefetch-generator==1.0.3
  py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0 py-multihash==3.0.0 pycparser==3.12 pydantic==2.14.4
  python-baseconv==1.2.2 typing-inspection==0.4.5 varint==1.0.2
  pytest==8.3.5 pytest-asyncio==0.26.0 pytest-forked==1.7.5 pytest-benchmark==5.3.1
)
rm -rf .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_34_x86_64 -d .whl "${BINARY[@]}"
"$PYTHON" -m pip wheel -q --no-deps -w .whl "${PURE[@]}"
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
