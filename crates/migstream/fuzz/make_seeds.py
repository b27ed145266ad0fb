#!/usr/bin/env python3
"""Writes the fuzzing seed corpus to seeds/: small valid streams built from
the wire-format reference, each prefixed with the options byte 0 (see
fuzz_targets/read_stream.rs). Run from this directory."""
import struct

def be32(v): return struct.pack(">I", v)
def be64(v): return struct.pack(">Q", v)
def s8(s): return bytes([len(s)]) + s

PAGE = 4096
def stream(footers=True, config=True, vmdesc=True, caps=(), cmds=b"", pages=None):
    out = b"QEVM" + be32(3)
    if config:
        out += b"\x07" + be32(7) + b"microvm"
        if caps:
            out += b"\x05" + s8(b"configuration/capabilities") + be32(1) + be32(len(caps))
            for c in caps: out += s8(c)
    out += cmds
    foot = lambda i: (b"\x7e" + be32(i)) if footers else b""
    blocks = [(b"ram", 3 * PAGE), (b"rom", PAGE)]
    out += b"\x01" + be32(2) + s8(b"ram") + be32(0) + be32(4)
    out += be64(sum(b[1] for b in blocks) | 4)
    for i, (n, l) in enumerate(blocks):
        out += s8(n) + be64(l) + (be64(i << 20) if caps else b"")
    out += be64(0x10) + foot(2)
    out += b"\x02" + be32(2)
    for (blk, off, kind) in pages or [(b"ram", 0, "z"), (b"ram", 2, "p"), (b"ram", 1, "z"), (b"rom", 0, "p")]:
        out += be64(off * PAGE | (2 if kind == "z" else 8)) + s8(blk)
        out += b"\x00" if kind == "z" else bytes([off + 1]) * PAGE
    out += be64(0x10) + foot(2)
    out += b"\x04" + be32(0) + s8(b"timer") + be32(0) + be32(2) + b"\x01\x02\x03" + foot(0)
    out += b"\x00"
    if vmdesc:
        j = b'{"page_size": 4096, "devices": [{"name": "timer", "instance_id": 0, "version": 2}]}'
        out += b"\x06" + be32(len(j)) + j
    return out

cmds = b"\x08" + struct.pack(">HH", 1, 0) + b"\x08" + struct.pack(">HH", 2, 4) + be32(1)
seeds = {
    "plain": stream(),
    "bare": stream(footers=False, config=False, vmdesc=False),
    "ignore-shared": stream(caps=(b"x-ignore-shared",), pages=[(b"rom", 0, "z")]),
    "commands": stream(cmds=cmds),
}
for name, data in seeds.items():
    with open(f"seeds/{name}", "wb") as f:
        f.write(b"\x00" + data)
