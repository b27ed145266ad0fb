#!/usr/bin/env python3
"""Benchmark: what the pre-copy RAM check costs in pause time.

Every pre-copy snapshot is checked against the paused guest's RAM before the guest resumes
(docs/snapshot.md, "Pre-copy is checked against the paused guest's RAM"). This boots the same
lab guest (224 MiB, memtouch over 32 MiB as fast as it can) twice, once under --bin (with the
check) and once under --base (a build without it, e.g. the previous main), and takes REPS
`snapshot --mode precopy --full` of each, interleaved so that machine noise hits both alike.
Reports per build the median pause and its parts (switchover, disk_snapshot, copy, ram_check,
resume), and for --bin the median hashing time (`precopy_ram_hash_ms`) and pages patched.
Writes bench/results/precopy_check.json.

Usage: bench/precopy_check.py --base PATH [--bin PATH] [--reps 15] [--out DIR]
"""
import argparse, json, os, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spec(name):
    return (f'[cluster]\nname = "{name}"\naccel = "auto"\n\n[[vm]]\nname = "a"\nmemory_mib = 224\n'
            'workload = """\nmemtouch -m 32 -r 0 &\n"""\n')


def up(binary, name):
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-", dir="/var/tmp")
    path = os.path.join(run_dir, "spec.toml")
    with open(path, "w") as f:
        f.write(spec(name))
    benchlib.run(binary, run_dir, "up", path, "--json")
    return run_dir


def one(binary, run_dir, label, rep, rows):
    name = f"pc-{rep}"
    r = benchlib.run(binary, run_dir, "snapshot", "a", "--mode", "precopy", "--full",
                     "--name", name, "--json")
    parts = {p["name"]: p["us"] / 1000 for p in (r.get("pause") or {}).get("parts", [])}
    m = benchlib.run(binary, run_dir, "inspect", name, "--json")["manifest"]["metrics"]
    row = {"build": label, "rep": rep, "pause_ms": r["downtime_ms"], "parts": parts,
           "hash_ms": m.get("precopy_ram_hash_ms"), "patched": m.get("precopy_pages_patched")}
    rows.append(row)
    benchlib.run(binary, run_dir, "snapshots", "delete", name)
    print(f"{label:<5} rep {rep}: pause {r['downtime_ms']:.1f} ms = "
          + " + ".join(f"{k} {v:.1f}" for k, v in parts.items())
          + (f"; hash {row['hash_ms']:.1f} ms, patched {row['patched']}" if row["hash_ms"] else ""),
          file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "vmcsnap"))
    ap.add_argument("--base", required=True, help="a vmcsnap build without the check")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    builds = [("check", a.bin, "bench-pc-check"), ("base", a.base, "bench-pc-base")]
    dirs = {}
    rows = []
    try:
        for label, binary, name in builds:
            dirs[label] = up(binary, name)
        for rep in range(a.reps):
            for label, binary, _ in builds:
                one(binary, dirs[label], label, rep, rows)
    finally:
        for label, binary, _ in builds:
            if label in dirs:
                subprocess.run([binary, "--run-dir", dirs[label], "down"], capture_output=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    summary = {}
    for label, _, _ in builds:
        mine = [r for r in rows if r["build"] == label]
        names = sorted({k for r in mine for k in r["parts"]})
        summary[label] = {
            "pause_ms": benchlib.med([r["pause_ms"] for r in mine]),
            "parts_ms": {k: benchlib.med([r["parts"].get(k, 0.0) for r in mine]) for k in names},
        }
        if label == "check":
            summary[label]["hash_ms"] = benchlib.med([r["hash_ms"] for r in mine])
            summary[label]["patched_total"] = sum(r["patched"] or 0 for r in mine)
    out = {"reps": a.reps, "load_after": load, "summary": summary, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "precopy_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    for label, s in summary.items():
        print(f"{label:<5} median pause {s['pause_ms']:.1f} ms: "
              + ", ".join(f"{k} {v:.1f}" for k, v in s["parts_ms"].items())
              + (f"; hashing {s['hash_ms']:.1f} ms, {s['patched_total']} pages patched"
                 if label == "check" else ""))


if __name__ == "__main__":
    main()
