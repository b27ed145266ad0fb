#!/usr/bin/env python3
"""Benchmark: snapshot storage on a real VM — the Redis primary of examples/redis.toml (Debian
image, systemd, Redis under redisload's writes; q35, TCG here). Complements bench/storage.py (the
lab guest) with memory as a real distribution fills it (kernel, page cache, Redis heap).

Boots the cluster, waits for the replica's link and redisload's status lines, then REPS times, on
the primary, side by side:
  * full hot snapshots with --storage v1 (format 1.0: every non-zero page, uncompressed), lz4 and
    zstd: image bytes (every file of the snapshot) against QEMU's stream bytes, compression
    ratio, duplicate pages, pages on a frozen disk, duration and pause;
  * after the restores below and GAP seconds, an incremental lz4 snapshot (no --full; the zstd
    one is deleted first so that the lz4 one is the parent: the pages changed since): its image
    bytes against the full lz4 one's, and the share of pages it stored;
  * restores: `--mode lazy` from the v1 and from the lz4 snapshot (demand faults in the first
    10 s, restore latency) from the v1, lz4 and zstd snapshots, and `--mode eager` from each.
Writes bench/results/storage_redis.json and prints a table.

Usage: bench/storage_redis.py [--reps 2] [--gap 20] [--vm primary] [--spec F] [--out DIR] [--bin F]
Needs target/release/vmcsnap (make build); the Debian image is built on first use (cached).
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import redis as rb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def snap(run_dir, vm, name, storage, full=True):
    r = run(run_dir, "snapshot", vm, "--mode", "hot", "--name", name, "--storage", storage, "--json",
            *(["--full"] if full else []))
    ins = run(run_dir, "inspect", name, "--json")
    st, m = ins["stats"], ins["manifest"]["metrics"]
    row = {"kind": "snapshot", "storage": storage if full else "lz4-incremental", "name": name,
           "image_bytes": st["total_bytes"], "stream_bytes": m["stream_bytes"],
           "image_over_stream": st["total_bytes"] / m["stream_bytes"],
           "compression_ratio": st.get("compression_ratio"), "pages_stored": st["pages_stored"],
           "pages_duplicate": st.get("pages_duplicate"), "pages_in_parent": st.get("pages_in_parent"),
           "pages_on_disk": st.get("pages_on_disk"), "pages_zero": st["pages_zero"],
           "pages_total": st["pages_total"], "duration_ms": r["duration_ms"], "downtime_ms": r["downtime_ms"]}
    print(f"  {row['storage']:<16} {row['image_bytes'] / 2**20:7.1f} MiB = {row['image_over_stream']:.3f} of stream, "
          f"ratio {row['compression_ratio'] or 1:.2f}, {row['pages_duplicate']} dup, {row['pages_on_disk']} on disk, "
          f"{row['pages_in_parent']} in parent; {row['duration_ms']:.0f} ms, pause {row['downtime_ms']:.1f} ms",
          file=sys.stderr)
    return row


def restore(run_dir, vm, name, storage, mode):
    run(run_dir, "stop", vm)
    r = run(run_dir, "restore", "--wait", name, "--mode", mode, "--json")
    per = r.get("demand_faults_per_100ms") or []
    time.sleep(rb.GAP_S)
    row = {"kind": "restore", "storage": storage, "mode": mode, "latency_ms": r["restore_latency_ms"],
           "faults_10s": sum(per[:100]), "full_load_ms": r.get("full_load_ms")}
    print(f"  restore {mode:<5} {storage:<4}: latency {row['latency_ms']:.1f} ms, faults in 10 s {row['faults_10s']}",
          file=sys.stderr)
    return row


def main():
    global VMCSNAP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gap", type=float, default=20.0)
    ap.add_argument("--vm", default="primary")
    ap.add_argument("--spec", default=os.path.join(ROOT, "examples", "redis.toml"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--bin", default=VMCSNAP)
    a = ap.parse_args()
    if not os.access(a.bin, os.X_OK):
        raise SystemExit(f"{a.bin} missing: run `make build` first")
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-storage-redis-", dir="/tmp")
    VMCSNAP = rb.VMCSNAP = shutil.copy2(a.bin, os.path.join(run_dir, "vmcsnap"))
    rows, res = [], {"bench": "storage_redis", "vm": a.vm, "reps": a.reps, "gap_s": a.gap, "started": time.time()}
    try:
        up = run(run_dir, "up", a.spec, "--json")
        ips = {v["name"]: v["ip"].split("/")[0] for v in up["vms"]}
        rb.wait_for("the replica's link", lambda: "master_link_status:up" in run(
            run_dir, "exec", "--", "redis-cli", "-h", ips["replica"], "info", "replication"))
        rb.wait_for("redisload's status lines", lambda: sum(
            1 for l in run(run_dir, "console", "client").splitlines() if "redisload: t=" in l and "sets=" in l) >= 2)
        for i in range(a.reps):
            print(f"== rep {i}", file=sys.stderr)
            for storage in ("v1", "lz4", "zstd"):
                rows.append(snap(run_dir, a.vm, f"{storage}-{i}", storage))
                time.sleep(rb.GAP_S)
            time.sleep(a.gap)
            for storage, name, mode in (("v1", f"v1-{i}", "lazy"), ("lz4", f"lz4-{i}", "lazy"),
                                        ("zstd", f"zstd-{i}", "lazy"), ("v1", f"v1-{i}", "eager"),
                                        ("lz4", f"lz4-{i}", "eager"), ("zstd", f"zstd-{i}", "eager")):
                try:
                    rows.append(restore(run_dir, a.vm, name, storage, mode))
                except benchlib.Failed as e:
                    rows.append({"kind": "restore", "storage": storage, "mode": mode, "error": rb.err_text(e)})
            # Incremental to the VM's newest snapshot with page hashes: make it the lz4 one
            # (the restores above started the VM from these snapshots; wait for new writes).
            run(run_dir, "snapshots", "delete", f"zstd-{i}")
            time.sleep(a.gap)
            rows.append(snap(run_dir, a.vm, f"inc-{i}", "lz4", full=False))
    except (benchlib.Failed, KeyError) as e:
        res["error"] = rb.err_text(e)
        print(f"FAILED: {res['error']}", file=sys.stderr)
    finally:
        subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    ok = [r for r in rows if "error" not in r]
    summary = {}
    for st in ("v1", "lz4", "zstd", "lz4-incremental"):
        rs = [r for r in ok if r["kind"] == "snapshot" and r["storage"] == st]
        summary[st] = {k: benchlib.med([r.get(k) for r in rs]) for k in
                       ("image_bytes", "stream_bytes", "image_over_stream", "compression_ratio", "pages_stored",
                        "pages_duplicate", "pages_on_disk", "pages_in_parent", "duration_ms", "downtime_ms")}
    for st, mode in (("v1", "lazy"), ("lz4", "lazy"), ("zstd", "lazy"), ("v1", "eager"), ("lz4", "eager"),
                     ("zstd", "eager")):
        rs = [r for r in ok if r["kind"] == "restore" and r["storage"] == st and r["mode"] == mode]
        summary[f"restore {st} {mode}"] = {"latency_ms": benchlib.med([r["latency_ms"] for r in rs]),
                                          "faults_10s": benchlib.med([r["faults_10s"] for r in rs])}
    if summary["lz4"]["image_bytes"] == summary["lz4"]["image_bytes"]:
        summary["incremental_over_full"] = summary["lz4-incremental"]["image_bytes"] / summary["lz4"]["image_bytes"]
    res.update({"rows": rows, "summary": summary, "finished": time.time()})
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "storage_redis.json")
    with open(path, "w") as f:
        json.dump(rb.clean(res), f, indent=1)
    print(json.dumps(rb.clean(summary), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
