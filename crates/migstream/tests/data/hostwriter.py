#!/usr/bin/env python3
"""Host-side writer for the bgsnap-hostwrites fixture.

Usage: hostwriter.py RAM_FILE SECONDS

Waits for RAM_FILE (a 16 MiB guest RAM file under /dev/shm) to exist,
maps it shared and, for SECONDS, stores a round counter into the first
word of every 16th page from 2 MiB to 10 MiB: the same pages the writer
guest writes, but from another process, outside QEMU's mapping.
"""
import mmap, os, struct, sys, time
path = sys.argv[1]
while not os.path.exists(path) or os.path.getsize(path) < (16 << 20):
    time.sleep(0.01)
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 16 << 20)
end = time.time() + float(sys.argv[2])
n = 0
while time.time() < end:
    n += 1
    for off in range(0x200000, 0xa00000, 0x10000):
        m[off:off+4] = struct.pack("<I", n)
print("host writer rounds", n)
