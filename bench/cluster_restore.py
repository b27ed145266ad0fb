#!/usr/bin/env python3
"""Benchmark: cluster restores, eager and eager-rl vs workingset-restore vs hotrestore vs hotrestore-rl (HotRestore).

Per cluster size N (default 4 and 8), VMs of different sizes and working sets in pairs (see spec():
by default the clients' working sets range from a few MiB to ~100 MiB): 2k runs a pingpong server
and a KV server, 2k+1 a pingpong client and a KV load against it. One hot cluster snapshot is taken (after a warm-up
snapshot), the cluster is destroyed, and it is restored REPS times per mode, modes interleaved;
each restore is measured from `restore --cluster --json` and the cluster is torn down again.
Recorded: per-VM latency, backoff (HotRestore's approximation), disruption, pages loaded first,
demand faults, frames replayed, RetransSegs growth (and of it the tail loss probes, the duplicate
SACKs received: retransmissions the peer already had, and the rest: an upper bound on segments lost), the longest gap between pingpong replies the guests saw; per run their
average/median/max. As a control, the same counters' growth over 4 guest seconds of steady running a
few seconds after each restore (same guests, connections and host load, no restore in the window).
With --restart-control, also the growth across a warm VMM restart of every VM of the restored cluster
(`rejuvenate --all`: each guest pauses, its QEMU is replaced by a fresh one, guest RAM stays in place,
nothing is loaded) over the same ~3 guest seconds as a restore's window: what a fresh QEMU alone
costs the guests' TCP on this host, with no memory to load and no start order to get wrong.

Goals (issue text): with the restore line, average backoff <= 20 ms and max <= 50 ms, and average
disruption <= 0.5x workingset-restore's.

Writes bench/results/cluster_restore.json and cluster_restore.png (per-VM latency and backoff bars
per mode and cluster size, like HotRestore's figure 7, for the last run of each) and prints a table.

A mode written M:cold (root) drops the host's page cache before the restore, so it reads its snapshot
from the disk, as a restore after a failure does and as HotRestore measured; --cold-cache does so for
every mode. Otherwise the snapshot is still in the page cache from the restore before, and loading a
working set costs tens of ms whatever its size. Each variant's disruption is compared with
workingset-restore's of the same variant, e.g. --modes workingset-restore,hotrestore-rl,workingset-restore:cold,hotrestore-rl:cold.

A mode written M@BIN restores with that vmcsnap binary instead (A/B of two builds on the same
snapshot, alternating): e.g. --modes hotrestore-rl:cold,hotrestore-rl:cold@/tmp/old/vmcsnap.

A mode written M:nopri runs M with `--no-priorities` (every thread at the same CPU priority), to
measure the fault-path/background priorities side by side, e.g. --modes hotrestore-rl,hotrestore-rl:nopri.
M:qMS runs M with `--start-quiet MS` (how long after each start only demand faults are served;
default 1000), e.g. --modes hotrestore-rl,hotrestore-rl:q0. Variants combine with +: M:cold+q0.

Usage: bench/cluster_restore.py [--vms 4,8] [--reps 3] [--first-restores] [--modes M,M] [--spec spread|small|large] [--cold-cache] [--bin PATH] [--out DIR] [--pcap DIR] [--restart-control] [--replot]
"""
import argparse, glob, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")
MODES = ["eager", "eager-rl", "workingset-restore", "hotrestore", "hotrestore-rl"]


# The control window (guest seconds; the restore's own window, from the cut to the third stat line
# after the restore, is about 3) and how long after the restore it ends (host seconds).
STEADY_WINDOW_S = 4
STEADY_SETTLE_S = 8
# The restart control's window: from the last stat line before the restart to the RESTART_LINES-th
# after it (a restore's window ends at the third stat line after the restore).
RESTART_LINES = 3


def stat_lines(run_dir, vm):
    """The restored guest's `vmcsnap-stat` lines as dicts of ints (uptime as float), oldest first,
    from the last run of increasing uptimes in its console log."""
    try:
        with open(os.path.join(run_dir, "cluster", vm, "console.log"), errors="replace") as f:
            lines = [l for l in benchlib.complete_lines(f.read()) if l.startswith("vmcsnap-stat ")]
    except OSError:
        return []
    out = []
    for l in reversed(lines):
        d = {}
        for kv in l.split()[1:]:
            k, _, v = kv.partition("=")
            try:
                d[k] = float(v) if k == "uptime" else int(v)
            except ValueError:
                pass
        if "uptime" not in d or (out and d["uptime"] >= out[-1]["uptime"]):
            break  # an earlier boot's lines
        out.append(d)
    return out[::-1]


def steady_growth(run_dir, vms, window_s):
    """Per VM, the growth of RetransSegs, tail loss probes and duplicate SACKs between its last stat
    line and the newest one at least `window_s` guest seconds before it (None if there is none)."""
    out = {}
    for vm in vms:
        ls = stat_lines(run_dir, vm)
        if not ls:
            out[vm] = None
            continue
        last = ls[-1]
        first = next((l for l in reversed(ls) if l["uptime"] <= last["uptime"] - window_s), None)
        out[vm] = None if first is None else {
            "window_s": round(last["uptime"] - first["uptime"], 2),
            **{k: last[k] - first[k] for k in ("retrans", "tlp", "dsack") if k in last and k in first}}
    return out


def restart_growth(exe, run_dir, vms):
    """Warm-restarts every VM's QEMU (`rejuvenate --all`) and returns (per VM the growth of
    RetransSegs, tail loss probes and duplicate SACKs from its last stat line before the restart to
    the RESTART_LINES-th after it, or None; the rejuvenate report). Guest time does not see the
    pause, so the stat lines simply go on."""
    before = {vm: len(stat_lines(run_dir, vm)) for vm in vms}
    report = benchlib.run(exe, run_dir, "rejuvenate", "--all", "--json")
    time.sleep(RESTART_LINES + 2)
    out = {}
    for vm in vms:
        ls, k = stat_lines(run_dir, vm), before[vm]
        if k == 0 or len(ls) < k + RESTART_LINES:
            out[vm] = None
            continue
        first, last = ls[k - 1], ls[k - 1 + RESTART_LINES]
        out[vm] = {"window_s": round(last["uptime"] - first["uptime"], 2),
                   **{key: last[key] - first[key] for key in ("retrans", "tlp", "dsack") if key in last and key in first}}
    return out, report


def parse_mode(mode):
    """`M[:variant][@BIN]` -> (M, variant or "", BIN or "")."""
    name, _, exe = mode.partition("@")
    base, _, variant = name.partition(":")
    return base, variant, exe


def variant_options(variant):
    """A variant's parts, joined by '+' (`cold+q0`) -> (extra `restore` arguments, drop the page
    cache first). nopri: --no-priorities; cold: cold page cache; qMS: --start-quiet MS."""
    extra, cold = [], False
    for part in filter(None, variant.split("+")):
        if part == "nopri":
            extra.append("--no-priorities")
        elif part == "cold":
            cold = True
        elif part[:1] == "q" and part[1:].isdigit():
            extra += ["--start-quiet", part[1:]]
        else:
            raise ValueError(f"unknown variant {part!r} (use nopri, cold or qMS, joined by +)")
    return extra, cold


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def spec(n, kind="spread"):
    """Pairs: 2k runs a pingpong server and a KV server, 2k+1 a pingpong client and a KV load against
    it. `small`: memtouch regions of 8-48 MiB at memtouch's default rate (1024 pages/s), so every
    working set is a few MiB. `spread` (default): the clients write at very different rates (2k-24k
    pages/s over 32-160 MiB), so working sets range from a few MiB to ~100 MiB and a pair's members
    finish loading at different times, HotRestore's case. Under TCG the clients write slower than
    asked (8 guests share 2 cores), so the working sets come out at 1-30 MiB. `large`: the clients
    write as fast as they can (`-r 0`) over 64-256 MiB, for working sets of tens to hundreds of MiB
    that take longer to load than a QEMU takes to start (the case HotRestore measured, with
    multi-second loads)."""
    out = [f'[cluster]\nname = "bench-cr"\naccel = "auto"\n']
    for i in range(n):
        k = i // 2
        if kind == "small":
            mem = [128, 160, 192, 256][i % 4]
            touch = f"memtouch -m {[8, 16, 32, 48][k % 4]} &\n"
        elif kind == "large" and i % 2 == 1:
            m = [64, 256, 128, 192][k % 4]
            mem = m + 128
            touch = f"memtouch -m {m} -r 0 &\n"
        elif i % 2 == 0:
            mem = 160
            touch = "memtouch -m 16 &\n"
        else:
            mem = [128, 256, 192, 256][k % 4]
            m, r = [(32, 2048), (160, 24576), (64, 8192), (128, 16384)][k % 4]
            touch = f"memtouch -m {m} -r {r} &\n"
        if i % 2 == 0:
            wl = f"{touch}pingpong server 7000 &\nkvserver 7001 &\n"
        else:
            wl = f"{touch}pingpong client {{ip:vm{i - 1}}} 7000 &\nkvload {{ip:vm{i - 1}}} 7001 &\n"
        out.append(f'[[vm]]\nname = "vm{i}"\nmemory_mib = {mem}\nworkload = """\n{wl}"""\n')
    return "\n".join(out)


def main():
    global VMCSNAP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vms", default="4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bin")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated subset of " + ",".join(MODES) + " (each may end in :VARIANT, VARIANT = nopri, cold, qMS or several joined by +, and in @BIN)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--spec", default="spread", choices=["spread", "small", "large"],
                    help="working sets: spread (clients at 2k-24k pages/s, default), small (all a few MiB) or "
                         "large (clients writing as fast as they can over 64-256 MiB)")
    ap.add_argument("--cold-cache", action="store_true",
                    help="drop the page cache before every restore (root): the snapshot is read from the disk")
    ap.add_argument("--restart-control", action="store_true",
                    help="after each restore's steady window, warm-restart every VM's QEMU (rejuvenate --all) and "
                         "measure the same TCP counters across it: what replacing the QEMUs costs, with nothing to load (their pauses are visible to peers)")
    ap.add_argument("--first-restores", action="store_true",
                    help="remove what earlier restores learned before each restore (every restore a first one)")
    ap.add_argument("--replot", action="store_true", help="only recompute the table and redraw the PNG from the JSON in --out")
    ap.add_argument("--pcap", metavar="DIR",
                    help="capture every VM's traffic into DIR (VMCSNAP_PCAP_DIR); then bench/restore_pcap.py "
                         "OUT/cluster_restore.json DIR shows what TCP did after each restore")
    a = ap.parse_args()
    if a.replot:
        with open(os.path.join(a.out, "cluster_restore.json")) as f:
            results = json.load(f)
        summarize(results)
        with open(os.path.join(a.out, "cluster_restore.json"), "w") as f:
            json.dump(results, f, indent=1)
        plot(results, a.out)
        return
    if a.bin:
        VMCSNAP = os.path.abspath(a.bin)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        try:
            variant_options(parse_mode(m)[1])
        except ValueError as e:
            sys.exit(f"--modes {m}: {e}")
    if a.pcap:
        os.environ["VMCSNAP_PCAP_DIR"] = os.path.abspath(a.pcap)  # the agent `up` starts inherits it
    os.makedirs(a.out, exist_ok=True)
    results = {"command": " ".join(sys.argv), "spec": a.spec, "cold_cache": a.cold_cache, "runs": [], "summary": []}
    for n in [int(x) for x in a.vms.split(",")]:
        run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-cr-", dir="/tmp")
        sp = os.path.join(run_dir, "spec.toml")
        with open(sp, "w") as f:
            f.write(spec(n, a.spec))
        try:
            run(run_dir, "up", sp)
            time.sleep(15)
            run(run_dir, "snapshot", "--cluster", "--name", "warmup", "--json")
            time.sleep(5)
            snap = run(run_dir, "snapshot", "--cluster", "--name", "cut", "--json")
            run(run_dir, "down")
            for rep in range(a.reps):
                for mode in modes:
                    base, variant, exe = parse_mode(mode)
                    exe = os.path.abspath(exe) if exe else VMCSNAP
                    try:
                        extra, cold = variant_options(variant)
                        if a.cold_cache or cold:
                            benchlib.drop_page_cache()
                        if a.first_restores:
                            # Every restore a first one: nothing learned from earlier restores.
                            for rec in glob.glob(os.path.join(run_dir, "snapshots", "cut", "vms", "*", "restores")):
                                shutil.rmtree(rec, ignore_errors=True)
                        r = benchlib.run(exe, run_dir, "restore", "--wait", "--cluster", "cut", "--mode", base, *extra, "--json")
                    except benchlib.Failed as e:
                        results["runs"].append({"n": n, "mode": mode, "rep": rep, "error": str(e)[-1500:]})
                        print(f"{n} VMs {mode} rep {rep}: FAILED", file=sys.stderr)
                        subprocess.run([exe, "--run-dir", run_dir, "down"], capture_output=True)
                        continue
                    time.sleep(4)
                    row = {"n": n, "mode": mode, "rep": rep, "edges": r["edges"], "rings": r["rings"],
                           "restore_line": r["restore_line"], "start_order": r["start_order"],
                           "follows": r["starts_follow_dependencies"],
                           "backoff_avg_ms": r["backoff_avg_ms"], "backoff_median_ms": r["backoff_median_ms"],
                           "backoff_max_ms": r["backoff_max_ms"], "latency_avg_ms": r["latency_avg_ms"],
                           "disruption_avg_ms": r["disruption_avg_ms"], "vms": r["vms"],
                           "snapshot_channel_frames": snap["channel_state_frames"]}
                    # Control: the same guests' TCP counters over STEADY_WINDOW_S of guest time
                    # with no restore in it, STEADY_SETTLE_S after the restore (the same host, load
                    # and connections): what grows anyway, for "does not grow because of the restore".
                    time.sleep(STEADY_SETTLE_S)
                    row["steady"] = steady_growth(run_dir, [v["vm"] for v in r["vms"]], STEADY_WINDOW_S)
                    if a.restart_control:
                        try:
                            row["restart"], rj = restart_growth(exe, run_dir, [v["vm"] for v in r["vms"]])
                            row["restart_downtime_ms"] = [v.get("downtime_ms") for v in rj.get("reports", [])]
                        except benchlib.Failed as e:
                            row["restart"] = {"error": str(e)[-1500:]}
                    results["runs"].append(row)
                    print(f"{n} VMs {mode:18} rep {rep}: latency {row['latency_avg_ms']:.0f} ms, backoff "
                          f"{row['backoff_avg_ms']:.1f}/{row['backoff_max_ms']:.1f} ms, disruption "
                          f"{row['disruption_avg_ms']:.0f} ms", file=sys.stderr)
                    benchlib.run(exe, run_dir, "down")
                    # The agent exits when idle; stopping it makes sure the next restore's binary
                    # starts its own.
                    subprocess.run([exe, "--run-dir", run_dir, "agent", "stop"], capture_output=True)
        except benchlib.Failed as e:
            print(f"{n} VMs: {e}", file=sys.stderr)
        finally:
            subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    summarize(results)
    with open(os.path.join(a.out, "cluster_restore.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, a.out)


def control_totals(windows):
    """A control's per-VM windows (`steady`, `restart`) -> (RetransSegs growth, duplicate SACKs, VMs
    without a window), summed over the VMs; None if the control failed."""
    if "error" in windows:
        return None
    ws = list(windows.values())
    return (sum((g or {}).get("retrans", 0) for g in ws), sum((g or {}).get("dsack", 0) for g in ws),
            sum(1 for g in ws if not g or "retrans" not in g))


def control_columns(name, totals):
    """The summary's columns of one control, a list per column with a value per run."""
    return {f"{name}_retrans_growth": [t and t[0] for t in totals],
            f"{name}_dsack_growth": [t and t[1] for t in totals],
            f"{name}_missing": [t and t[2] for t in totals]}


def summarize(results):
    """Fills results["summary"] from results["runs"] (medians per cluster size and mode) and prints
    the table."""
    results["summary"] = []
    med = benchlib.med
    if results.get("cold_cache"):
        print("\npage cache dropped before every restore")
    print(f"{'VMs':>3} {'mode':<19} {'ok':>4} {'latency':>8} {'backoff avg':>11} {'backoff max':>11} "
          f"{'disruption':>10} {'vs ws-restore':>13}")
    for n in sorted({r["n"] for r in results["runs"]}):
        base = {}  # workingset-restore's disruption per variant ("", "nopri", "cold")
        for mode in labels(results):
            rows = [r for r in results["runs"] if r["n"] == n and r["mode"] == mode]
            if not rows:
                continue
            good = [r for r in rows if "error" not in r]
            s = {"n": n, "mode": mode, "ok": f"{len(good)}/{len(rows)}",
                 "latency_avg_ms": med([r["latency_avg_ms"] for r in good]),
                 "backoff_avg_ms": med([r["backoff_avg_ms"] for r in good]),
                 "backoff_max_ms": med([r["backoff_max_ms"] for r in good]),
                 "disruption_avg_ms": med([r["disruption_avg_ms"] for r in good]),
                 # What the latency is made of: pages read before each VM started (its working set).
                 "pages_before_start_avg": med([sum(v.get("pages_before_start") or 0 for v in r["vms"]) / len(r["vms"])
                                                for r in good]),
                 # Summed over the VMs whose counters were read on both sides of the restore; the
                 # others are counted apart (a VM read as 0 - its count at the cut made runs negative).
                 "retrans_growth": [sum(g for v in r["vms"] if (g := (v.get("tcp_growth") or {}).get("retrans")) is not None)
                                    for r in good],
                 "unmeasured": [sum(1 for v in r["vms"] if (v.get("tcp_growth") or {}).get("retrans") is None)
                                for r in good],
                 # Of those, tail loss probes; the duplicate SACKs received (retransmissions the peer
                 # already had: a slow peer); and the segments lost (retransmissions no duplicate SACK
                 # answered: missing after the restore).
                 "tlp_growth": [sum((v.get("tcp_growth") or {}).get("tlp") or 0 for v in r["vms"]) for r in good],
                 "dsack_growth": [sum((v.get("tcp_growth") or {}).get("dsack") or 0 for v in r["vms"]) for r in good],
                 "lost_segments": [sum(benchlib.lost(v.get("tcp_growth")) for v in r["vms"]) for r in good],
                 # Controls (VMs without a window, too few stat lines, are not counted but reported):
                 # the growth over STEADY_WINDOW_S of the same guests' running, no restore in it; and
                 # across a warm restart of every VM's QEMU (--restart-control; None where it failed).
                 **control_columns("steady", [control_totals(r.get("steady") or {}) for r in good]),
                 **control_columns("restart", [control_totals(r["restart"]) for r in good if "restart" in r]),
                 # The longest pause between two pingpong replies any client saw after the restore.
                 "guest_max_gap_ms": [max([v.get("guest_max_gap_ms") or 0 for v in r["vms"]]) for r in good]}
            base_mode, variant, _ = parse_mode(mode)  # any @BIN: same baseline
            if base_mode == "workingset-restore":
                base[variant] = s["disruption_avg_ms"]
            s["disruption_vs_workingset_restore"] = (s["disruption_avg_ms"] / base[variant]
                                                     if base.get(variant) else None)
            results["summary"].append(s)
            ratio = s["disruption_vs_workingset_restore"]
            print(f"{n:>3} {mode:<19} {s['ok']:>4} {s['latency_avg_ms']:>8.0f} {s['backoff_avg_ms']:>11.1f} "
                  f"{s['backoff_max_ms']:>11.1f} {s['disruption_avg_ms']:>10.0f} "
                  f"{(f'{ratio:.2f}' if ratio else '-'):>13}  pages first/VM {s['pages_before_start_avg']:.0f}; retrans growth per run {s['retrans_growth']} "
                  f"(TLP {s['tlp_growth']}, DSACK {s['dsack_growth']}, lost {s['lost_segments']}, "
                  f"VMs without counters {s['unmeasured']}); "
                  f"in {STEADY_WINDOW_S} s of steady running {s['steady_retrans_growth']} "
                  f"(DSACK {s['steady_dsack_growth']}; VMs without a window {s['steady_missing']}), "
                  f"guest max gap ms per run {s['guest_max_gap_ms']}"
                  + (f"; across a warm VMM restart {s['restart_retrans_growth']} (DSACK {s['restart_dsack_growth']}; "
                     f"VMs without a window {s['restart_missing']})" if s["restart_retrans_growth"] else ""))


def labels(results):
    """The modes run: plain ones in MODES order, then each variant (:nopri, :cold) in MODES order,
    each followed by its runs with other binaries (@BIN)."""
    def key(m):
        base, variant, exe = parse_mode(m)
        return (["", "nopri", "cold"].index(variant) if variant in ("", "nopri", "cold") else 3,
                MODES.index(base) if base in MODES else len(MODES), variant, exe)
    return sorted({r["mode"] for r in results["runs"]}, key=key)


def plot(results, out):
    """One row per cluster size, one panel per mode: per-VM latency + backoff of the last run."""
    plt = benchlib.pyplot()
    good = [r for r in results["runs"] if "error" not in r]
    if plt is None or not good:
        return
    sizes = sorted({r["n"] for r in good})
    modes = labels(results)
    # Each panel its own y scale: eager modes take seconds, working-set modes hundreds of ms.
    fig, axes = plt.subplots(len(sizes), len(modes), figsize=(4.5 * len(modes), 3.6 * len(sizes)), squeeze=False)
    for row, n in enumerate(sizes):
        for ax, mode in zip(axes[row], modes):
            rows = [r for r in good if r["n"] == n and r["mode"] == mode]
            if not rows:
                continue
            vms = sorted(rows[-1]["vms"], key=lambda v: v["vm"])
            xs = range(len(vms))
            ax.bar(xs, [v["latency_ms"] for v in vms], label="restore latency")
            ax.bar(xs, [v["backoff_ms"] for v in vms], bottom=[v["latency_ms"] for v in vms], label="backoff")
            ax.set_ylim(0, 1.15 * max(v["latency_ms"] + v["backoff_ms"] for v in vms))
            ax.set_xticks(list(xs))
            ax.set_xticklabels([v["vm"] for v in vms], rotation=45)
            edges = rows[-1]["edges"]
            what = ", ".join(f"{e[0]}->{e[1]}" for e in edges) if len(edges) <= 4 else f"{len(edges)} edges"
            name, _, exe = mode.partition("@")  # a binary by its directory's name
            label = f"{name}@{os.path.basename(os.path.dirname(exe))}" if exe else mode
            ax.set_title(f"{label}, {n} VMs ({what or 'no edges'})", fontsize=8)
            ax.legend(fontsize=7)
        axes[row][0].set_ylabel("ms (disruption = latency + backoff)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cluster_restore.png"), dpi=110)
    print(os.path.join(out, "cluster_restore.png"))

if __name__ == "__main__":
    main()
