#!/usr/bin/env bash
# The one way generated protobuf code is produced. Output is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
"$PYTHON" -m grpc_tools.protoc -I cluster/proto --python_out=cluster/proto --grpc_python_out=cluster/proto \
  --pyi_out=cluster/proto cluster/proto/hourglass.proto cluster/proto/meta.proto
# grpc_tools writes a top-level import; make it package-relative.
sed -i 's/^import hourglass_pb2 as hourglass__pb2/from . import hourglass_pb2 as hourglass__pb2/' cluster/proto/hourglass_pb2_grpc.py
sed -i 's/^import meta_pb2 as meta__pb2/from . import meta_pb2 as meta__pb2/' cluster/proto/meta_pb2_grpc.py
