#!/usr/bin/env python3
"""Benchmark: the detection layer (pages of the guest's page cache stored as references to the
frozen disk, docs/image-format.md "Detection layer").

On one lab guest booted by vmcsnap (TCG here): the guest writes FILE_MIB of random data to its
data disk, syncs, drops its page cache and reads the file and /data/blob back (so its page cache
holds FILE_MIB + 4 MiB read from the disk), with memtouch rewriting 32 MiB meanwhile. Then REPS
times, interleaved, a full hot snapshot (--full: no parent) with the layer (`--storage lz4`) and one without
(`--storage lz4,no-disk`): pages on disk, image bytes, bytes saved (pages_on_disk x 4096),
snapshot duration and downtime, and the index's own timings (manifest metrics.disk_index:
files of the chain, files whose index came from the cache, blocks, ms spent on the top file
after the freeze, ms from the start of the snapshot to the index being ready).
Writes bench/results/disklayer.json and prints a table.

Usage: bench/disklayer.py [--reps 3] [--mem 512] [--file-mib 64] [--bin PATH]
Needs: target/release/vmcsnap (make build) and the lab guest (make guest).
"""
import argparse, json, os, shutil, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem", type=int, default=512)
    ap.add_argument("--file-mib", type=int, default=64)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "vmcsnap"))
    a = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-disklayer-")
    spec = os.path.join(run_dir, "spec.toml")
    with open(spec, "w") as f:
        f.write(f'[cluster]\nname = "bench-dl"\naccel = "auto"\n\n[[vm]]\nname = "vm0"\n'
                f'memory_mib = {a.mem}\ndisk_mib = {a.file_mib + 64}\nworkload = """\n'
                f'memtouch -m 32 -r 0 &\n'
                f'dd if=/dev/urandom of=/data/rnd bs=1048576 count={a.file_mib} 2>/dev/null; sync; '
                f'echo 3 > /proc/sys/vm/drop_caches; cat /data/rnd /data/blob > /dev/null; '
                f'echo DISKREAD-DONE\n"""\n')
    run = lambda *args: benchlib.run(a.bin, run_dir, *args)  # noqa: E731
    rows = []
    try:
        run("up", spec, "--json")
        deadline = time.monotonic() + 600
        while "DISKREAD-DONE" not in run("console", "vm0"):
            if time.monotonic() > deadline:
                raise SystemExit("the guest did not read its file within 10 minutes")
            time.sleep(2)
        for rep in range(a.reps):
            for storage in ["lz4", "lz4,no-disk"]:
                name = f"r{rep}-{storage.replace(',', '-')}"
                time.sleep(3)
                r = run("snapshot", "vm0", "--mode", "hot", "--name", name, "--storage", storage, "--full",
                        "--json")
                ins = run("inspect", name, "--json")
                st, m = ins["stats"], ins["manifest"]["metrics"]
                rows.append({
                    "rep": rep, "storage": storage, "layer": "no-disk" not in storage,
                    "pages_on_disk": st["pages_on_disk"], "bytes_saved": st["pages_on_disk"] * 4096,
                    "image_bytes": st["total_bytes"], "pages_stored": st["pages_stored"],
                    "duration_ms": r["duration_ms"], "downtime_ms": r["downtime_ms"],
                    "disk_index": m.get("disk_index"),
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        try:
            run("down")
        except benchlib.Failed as e:
            print(e, file=sys.stderr)
        # Its snapshots and disks (hundreds of MiB) go with the run.
        shutil.rmtree(run_dir, ignore_errors=True)
    out = {"mem_mib": a.mem, "file_mib": a.file_mib, "reps": a.reps, "rows": rows}
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "disklayer.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'storage':<14}{'on disk':>9}{'saved MiB':>11}{'image MiB':>11}{'duration ms':>13}"
          f"{'downtime ms':>13}{'index top ms':>14}{'index ready ms':>16}")
    for r in rows:
        d = r["disk_index"] or {}
        print(f"{r['storage']:<14}{r['pages_on_disk']:>9}{r['bytes_saved'] / 2**20:>11.1f}"
              f"{r['image_bytes'] / 2**20:>11.1f}{r['duration_ms']:>13.0f}{r['downtime_ms']:>13.1f}"
              f"{d.get('top_ms', 0):>14.1f}{d.get('total_ms', 0):>16.1f}")


if __name__ == "__main__":
    main()
