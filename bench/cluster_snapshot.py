#!/usr/bin/env python3
"""Benchmark: cluster snapshots, hot vs precopy vs stop-copy (issue: consistent cluster snapshot, HotSnap).

Side by side in one run, for clusters of N VMs (default 2, 4 and 8; MEM MiB each, default 160):
VMs come in pairs (2k, 2k+1): 2k runs a pingpong server and a KV server, 2k+1 a pingpong client
and a KV load against it; every VM runs memtouch. Per cluster size, REPS cluster snapshots per
mode, modes interleaved (hot, precopy, stop-copy, hot, ...) so noise hits all alike; each
snapshot is deleted after it is measured. Recorded per snapshot (from `snapshot --cluster --json`):
HotSnap's TCP backoff (average over communicating pairs, and max), per-VM downtime, pingpong's
longest gap (from the clients' per-second lines), the guests' RetransSegs growth, and the
switch's counters (forwarded, held, logged, dropped, violations). Memtouch and kvload are
checked for corruption at the end of each cluster.

Goals (issue text): hot cluster backoff <= 20 ms average and <= 50 ms max, flat from 2 to 8 VMs;
pingpong's longest gap during a hot snapshot <= 0.1x precopy's; RetransSegs unchanged across a
hot snapshot in at least 9 of 10 runs (all runs reported).

Writes bench/results/cluster_snapshot.json, cluster_snapshot.png (backoff per mode vs VMs) and
cluster_snapshot-timeline-<N>.png (timeline of the last hot snapshot at each size), and prints a
table of medians. Needs target/release/vmcsnap (make build).

Usage: bench/cluster_snapshot.py [--vms 2,4,8] [--reps 10] [--baseline-reps 4] [--mem 160]
                                [--modes hot,precopy,stop-copy] [--bin PATH]
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import timeline  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def spec(n, mem):
    out = ['[cluster]\nname = "bench-cs"\naccel = "auto"\n']
    for i in range(n):
        if i % 2 == 0:
            wl = "memtouch -m 16 &\npingpong server 7000 &\nkvserver 7001 &\n"
        else:
            wl = f"memtouch -m 16 &\npingpong client {{ip:vm{i - 1}}} 7000 &\nkvload {{ip:vm{i - 1}}} 7001 &\n"
        out.append(f'[[vm]]\nname = "vm{i}"\nmemory_mib = {mem}\nworkload = """\n{wl}"""\n')
    return "\n".join(out)


def console(run_dir, vm, whole=False):
    return run(run_dir, "console", vm, "--bytes", "0") if whole else run(run_dir, "console", vm)


def wait_traffic(run_dir, n, limit=180):
    deadline = time.time() + limit
    for i in range(1, n, 2):
        while time.time() < deadline:
            c = console(run_dir, f"vm{i}")
            if sum(1 for l in c.splitlines() if l.startswith("pingpong:")) >= 3:
                break
            time.sleep(1)


def guest_view(text):
    """(last retrans count, largest pingpong maxgap_ms) in console text."""
    retrans, gap = None, None
    for l in benchlib.complete_lines(text):
        if l.startswith("vmcsnap-stat "):
            for w in l.split():
                if w.startswith("retrans="):
                    retrans = int(w[8:])
        elif l.startswith("pingpong: "):
            for w in l.split():
                if w.startswith("maxgap_ms="):
                    gap = max(gap or 0, int(w[10:]))
    return retrans, gap


def no_snapshot(run_dir, n, seconds=4.5):
    """The same figures over a window without any snapshot: what the guests see anyway."""
    before = [console(run_dir, f"vm{i}", whole=True) for i in range(n)]
    time.sleep(seconds)
    after = [console(run_dir, f"vm{i}", whole=True) for i in range(n)]
    growth, gaps, known = 0, [], True
    for b, a in zip(before, after):
        rb, _ = guest_view(b)
        ra, _ = guest_view(a)
        _, gap = guest_view(a[len(b):])
        if ra is None or rb is None:
            known = False
        else:
            growth += ra - rb
        if gap is not None:
            gaps.append(gap)
    return {"mode": "none", "backoff_avg_ms": None, "backoff_max_ms": None, "pairs": 0, "downtime_avg_ms": None,
            "downtime_max_ms": None, "pingpong_max_gap_ms": max(gaps or [0]), "retrans_growth": growth if known else None,
            "retrans_known": known, "switch": {"forwarded": 0, "held": 0, "logged": 0, "logged_bytes": 0, "dropped": 0,
                                              "violations": 0, "triggers": 0, "bound_hits": 0, "unlogged_at_end": 0},
            "duration_ms": seconds * 1000, "vms": []}


def one(run_dir, mode, name, n):
    if mode == "none":
        return no_snapshot(run_dir, n), None
    t = time.time()
    try:
        r = run(run_dir, "snapshot", "--cluster", "--mode", mode, "--name", name, "--json")
    except benchlib.Failed as e:
        return {"mode": mode, "error": str(e)[-2000:]}
    row = {
        "mode": mode, "wall_s": time.time() - t,
        "backoff_avg_ms": r["backoff"]["avg_ms"], "backoff_max_ms": r["backoff"]["max_ms"],
        "pairs": len(r["backoff"]["pairs"]),
        "downtime_avg_ms": r["downtime_avg_ms"], "downtime_max_ms": r["downtime_max_ms"],
        "pingpong_max_gap_ms": max([v["pingpong_max_gap_ms"] or 0 for v in r["vms"]] or [0]),
        # None when a VM's counter was not read on both sides (0 - its count before is no growth).
        "retrans_growth": sum(v["retrans_after"] - v["retrans_before"] for v in r["vms"])
        if all(v["retrans_before"] is not None and v["retrans_after"] is not None for v in r["vms"]) else None,
        "retrans_known": all(v["retrans_before"] is not None and v["retrans_after"] is not None for v in r["vms"]),
        "switch": {k: r["switch"][k] for k in ("forwarded", "held", "logged", "logged_bytes", "dropped", "violations",
                                                "triggers", "bound_hits", "unlogged_at_end")},
        "duration_ms": r["duration_ms"],
        "vms": [{k: v.get(k) for k in ("vm", "downtime_ms", "pause_start_ms", "pause_end_ms", "complete_ms",
                                       "drain_bound_hit", "frames_drained_at_cut", "pause")} for v in r["vms"]],
    }
    path = r["path"]
    return row, path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vms", default="2,4,8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--mem", type=int, default=160)
    ap.add_argument("--modes", default="none,hot,precopy,stop-copy",
                    help="'none' measures the guests over a window without a snapshot (the baseline)")
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between snapshots")
    ap.add_argument("--baseline-reps", type=int, default=4, help="reps of the modes other than hot (slow)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--bin", help="the vmcsnap binary (default target/release/vmcsnap)")
    a = ap.parse_args()
    global VMCSNAP
    if a.bin:
        VMCSNAP = os.path.abspath(a.bin)
    modes = a.modes.split(",")
    os.makedirs(a.out, exist_ok=True)
    results = {"vms": [], "mem_mib": a.mem, "reps": a.reps, "baseline_reps": a.baseline_reps, "modes": modes,
               "started": time.time(), "command": " ".join(sys.argv)}
    for n in [int(x) for x in a.vms.split(",")]:
        run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-cs-", dir="/tmp")
        sp = os.path.join(run_dir, "spec.toml")
        with open(sp, "w") as f:
            f.write(spec(n, a.mem))
        entry = {"n": n, "rows": []}
        try:
            run(run_dir, "up", sp)
            wait_traffic(run_dir, n)
            time.sleep(a.gap)
            for rep in range(a.reps):
                for mode in modes:
                    if mode not in ("hot", "none") and rep >= a.baseline_reps:
                        continue
                    name = f"{mode}-{n}-{rep}"
                    got = one(run_dir, mode, name, n)
                    if isinstance(got, dict):
                        print(f"{n} VMs {mode} rep {rep}: FAILED {got['error'][-300:]}", file=sys.stderr)
                        entry["rows"].append(got)
                        continue
                    row, path = got
                    entry["rows"].append(row)
                    if path is not None:
                        print(f"{n} VMs {mode:9} rep {rep}: backoff {row['backoff_avg_ms']:.1f}/{row['backoff_max_ms']:.1f} ms, "
                          f"downtime {row['downtime_avg_ms']:.1f} ms, pp gap {row['pingpong_max_gap_ms']} ms, "
                              f"retrans +{row['retrans_growth']}, logged {row['switch']['logged']}", file=sys.stderr)
                    if path is None:
                        print(f"{n} VMs none      rep {rep}: pp gap {row['pingpong_max_gap_ms']} ms, "
                              f"retrans +{row['retrans_growth']} (no snapshot)", file=sys.stderr)
                        time.sleep(a.gap)
                        continue
                    if mode == "hot" and rep == a.reps - 1:
                        png = os.path.join(a.out, f"cluster_snapshot-timeline-{n}.png")
                        subprocess.run([sys.executable, os.path.join(ROOT, "bench", "timeline.py"), path, "-o", png],
                                       check=False, capture_output=True)
                    shutil.rmtree(path, ignore_errors=True)
                    shutil.rmtree(os.path.join(run_dir, "snapshots", ".disks", name), ignore_errors=True)
                    time.sleep(a.gap)
            text = "".join(console(run_dir, f"vm{i}") for i in range(n))
            entry["corruption"] = "MEMTOUCH-CORRUPTION" in text or "KVLOAD-MISMATCH" in text
        except benchlib.Failed as e:
            entry["error"] = str(e)[-2000:]
            print(f"{n} VMs: {e}", file=sys.stderr)
        finally:
            subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        results["vms"].append(entry)
        with open(os.path.join(a.out, "cluster_snapshot.json"), "w") as f:
            json.dump(results, f, indent=1)
    summarize(results, a.out)


def pause_start_spread(row):
    starts = [v["pause_start_ms"] for v in row["vms"] if v.get("pause_start_ms") is not None]
    return max(starts) - min(starts) if starts else None


def summarize(results, out):
    med = benchlib.med
    print(f"\n{'VMs':>3} {'mode':<10} {'ok':>5} {'backoff avg':>11} {'backoff max':>11} {'downtime':>9} "
          f"{'pp gap':>7} {'retrans=0':>9} {'logged':>7} {'dropped':>7}")
    summary = []
    for e in results["vms"]:
        for mode in results["modes"]:
            rows = [r for r in e["rows"] if r["mode"] == mode]
            good = [r for r in rows if "error" not in r]
            if not rows:
                continue
            s = {
                "n": e["n"], "mode": mode, "ok": f"{len(good)}/{len(rows)}",
                "backoff_avg_ms": med([r["backoff_avg_ms"] for r in good]) if mode != "none" else None,
                "backoff_max_ms": med([r["backoff_max_ms"] for r in good]) if mode != "none" else None,
                "backoff_max_ms_worst": max([r["backoff_max_ms"] for r in good] or [float("nan")]) if mode != "none" else None,
                "downtime_ms": med([r["downtime_avg_ms"] for r in good]) if mode != "none" else None,
                "pingpong_gap_ms": med([r["pingpong_max_gap_ms"] for r in good]),
                "retrans_unchanged": f"{sum(1 for r in good if r['retrans_growth'] == 0)}/"
                                     f"{sum(1 for r in good if r['retrans_growth'] is not None)}",
                "retrans_growth_per_run": [r["retrans_growth"] for r in good],
                "logged": med([r["switch"]["logged"] for r in good]),
                "dropped": sum(r["switch"]["dropped"] for r in good),
                # How far apart the VMs' pauses started (first to last STOP).
                "pause_start_spread_ms": med([pause_start_spread(r) for r in good]) if mode != "none" else None,
            }
            summary.append(s)
            f1 = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            print(f"{s['n']:>3} {mode:<10} {s['ok']:>5} {f1(s['backoff_avg_ms']):>11} {f1(s['backoff_max_ms']):>11} "
                  f"{f1(s['downtime_ms']):>9} {s['pingpong_gap_ms']:>7} {s['retrans_unchanged']:>9} {s['logged']:>7} "
                  f"{s['dropped']:>7}")
    results["summary"] = summary
    with open(os.path.join(out, "cluster_snapshot.json"), "w") as f:
        json.dump(results, f, indent=1)
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in results["modes"]:
        pts = [(s["n"], s["backoff_avg_ms"], s["pingpong_gap_ms"]) for s in summary if s["mode"] == mode]
        if pts:
            if mode != "none":
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=mode)
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=mode)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("VMs")
    axes[0].set_ylabel("cluster TCP backoff, median of runs (ms)")
    axes[0].axhline(20, color="gray", ls=":", lw=1)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("VMs")
    axes[1].set_ylabel("pingpong longest gap, median (ms)")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cluster_snapshot.png"), dpi=110)
    print(os.path.join(out, "cluster_snapshot.png"))


if __name__ == "__main__":
    main()
