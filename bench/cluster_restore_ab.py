#!/usr/bin/env python3
"""A/B of cluster restores of one existing cluster snapshot, modes (and builds) alternating.

Usage: bench/cluster_restore_ab.py RUN_DIR SNAPSHOT REPS OUT.json MODE[@BIN] [MODE[@BIN] ...]

RUN_DIR holds SNAPSHOT (e.g. from `vmcsnap --run-dir RUN_DIR up examples/redis.toml`, `snapshot --cluster
--name cut`, `down`). Each repetition restores SNAPSHOT once per MODE (`restore --wait --cluster SNAPSHOT
--mode MODE --json`, with the vmcsnap binary BIN if given, else target/release/vmcsnap), then `down` and
`agent stop`. Prints one line per restore with the cluster's phases (planned_ms, load_sent_ms) and each
VM's (begun, QEMU ready, RUN sent, device state loaded, START received, running; pages before the start,
working-set sizes), writes every report to OUT.json and the medians at the end. Earlier restores' records
stay (as in a repeated restore of the same snapshot), so hotrestore's learned sizes apply to every build.
"""
import json, os, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "target", "release", "vmcsnap")


def vm_line(v):
    f = lambda k: v.get(k) or 0
    return (f"{v['vm']}:begun={f('begun_ms'):.0f},qemu={f('qemu_ready_ms'):.0f},run={v['run_sent_ms']:.0f},"
            f"loaded={f('loaded_ms'):.0f},start={f('start_received_ms'):.0f},running={v['latency_ms']:.0f},"
            f"pages={v['pages_before_start']}/{f('pages_before_run')},ws={v['wss']}/{v['wss_hybrid']}")


def main():
    if len(sys.argv) < 6 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    run_dir, snap, reps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    modes = sys.argv[5:]
    rows = []
    for rep in range(reps):
        for m in modes:
            mode, _, exe = m.partition("@")
            exe = exe or DEFAULT
            p = subprocess.run([exe, "--run-dir", run_dir, "restore", "--wait", "--cluster", snap, "--mode", mode,
                                "--json"], capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{m} rep {rep}: FAILED {p.stderr[-800:]}", file=sys.stderr)
            else:
                r = json.loads(p.stdout)
                rows.append({"label": m, "rep": rep, "r": r})
                print(f"{m} rep {rep}: disruption {r['disruption_avg_ms']:.0f} ms, running {r['running_ms']:.0f} ms, "
                      f"backoff {r['backoff_avg_ms']:.1f}/{r['backoff_max_ms']:.1f} ms | planned "
                      f"{r.get('planned_ms', 0):.0f} load {r.get('load_sent_ms', 0):.0f} | "
                      + " ".join(vm_line(v) for v in r["vms"]), file=sys.stderr, flush=True)
            subprocess.run([exe, "--run-dir", run_dir, "down"], capture_output=True)
            subprocess.run([exe, "--run-dir", run_dir, "agent", "stop"], capture_output=True)
            time.sleep(2)
            with open(out, "w") as f:
                json.dump(rows, f, indent=1)
    for m in modes:
        rs = [x["r"] for x in rows if x["label"] == m]
        if rs:
            print(f"{m}: n={len(rs)}, disruption median {statistics.median(r['disruption_avg_ms'] for r in rs):.0f} ms, "
                  f"running median {statistics.median(r['running_ms'] for r in rs):.0f} ms")


if __name__ == "__main__":
    main()
