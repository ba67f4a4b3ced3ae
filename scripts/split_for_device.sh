#!/usr/bin/env bash
# Splits a file too large for one device call (SmolLM2's 98 MB GGUF beside the tracked tree and
# dist/) into parts for back-to-back calls on a warm machine: xfer1/smol.00 (with smol.sha256
# and smol.count), xfer2/smol.01, ... — call N carries xferN (the first also dist); the ignored
# xfer folders stay on the machine between calls, and scripts/cuda_device_check.sh puts the file
# together in models/ once every part is there.
# Usage: scripts/split_for_device.sh FILE MB...   (one size per part; one more part takes the rest)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf xfer[0-9]*
python3 - "$@" <<'PY'
import hashlib, os, sys
f, sizes = sys.argv[1], [int(m) * 1_000_000 for m in sys.argv[2:]]
data = open(f, "rb").read()
parts, off = [], 0
for n in sizes + [len(data)]:
    if off >= len(data):
        break
    parts.append(data[off:off + n]); off += n
for i, p in enumerate(parts):
    os.makedirs(f"xfer{i + 1}", exist_ok=True)
    open(f"xfer{i + 1}/smol.{i:02d}", "wb").write(p)
open("xfer1/smol.sha256", "w").write(hashlib.sha256(data).hexdigest() + "\n")
open("xfer1/smol.count", "w").write(f"{len(parts)}\n")
PY
ls -l xfer*/
