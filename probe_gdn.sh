set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S=/tmp/strata-cuda; M=/tmp/q35-122b-l8-local.gguf
for ch in 1 0; do
STRATA_GPU_GDN_CHUNKED=$ch timeout 200 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:'gdn|q4k_mm_tc' --metrics gpu__time_duration.sum --csv \
   $S bench -m $M --device cuda --stream-experts off -p 512 -n 1 -r 1 > $OUT/ncu$ch.csv 2> $OUT/ncu$ch.err
python3 - $OUT/ncu$ch.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; k, u, v = hdr.index("Kernel Name"), hdr.index("Metric Unit"), hdr.index("Metric Value")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
t = collections.defaultdict(list)
for r in rows[1:]:
    x = float(r[v].replace(",", "")) * scale.get(r[u], 1.0)
    if x > 20: t[r[k].split("(")[0][:40]].append(x)
for name, x in sorted(t.items()):
    print(f"chunked={sys.argv[1][-5]} | {name} | {len(x)} launches over 20 us | mean {sum(x)/len(x):.1f} us | min {min(x):.1f} | max {max(x):.1f}")
PY
done
