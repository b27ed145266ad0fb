#!/usr/bin/env python3
"""Benchmark (reliability): many `workingset` restores in a row of one VM under memtouch load (issue 29).

An earlier session's bench/learning.py saw about 1 restore in 100 fail with "the destination closed
the migration connection after RUN". This runs the same kind of restore COUNT times in a row: one
lab VM (MEM MiB, memtouch reading 10% of RAM and writing 1%, as learning.py), one hot snapshot,
then COUNT times `stop` + `restore s --mode workingset` (every 10th with the snapshot's learned
records removed, so first restores and learned ones alternate as in learning.py). A failed restore
keeps its post-mortem in <run-dir>/failed-restores/ (QEMU's stderr, its QMP events and migration
state, the console), and the run directory is kept when any restore failed.

With --cold, the snapshot's files are evicted from the page cache before each restore (per file,
posix_fadvise DONTNEED: learning.py drops the whole host's cache instead), so that pages are read
from the disk as after a failure; --settle S lets the restored guest run S seconds before the next
`stop` (learning.py: 3); --modes takes a comma list restored in turn (learning.py: lazy,workingset).

Writes one JSON line per restore to OUT (default bench/results/restore_loop.jsonl), and prints
the count of restores and failures at the end.
Usage: bench/restore_loop.py [--count 300] [--mem 1024] [--modes workingset] [--cold] [--settle 0]
                             [--vmcsnap PATH] [--out FILE]
Needs: target/release/vmcsnap (or --vmcsnap / $VMCSNAP), root.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import restore as rb  # noqa: E402
from learning import spec  # noqa: E402


def evict(root):
    """Drops the page-cache pages of every file under `root` (only those)."""
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--mem", type=int, default=1024)
    ap.add_argument("--modes", default="workingset")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--settle", type=float, default=0.0)
    ap.add_argument("--vmcsnap", default=os.environ.get("VMCSNAP", rb.VMCSNAP))
    ap.add_argument("--out", default=os.path.join(rb.ROOT, "bench", "results", "restore_loop.jsonl"))
    a = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-rl-", dir="/var/tmp")
    print(f"run directory {run_dir}", file=sys.stderr)
    path = os.path.join(run_dir, "spec.toml")
    with open(path, "w") as f:
        f.write(spec(a.mem, 3000).replace("bench-ln", "bench-rl"))
    records = os.path.join(run_dir, "snapshots", "s", "restores")
    failures, done = [], 0
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    out = open(a.out, "a")
    try:
        benchlib.run(a.vmcsnap, run_dir, "up", path, "--json")
        time.sleep(rb.SAMPLER_WAIT_S)
        benchlib.run(a.vmcsnap, run_dir, "snapshot", "vm0", "--mode", "hot", "--name", "s", "--json")
        for i in range(a.count):
            subprocess.run([a.vmcsnap, "--run-dir", run_dir, "stop", "vm0"], capture_output=True)
            if i % 10 == 0:
                shutil.rmtree(records, ignore_errors=True)
            if a.cold:
                evict(os.path.join(run_dir, "snapshots"))
            modes = a.modes.split(",")
            mode = modes[i % len(modes)]
            t = time.monotonic()
            p = subprocess.run([a.vmcsnap, "--run-dir", run_dir, "restore", "--wait", "s", "--mode", mode, "--json"],
                               capture_output=True, text=True)
            row = {"i": i, "mode": mode, "mem_mib": a.mem, "cold": a.cold, "ok": p.returncode == 0,
                   "wall_s": round(time.monotonic() - t, 2), "unix_s": int(time.time())}
            if p.returncode == 0:
                r = json.loads(p.stdout)
                row.update({k: r.get(k) for k in ["restore_latency_ms", "full_load_ms", "ws_pages",
                                                   "demand_faults", "learned"]})
            else:
                row["error"] = p.stderr.strip()
                failures.append(row)
                print(f"  restore {i} FAILED: {row['error']}", file=sys.stderr)
            done += 1
            time.sleep(a.settle)
            out.write(json.dumps(row) + "\n")
            out.flush()
            if i % 10 == 0 or not row["ok"]:
                print(f"  {done} restores, {len(failures)} failed ({row['wall_s']} s the last)", file=sys.stderr)
    finally:
        out.close()
        subprocess.run([a.vmcsnap, "--run-dir", run_dir, "down"], capture_output=True)
        print(f"{done} restores in a row, {len(failures)} failed", file=sys.stderr)
        if failures:
            print(f"run directory kept: {run_dir} (failed-restores/ holds the post-mortems)", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
