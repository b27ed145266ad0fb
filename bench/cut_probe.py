#!/usr/bin/env python3
"""Benchmark: what the cut probes change (vmcsnap_switch::mediator::probe).

A 4-VM cluster with traffic (the pingpong ring r1 -> r2 -> r3 -> r1 and a KV pair kvc -> r1, as in
the cluster restore test) takes REPS pairs of hot cluster snapshots, one with the cut probes
(default) and one with --no-cut-probes, interleaved. Each snapshot is then restored with eager-rl
(all memory loaded before the start, starts in restore-line order): with nothing demand-paged and
the peers started together, a TCP retransmission after such a restore means a segment was lost
at the cut, i.e. the snapshot of its receiver lacked a frame its QEMU had read but not handed to
the guest.

Recorded per snapshot: per VM the settle time (socket drained -> second probe read), the drain
wait, the pause, whether a cut was unsettled; per restore the growth per VM of the guest's
RetransSegs, tail loss probes, tail loss probes that repaired a real loss (TCPLossProbeRecovery),
timeouts and duplicate SACKs received. A retransmission answered by a duplicate SACK was not
needed: the peer had the segment and was only slow (under TCG a restored guest starts with a cold
translation cache); the others repaired a segment missing from the restored cluster (lost).

Writes bench/results/cut_probe.json and cut_probe.png and prints a table.

Usage: bench/cut_probe.py [--reps 8] [--bin PATH] [--out DIR] [--replot]
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")
VARIANTS = ["probes", "no-probes"]

# The cluster restore test's cluster.
SPEC_FILE = os.path.join(ROOT, "examples", "ring-kv.toml")


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def main():
    global VMCSNAP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--bin")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON in --out")
    a = ap.parse_args()
    if a.replot:
        with open(os.path.join(a.out, "cut_probe.json")) as f:
            plot(json.load(f), a.out)
        return
    if a.bin:
        VMCSNAP = os.path.abspath(a.bin)
    os.makedirs(a.out, exist_ok=True)
    results = {"command": " ".join(sys.argv), "snapshots": [], "restores": []}
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-probe-", dir="/tmp")
    try:
        run(run_dir, "up", SPEC_FILE)
        time.sleep(15)
        run(run_dir, "snapshot", "--cluster", "--name", "warmup", "--json")
        names = []
        for rep in range(a.reps):
            for variant in VARIANTS:
                time.sleep(2)
                name = f"{variant}-{rep}"
                extra = ["--no-cut-probes"] if variant == "no-probes" else []
                s = run(run_dir, "snapshot", "--cluster", "--name", name, *extra, "--json")
                row = {"name": name, "variant": variant, "rep": rep,
                       "unsettled_cuts": s["switch"].get("unsettled_cuts", 0),
                       "channel_state_frames": s["channel_state_frames"],
                       "vms": [{k: v.get(k) for k in ("vm", "downtime_ms", "drain_wait_us", "settle_us", "unsettled")}
                               for v in s["vms"]]}
                results["snapshots"].append(row)
                names.append((name, variant, rep))
                settle = [v["settle_us"] for v in row["vms"]]
                print(f"{name}: settle us {settle}, unsettled {row['unsettled_cuts']}", file=sys.stderr)
        run(run_dir, "down")
        for name, variant, rep in names:
            try:
                r = run(run_dir, "restore", "--wait", "--cluster", name, "--mode", "eager-rl", "--json")
            except benchlib.Failed as e:
                results["restores"].append({"name": name, "variant": variant, "rep": rep, "error": str(e)[-1500:]})
                subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
                continue
            growth = {v["vm"]: v["tcp_growth"] for v in r["vms"]}
            results["restores"].append({"name": name, "variant": variant, "rep": rep, "growth": growth})
            print(f"{name}: eager-rl growth {growth}", file=sys.stderr)
            run(run_dir, "down")
    except benchlib.Failed as e:
        print(e, file=sys.stderr)
    finally:
        subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    summary = []
    print(f"\n{'variant':<10} {'restores':>8} {'with retrans':>12} {'segments':>8} {'repaired':>8} {'with loss':>9} "
          f"{'rto':>4} {'settle med us':>13} {'settle max us':>13} {'pause med ms':>12} {'unsettled':>9}")
    for variant in VARIANTS:
        snaps = [s for s in results["snapshots"] if s["variant"] == variant]
        rest = [r for r in results["restores"] if r["variant"] == variant and "growth" in r]
        settle = [v["settle_us"] for s in snaps for v in s["vms"] if v["settle_us"] is not None]
        pause = [v["downtime_ms"] for s in snaps for v in s["vms"] if v["downtime_ms"] is not None]
        tot = lambda r, k: sum((g.get(k) or 0) for g in r["growth"].values())
        s = {"variant": variant, "restores": len(rest),
             "restores_with_retrans": sum(1 for r in rest if tot(r, "retrans") > 0),
             "segments": sum(tot(r, "retrans") for r in rest),
             "losses_repaired": sum(lost(r) for r in rest),
             "restores_with_loss": sum(1 for r in rest if lost(r) > 0),
             "rto": sum(tot(r, "rto") for r in rest),
             "settle_median_us": benchlib.med(settle), "settle_max_us": max(settle) if settle else None,
             "pause_median_ms": benchlib.med(pause),
             "unsettled_cuts": sum(s["unsettled_cuts"] for s in snaps)}
        summary.append(s)
        print(f"{variant:<10} {s['restores']:>8} {s['restores_with_retrans']:>12} {s['segments']:>8} "
              f"{s['losses_repaired']:>8} {s['restores_with_loss']:>9} {s['rto']:>4} "
              f"{s['settle_median_us']:>13.0f} {s['settle_max_us'] or 0:>13} {s['pause_median_ms']:>12.1f} "
              f"{s['unsettled_cuts']:>9}")
    results["summary"] = summary
    with open(os.path.join(a.out, "cut_probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, a.out)


def lost(restore):
    """Segments lost across one restore, summed over its VMs (see benchlib.lost)."""
    return sum(benchlib.lost(g) for g in restore["growth"].values())


def plot(results, out):
    """Left: retransmitted segments per eager-rl restore per variant; right: settle times."""
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, variant in enumerate(VARIANTS):
        rest = [r for r in results["restores"] if r["variant"] == variant and "growth" in r]
        for k, (label, mark) in enumerate([("retransmitted", "o"), ("lost", "x")]):
            ys = [sum((g.get("retrans") or 0) for g in r["growth"].values()) if k == 0 else lost(r) for r in rest]
            ax1.scatter([i + k * 0.3 + (j - len(ys) / 2) * 0.02 for j in range(len(ys))], ys, marker=mark,
                        label=f"{variant}: {label}")
        settle = [v["settle_us"] / 1000 for s in results["snapshots"] if s["variant"] == variant for v in s["vms"]
                  if v["settle_us"] is not None]
        if settle:
            ax2.hist(settle, bins=20, alpha=0.6, label=variant)
    ax1.set_xticks(range(len(VARIANTS)))
    ax1.set_xticklabels(VARIANTS)
    ax1.set_ylabel("segments per eager-rl restore")
    ax1.set_title("retransmitted vs lost at the cut (4 VMs)", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("ms from socket drained to second probe read")
    ax2.set_ylabel("VM cuts")
    ax2.set_title("settle time per VM cut", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cut_probe.png"), dpi=110)
    print(os.path.join(out, "cut_probe.png"))


if __name__ == "__main__":
    main()
