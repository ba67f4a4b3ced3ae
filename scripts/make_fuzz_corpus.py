#!/usr/bin/env python3
"""Writes the committed hostile-file corpus (tests/fixtures/hostile/corpus.tar.xz): mutated copies of
the tiny Qwen3-MoE fixture as GGUF (tests/fixtures/moe-tiny/qwen3_moe.gguf) and as safetensors
(tests/fixtures/moe-tiny/qwen3_moe/model.safetensors). Every mutation targets a field a reader
trusts: counts, lengths, types, dims, offsets, alignment, header lengths, JSON shapes; plus bit flips
and truncations. Deterministic (seeded). The CI test `strata-cli/tests/hostile_files.rs` loads each
file with the `strata` binary: a clean error or a clean run, never a panic, a signal or a blow-up.

Usage: python3 scripts/make_fuzz_corpus.py [OUT.tar.xz]   (stdlib only)
"""
import io
import json
import random
import struct
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GGUF = (ROOT / "tests/fixtures/moe-tiny/qwen3_moe.gguf").read_bytes()
ST = (ROOT / "tests/fixtures/moe-tiny/qwen3_moe/model.safetensors").read_bytes()
rng = random.Random(20261125)
U64_EVIL = [0, 1, 2**28, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]


def gguf_fields(b):
    """Offsets of the GGUF header's fields: [(name, offset, size)]."""
    out = [("n_tensors", 8, 8), ("n_kv", 16, 8)]
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)

    def string(p, tag):
        n = struct.unpack_from("<Q", b, p)[0]
        out.append((tag + ".len", p, 8))
        return p + 8 + n

    def value(p, ty, tag):
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if ty in sizes:
            out.append((tag + ".value", p, sizes[ty]))
            return p + sizes[ty]
        if ty == 8:
            return string(p, tag)
        if ty == 9:
            ety = struct.unpack_from("<I", b, p)[0]
            out.append((tag + ".elem_type", p, 4))
            n = struct.unpack_from("<Q", b, p + 4)[0]
            out.append((tag + ".count", p + 4, 8))
            p += 12
            for i in range(n):
                p = value(p, ety, tag + f"[{i}]") if i < 2 else value(p, ety, "")
            return p
        raise ValueError(ty)

    for _ in range(n_kv):
        pos = string(pos, "key")
        ty = struct.unpack_from("<I", b, pos)[0]
        out.append(("kv.type", pos, 4))
        pos = value(pos + 4, ty, "kv")
    for _ in range(n_tensors):
        pos = string(pos, "tensor.name")
        nd = struct.unpack_from("<I", b, pos)[0]
        out.append(("tensor.n_dims", pos, 4))
        pos += 4
        for _ in range(nd):
            out.append(("tensor.dim", pos, 8))
            pos += 8
        out.append(("tensor.type", pos, 4))
        out.append(("tensor.offset", pos + 4, 8))
        pos += 12
    return [f for f in out if f[0]], pos


def put(b, off, size, value):
    b = bytearray(b)
    b[off : off + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    return bytes(b)


def gguf_mutations(n):
    fields, header_end = gguf_fields(GGUF)
    kinds = ["field", "field", "field", "flip", "truncate", "splice", "zero"]
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "field":
            name, off, size = rng.choice(fields)
            v = rng.choice(U64_EVIL + [rng.randrange(1 << (8 * size)), int.from_bytes(GGUF[off : off + size], "little") + rng.choice([-1, 1, 7, 1 << 20])])
            yield f"gguf-{i:03}-{name}.gguf", put(GGUF, off, size, v)
        elif kind == "flip":
            b = bytearray(GGUF)
            for _ in range(rng.randrange(1, 16)):
                p = rng.randrange(header_end + 64)
                b[p] ^= 1 << rng.randrange(8)
            yield f"gguf-{i:03}-flips.gguf", bytes(b)
        elif kind == "truncate":
            cut = rng.choice([rng.randrange(header_end), rng.randrange(len(GGUF))])
            yield f"gguf-{i:03}-truncated-{cut}.gguf", GGUF[:cut]
        elif kind == "splice":
            a, c = sorted(rng.sample(range(header_end), 2))
            yield f"gguf-{i:03}-splice.gguf", GGUF[:a] + GGUF[c:]
        else:
            a = rng.randrange(header_end)
            yield f"gguf-{i:03}-zeros.gguf", GGUF[:a] + bytes(rng.randrange(1, 256)) + GGUF[a + 1 :]


def st_parts():
    n = struct.unpack_from("<Q", ST, 0)[0]
    return json.loads(ST[8 : 8 + n]), ST[8 + n :]


def st_file(header, data, length=None):
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def st_mutations(n):
    header, data = st_parts()
    names = [k for k in header if k != "__metadata__"]
    for i in range(n):
        h = json.loads(json.dumps(header))
        t = h[rng.choice(names)]
        k = i % 12
        if k == 0:
            t["shape"] = [rng.choice(U64_EVIL[1:7]) for _ in t["shape"]]
        elif k == 1:
            t["data_offsets"] = [rng.choice(U64_EVIL[:7]), rng.choice(U64_EVIL[:7])]
        elif k == 2:
            t["data_offsets"] = t["data_offsets"][::-1]
        elif k == 3:
            t["dtype"] = rng.choice(["F8_E8M0", "I4", "Q4_K", "", "F64", "BOOL"])
        elif k == 4:
            del t[rng.choice(["dtype", "shape", "data_offsets"])]
        elif k == 5:
            t["shape"] = rng.choice([[], [-1, 4], [1.5, 2], "64", [0, 0]])
        elif k == 6:
            yield f"st-{i:03}-header-length.safetensors", st_file(h, data, rng.choice(U64_EVIL[1:]))
            continue
        elif k == 7:
            raw = json.dumps(h).encode()
            cut = rng.randrange(len(raw))
            yield f"st-{i:03}-bad-json.safetensors", st_file(raw[:cut], data)
            continue
        elif k == 8:
            yield f"st-{i:03}-truncated.safetensors", st_file(h, data)[: rng.randrange(len(ST))]
            continue
        elif k == 9:
            b = bytearray(st_file(h, data))
            for _ in range(rng.randrange(1, 12)):
                p = rng.randrange(8 + 2048)
                b[p] ^= 1 << rng.randrange(8)
            yield f"st-{i:03}-flips.safetensors", bytes(b)
            continue
        elif k == 10:
            h["__metadata__"] = {"format": "pt", "x": "y" * rng.randrange(1, 4096)}
            t["data_offsets"] = [t["data_offsets"][0], t["data_offsets"][1] + rng.choice([1, 4096, 1 << 30])]
        else:
            h[rng.choice(names)] = rng.choice([None, 7, "tensor", [1, 2], {"dtype": "F32"}])
        yield f"st-{i:03}-{k}.safetensors", st_file(h, data)


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/fixtures/hostile/corpus.tar.xz"
    out.parent.mkdir(parents=True, exist_ok=True)
    files = list(gguf_mutations(120)) + list(st_mutations(120))
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for name, b in files:
            info = tarfile.TarInfo(name)
            info.size = len(b)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(b))
    print(f"{out}: {len(files)} files, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
