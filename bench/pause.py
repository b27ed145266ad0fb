#!/usr/bin/env python3
"""Benchmark: the hot snapshot's pause against its floor, part by part (issue: pause at the limit).

Side by side in one run, interleaved so noise hits all alike: for each guest (lab guests of
256 MiB, 1 GiB and 4 GiB running memtouch over 32 MiB; with --redis also the Redis primary of
examples/redis.toml, a Debian VM under redisload), REPS times:
  * `vmcsnap pause-limit VM`: QEMU's own background snapshot with nothing else done (the floor);
  * `vmcsnap snapshot VM --mode hot --full`: vmcsnap's hot snapshot, with its pause breakdown
    (stop, disk_snapshot, migrate_command, qemu_setup, device_state); deleted after.
Reports medians per guest: the pause, the floor, their ratio, each part, and the 1 GiB and 4 GiB
pauses over the 256 MiB one. Writes bench/results/pause.json and pause.png (stacked parts per
guest next to the floor) and prints a table.

Usage: bench/pause.py [--reps 7] [--sizes 256,1024,4096] [--redis] [--out DIR] [--bin PATH]
Needs target/release/vmcsnap (make build); --redis builds the Debian image on first use.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")
PARTS = ["stop", "agent", "disk_snapshot", "migrate_command", "qemu_setup", "device_state"]


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def lab_spec(sizes):
    vms = "".join(f'\n[[vm]]\nname = "m{s}"\nmemory_mib = {s}\nworkload = """\nmemtouch -m 32 &\n"""\n'
                  for s in sizes)
    return f'[cluster]\nname = "bench-pause"\naccel = "auto"\n{vms}'


def up(spec_text=None, spec_path=None):
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-", dir="/var/tmp")
    if spec_path is None:
        spec_path = os.path.join(run_dir, "spec.toml")
        with open(spec_path, "w") as f:
            f.write(spec_text)
    run(run_dir, "up", spec_path, "--json")
    return run_dir


def one(run_dir, vm, rep, rows):
    lim = run(run_dir, "pause-limit", vm, "--json")
    rows.append({"vm": vm, "rep": rep, "kind": "limit", "pause_ms": lim["downtime_ms"],
                 "setup_while_running_ms": lim["setup_while_running_ms"]})
    name = f"pause-{vm}-{rep}"
    r = run(run_dir, "snapshot", vm, "--mode", "hot", "--full", "--name", name, "--json")
    parts = {p["name"]: p["us"] / 1000 for p in (r.get("pause") or {}).get("parts", [])}
    rows.append({"vm": vm, "rep": rep, "kind": "hot", "pause_ms": r["downtime_ms"], "parts": parts,
                 "memory_mib": r["memory_mib"]})
    run(run_dir, "snapshots", "delete", name)
    print(f"{vm:<10} rep {rep}: floor {lim['downtime_ms']:.1f} ms, hot {r['downtime_ms']:.1f} ms = "
          + " + ".join(f"{k} {v:.1f}" for k, v in parts.items()), file=sys.stderr)


def summarize(rows):
    out = {}
    for vm in sorted({r["vm"] for r in rows}, key=lambda v: [r["vm"] for r in rows].index(v)):
        hot = [r for r in rows if r["vm"] == vm and r["kind"] == "hot"]
        lim = [r for r in rows if r["vm"] == vm and r["kind"] == "limit"]
        p, l = benchlib.med([r["pause_ms"] for r in hot]), benchlib.med([r["pause_ms"] for r in lim])
        out[vm] = {"pause_ms": p, "limit_ms": l, "ratio": p / l if l else None, "reps": len(hot),
                   "parts_ms": {k: benchlib.med([r["parts"].get(k) for r in hot]) for k in PARTS},
                   "limit_setup_while_running_ms": benchlib.med([r["setup_while_running_ms"] for r in lim])}
    if "m256" in out:
        for vm in out:
            out[vm]["pause_over_256"] = out[vm]["pause_ms"] / out["m256"]["pause_ms"]
    return out


def table(s):
    print(f"{'guest':<10} {'pause':>7} {'floor':>7} {'ratio':>6} {'/256':>5}  " + " ".join(f"{k[:10]:>10}" for k in PARTS))
    for vm, e in s.items():
        print(f"{vm:<10} {e['pause_ms']:7.1f} {e['limit_ms']:7.1f} {e['ratio']:6.2f} {e.get('pause_over_256', float('nan')):5.2f}  "
              + " ".join(f"{(e['parts_ms'][k] if e['parts_ms'][k] == e['parts_ms'][k] else 0):10.1f}" for k in PARTS))


def plot(s, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    vms = list(s)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(vms))
    bottom = [0.0] * len(vms)
    for k in PARTS:
        vals = [s[v]["parts_ms"][k] if s[v]["parts_ms"][k] == s[v]["parts_ms"][k] else 0 for v in vms]
        ax.bar([i - 0.2 for i in x], vals, 0.4, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar([i + 0.2 for i in x], [s[v]["limit_ms"] for v in vms], 0.4, color="grey", label="QEMU alone (floor)")
    ax.set_xticks(list(x), vms)
    ax.set_ylabel("pause, ms (median)")
    ax.set_title("hot snapshot pause by part vs QEMU's own background snapshot")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--redis", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--bin")
    a = ap.parse_args()
    global VMCSNAP
    VMCSNAP = a.bin or VMCSNAP
    sizes = [int(x) for x in a.sizes.split(",") if x]
    clusters = []
    try:
        if sizes:
            clusters.append((up(lab_spec(sizes)), [f"m{s}" for s in sizes]))
        if a.redis:
            clusters.append((up(spec_path=os.path.join(ROOT, "examples", "redis.toml")), ["primary"]))
        time.sleep(5)  # memtouch and redisload under way
        rows = []
        for rep in range(a.reps):
            for run_dir, vms in clusters:
                for vm in vms:
                    one(run_dir, vm, rep, rows)
        s = summarize(rows)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "pause.json"), "w") as f:
            json.dump({"summary": s, "rows": rows, "reps": a.reps, "host_cpus": os.cpu_count()}, f, indent=1)
        plot(s, os.path.join(a.out, "pause.png"))
        table(s)
    finally:
        for run_dir, _ in clusters:
            subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
