#!/usr/bin/env python3
"""Writes fuzzing seeds cut from real QEMU 10.0 streams (the fixtures
../tests/data/qemu10-*.mig.gz) to seeds/qemu10-*: every item QEMU wrote
except most page records (the first few zero pages of each RAM section
and the stream's first page with data are kept, so the seed stays under read_stream's
-max_len of 9000) and a shortened VM description. Each seed starts with the
options byte 0x09: pages may be missing (bit 0), QEMU 10.0's dialect
(bit 3); see fuzz_targets/read_stream.rs. tests/qemu10.rs reads every seed
to its end. Run from this directory."""
import gzip, struct

ZERO, MEM_SIZE, PAGE, EOS, CONT = 0x2, 0x4, 0x8, 0x10, 0x20
PAGE_SIZE = 4096
KEEP_ZERO, KEEP_DATA = 6, 1
VMDESC = (b'{"configuration": {"vmsd_name": "configuration", "version": 1}, '
          b'"page_size": 4096, "devices": [{"name": "timer", "instance_id": 0, "version": 2}]}')


class Cut:
    def __init__(self, data):
        self.d, self.p, self.out = data, 0, bytearray()
        self.block = None      # block of the last record in the stream
        self.kept_block = None  # block of the last record kept
        self.datas = 0          # pages with data kept

    def take(self, n, keep=True):
        b = self.d[self.p:self.p + n]
        assert len(b) == n, "truncated stream"
        self.p += n
        if keep:
            self.out += b
        return b

    def be(self, n, keep=True):
        return int.from_bytes(self.take(n, keep), "big")

    def s8(self, keep=True):
        return self.take(self.be(1, keep), keep)

    def header(self):
        self.take(8)
        if self.d[self.p] == 0x07:
            self.take(1)
            self.take(self.be(4))
            while self.d[self.p] == 0x05:
                self.take(1)
                name = self.s8()
                self.take(4)
                if name.endswith(b"target-page-bits"):
                    self.take(4)
                elif name.endswith(b"capabilities"):
                    for _ in range(self.be(4)):
                        self.s8()
                else:
                    self.take(16)

    def ram(self):
        zeros = 0
        while True:
            h = self.be(8, keep=False)
            flags, addr = h & (PAGE_SIZE - 1), h & ~(PAGE_SIZE - 1)
            if flags & MEM_SIZE:
                self.out += h.to_bytes(8, "big")
                left = addr
                while left:
                    self.s8()
                    left -= self.be(8)
                continue
            if flags & EOS:
                self.out += h.to_bytes(8, "big")
                if self.d[self.p] == 0x7E:
                    self.take(5)
                return
            if not flags & CONT:
                self.block = self.s8(keep=False)
            zero = flags & ~CONT == ZERO
            body = self.take(1 if zero else PAGE_SIZE, keep=False)
            if zero and zeros >= KEEP_ZERO or not zero and self.datas >= KEEP_DATA:
                continue
            zeros, self.datas = zeros + zero, self.datas + (not zero)
            if self.kept_block == self.block:
                self.out += (h | CONT).to_bytes(8, "big")
            else:
                self.out += (h & ~CONT).to_bytes(8, "big") + bytes([len(self.block)]) + self.block
            self.kept_block = self.block
            self.out += body

    def run(self):
        self.header()
        while True:
            kind = self.d[self.p]
            if kind in (0x01, 0x04):
                at = self.p
                self.take(5)
                idstr = self.s8()
                self.take(8)
                if idstr == b"ram":
                    self.ram()
                    continue
                self.out = self.out[:len(self.out) - (self.p - at)]
                self.p = at
                return self.tail()
            elif kind in (0x02, 0x03):
                self.take(5)
                self.ram()
            elif kind == 0x08:
                self.take(3)
                self.take(self.be(2))
            elif kind == 0x00:
                return self.tail()
            else:
                raise SystemExit(f"unexpected byte {kind:#x} at {self.p}")

    def tail(self):
        rest = self.d[self.p:]
        end = rest.rfind(b"\x00\x06")
        assert end >= 0 and rest[end + 6:end + 7] == b"{", "no vmdesc"
        self.out += rest[:end + 1] + b"\x06" + struct.pack(">I", len(VMDESC)) + VMDESC
        return bytes(self.out)


for name in ["qemu10-precopy-paused", "qemu10-precopy-live", "qemu10-bgsnap-writer"]:
    with gzip.open(f"../tests/data/{name}.mig.gz") as f:
        seed = b"\x09" + Cut(f.read()).run()
    assert len(seed) <= 9000, (name, len(seed))
    with open(f"seeds/{name}", "wb") as f:
        f.write(seed)
    print(name, len(seed))
