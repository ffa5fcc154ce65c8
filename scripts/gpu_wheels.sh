#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, into .whl/ (or $1). That machine has no internet; its python3 (3.12) holds
# a CUDA torch, transformers, numpy and most of what the project needs, but not Ray, DeepSpeed or their
# dependencies. This fetches them at requirements/runtime.txt's pins, as Python 3.12 manylinux wheels, builds
# DeepSpeed's (pure Python; ops are built at first use), and removes Ray's Java jars and dashboard source maps,
# which nothing here uses, so that the wheels and the working tree fit the device tool's 64 MiB. Then, there:
#   SMOKE_WHEELS=.whl scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$DEST"
pins() { for name in "$@"; do grep -i "^$name==" requirements/runtime.txt; done; }
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
  $(pins ray pydantic pydantic_core annotated-types typing-inspection hjson jsonschema jsonschema-specifications \
         referencing rpds-py)
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST" "$(pins deepspeed)"
"$PYTHON" - "$DEST" <<'PY'
import sys
import zipfile
from pathlib import Path

unused = lambda name: name.startswith("ray/jars/") or name.endswith(".js.map")
for wheel in Path(sys.argv[1]).glob("ray-*.whl"):
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for info in source.infolist():
            if unused(info.filename):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(row for row in data.split(b"\n") if not unused(row.split(b",")[0].decode()))
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    slim.replace(wheel)
PY
du -sh "$DEST"
