#!/usr/bin/env python3
"""Benchmark: snapshot modes hot vs stop-copy vs precopy (issue: hot snapshots, HotSnap).

Side by side in one run, on real QEMU guests booted by vmcsnap (one VM per configuration):
  * guest memory 256 MiB and 1 GiB, workload idle or `memtouch -m <RAM/4> -r 0`
  * REPS snapshots per mode, modes interleaved (hot, stop-copy, precopy, hot, ...) so that
    noise hits all modes equally; each snapshot is inspected and then deleted (they are large)
  * per snapshot: downtime_ms, duration_ms, disk_snapshot_ms (from `snapshot --json`),
    image bytes (`inspect --json`: manifest metrics bytes_written) and QEMU's stream bytes
  * memtouch: writes_per_s of the console lines printed during a hot snapshot vs the 5 lines
    before it (lines are timestamped on the host as they appear in cluster/<vm>/console.log)
Goals checked (issue text): hot downtime median <= 5 ms and <= 1/50 of stop-copy's; hot
duration <= 1.2x stop-copy's; image bytes <= QEMU's stream bytes for the same VM (stop-copy's
stream, which has no re-sent pages); memtouch slowdown during a hot snapshot (HotSnap: < 5%).
Writes bench/results/snapshot.json and bench/results/snapshot.png (median downtime per
configuration and mode, log scale) and prints a table. Medians are reported; the machine is
shared and noisy, so compare modes within one run.

A failed snapshot is recorded (row with "error", column ok = succeeded/taken) and the run goes on.

Usage: bench/snapshot.py [--reps 3] [--sizes 256,1024] [--workloads idle,memtouch] [--gap 6] [--out DIR] [--bin PATH]
Needs: target/release/vmcsnap (make build), matplotlib (pip-installed if missing).
"""
import argparse, json, os, re, shutil, statistics, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")
MODES = ["hot", "stop-copy", "precopy"]
VM = "vm0"
MEMTOUCH_RE = re.compile(r"memtouch: t=(\d+) writes=(\d+) writes_per_s=(\d+)")
BEFORE_LINES = 5


Failed = benchlib.Failed


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def workload(name, mem):
    if name == "idle":
        return ""
    if name == "memtouch":
        return f"memtouch -m {mem // 4} -r 0 &\n"
    raise SystemExit(f"unknown workload {name}")


def spec(mem, wl):
    return (f'[cluster]\nname = "bench-snap"\naccel = "auto"\n\n[[vm]]\nname = "{VM}"\n'
            f'memory_mib = {mem}\nworkload = """\n{workload(wl, mem)}"""\n')


class Console:
    """Tails the VM's console log; stamps each memtouch line with host time (monotonic) of arrival."""

    def __init__(self, run_dir):
        self.path = os.path.join(run_dir, "cluster", VM, "console.log")
        self.lines = []  # (host_time, guest_t, writes, writes_per_s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        pos, buf = 0, b""
        while not self.stop.is_set():
            try:
                with open(self.path, "rb") as f:
                    f.seek(pos)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            now = time.monotonic()
            pos += len(data)
            buf += data
            *full, buf = buf.split(b"\n")
            for line in full:
                m = MEMTOUCH_RE.search(line.decode(errors="replace"))
                if m:
                    self.lines.append((now, int(m[1]), int(m[2]), int(m[3])))
            time.sleep(0.1)

    def close(self):
        self.stop.set()
        self.thread.join()


def memtouch_window(console, start, end):
    """writes_per_s: the BEFORE_LINES lines that arrived before `start`, and the lines whose second
    overlaps [start, end] (a line arriving at a covers about [a-1, a]: a > start and a-1 < end)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(a > end + 1.0 for a, *_ in console.lines):
        time.sleep(0.2)  # wait for the line that covers the end of the snapshot
    lines = list(console.lines)
    before = [w for a, _, _, w in lines if a <= start][-BEFORE_LINES:]
    during = [w for a, _, _, w in lines if start < a <= end + 1.0]
    if not before or not during:
        return None
    b, d = statistics.median(before), statistics.median(during)
    return {"before_writes_per_s": before, "during_writes_per_s": during,
            "before_median": b, "during_median": d, "ratio": d / b if b else None}


def measure_config(mem, wl, reps, gap):
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-snap-", dir="/var/tmp")
    path = os.path.join(run_dir, "spec.toml")
    with open(path, "w") as f:
        f.write(spec(mem, wl))
    print(f"== {mem} MiB, {wl}", file=sys.stderr)
    rows, console = [], None
    try:
        up = run(run_dir, "up", path, "--json")
        accel = up["vms"][0]["accel"]
        console = Console(run_dir)
        time.sleep(3)  # let memtouch fill its memory
        for i in range(reps):
            for mode in MODES:
                time.sleep(gap)  # steady state (and BEFORE_LINES clean memtouch lines) before each snapshot
                name = f"bench-{mode}-{i}"
                t0 = time.monotonic()
                try:
                    r = run(run_dir, "snapshot", VM, "--mode", mode, "--name", name, "--json")
                    t1 = time.monotonic()
                    ins = run(run_dir, "inspect", name, "--json")
                except Failed as e:  # recorded, not fatal: one failed snapshot must not lose the run
                    err = str(e).strip().splitlines()[-1]
                    rows.append({"memory_mib": mem, "workload": wl, "accel": accel, "mode": mode, "rep": i, "error": err})
                    print(f"   {mode:<9} rep {i}: FAILED: {err}", file=sys.stderr)
                    shutil.rmtree(os.path.join(run_dir, "snapshots", name), ignore_errors=True)
                    shutil.rmtree(os.path.join(run_dir, "snapshots", ".disks", name), ignore_errors=True)
                    continue
                m = ins["manifest"]["metrics"]
                row = {"memory_mib": mem, "workload": wl, "accel": accel, "mode": mode, "rep": i,
                       "downtime_ms": r["downtime_ms"], "duration_ms": r["duration_ms"],
                       "disk_snapshot_ms": r["disk_snapshot_ms"], "image_bytes": m["bytes_written"],
                       "image_total_bytes": ins["stats"]["total_bytes"], "stream_bytes": m["stream_bytes"],
                       "pages_total": m["pages_total"], "pages_zero": m["pages_zero"],
                       "pages_guest_written": m["pages_guest_written"], "pages_resent": m.get("pages_resent"),
                       "capture_ms": m.get("capture_ms"), "command_s": t1 - t0}
                if wl == "memtouch":
                    row["memtouch"] = memtouch_window(console, t0, t1)
                rows.append(row)
                shutil.rmtree(os.path.join(run_dir, "snapshots", name), ignore_errors=True)
                shutil.rmtree(os.path.join(run_dir, "snapshots", ".disks", name), ignore_errors=True)
                mt = row.get("memtouch")
                print(f"   {mode:<9} rep {i}: downtime {row['downtime_ms']:8.1f} ms, duration {row['duration_ms']:7.0f} ms"
                      + (f", memtouch during/before {mt['ratio']:.2f}" if mt and mt["ratio"] else ""), file=sys.stderr)
        return rows
    finally:
        if console:
            console.close()
        subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)




def summarize(rows, configs):
    out = {}
    for mem, wl in configs:
        key = f"{mem}MiB/{wl}"
        s = {}
        for mode in MODES:
            all_rs = [r for r in rows if r["memory_mib"] == mem and r["workload"] == wl and r["mode"] == mode]
            rs = [r for r in all_rs if "error" not in r]
            s[mode] = {k: benchlib.med([r[k] for r in rs]) for k in
                       ("downtime_ms", "duration_ms", "disk_snapshot_ms", "image_bytes", "stream_bytes")}
            s[mode]["image_over_stream"] = benchlib.med([r["image_bytes"] / r["stream_bytes"] for r in rs])
            s[mode]["n"] = len(rs)
            s[mode]["failed"] = len(all_rs) - len(rs)
            mts = [r["memtouch"] for r in rs if r.get("memtouch")]
            if mts:
                s[mode]["memtouch_ratio"] = benchlib.med([m["ratio"] for m in mts])
                s[mode]["memtouch_slowdown_pct"] = (1 - s[mode]["memtouch_ratio"]) * 100
        hot, sc = s["hot"], s["stop-copy"]
        s["hot_over_stopcopy"] = {"downtime": hot["downtime_ms"] / sc["downtime_ms"],
                                  "duration": hot["duration_ms"] / sc["duration_ms"]}
        s["goals"] = {
            "hot_downtime_le_5ms": hot["downtime_ms"] <= 5,
            "hot_downtime_le_stopcopy_over_50": hot["downtime_ms"] <= sc["downtime_ms"] / 50,
            "hot_duration_le_1.2x_stopcopy": hot["duration_ms"] <= 1.2 * sc["duration_ms"],
            "hot_image_le_qemu_stream": hot["image_bytes"] <= sc["stream_bytes"],
        }
        if "memtouch_slowdown_pct" in hot:
            s["goals"]["hot_memtouch_slowdown_lt_5pct"] = hot["memtouch_slowdown_pct"] < 5
        out[key] = s
    return out


def plot(summary, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    keys = list(summary)
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(MODES)
    for j, mode in enumerate(MODES):
        xs = [i + (j - (len(MODES) - 1) / 2) * w for i in range(len(keys))]
        ys = [summary[k][mode]["downtime_ms"] for k in keys]
        bars = ax.bar(xs, [y if y == y else 0 for y in ys], w, label=mode, color=f"C{j}")
        ax.bar_label(bars, labels=[("failed" if y != y else f"{y:.0f}" if y >= 10 else f"{y:.1f}") for y in ys], fontsize=7)
    ax.axhline(5, color="grey", linestyle="--", linewidth=1, label="goal: hot ≤ 5 ms")
    ax.set_yscale("log")
    ax.set_xticks(range(len(keys)), [k.replace("MiB/", " MiB\n").replace("1024 MiB", "1 GiB") for k in keys])
    ax.set_ylabel("downtime (ms, median)")
    ax.set_title("Snapshot downtime by mode (vmcsnap, TCG)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    top = max([summary[k][m]["downtime_ms"] for k in keys for m in MODES if summary[k][m]["downtime_ms"] == summary[k][m]["downtime_ms"]] + [10])
    ax.set_ylim(1, top * 6)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fmt_bytes(b):
    return f"{b / 2**20:.1f}M" if b == b else "-"


def print_table(summary):
    print("median per (memory, workload, mode); image/stream = image bytes / QEMU stream bytes of the same snapshot")
    hdr = (f"{'memory':<8}{'workload':<10}{'mode':<10}{'downtime ms':>12}{'duration ms':>12}{'disk ms':>9}"
           f"{'image':>9}{'stream':>9}{'img/str':>8}{'hot/sc dt':>10}{'hot/sc dur':>11}{'memtouch':>10}{'ok':>6}")
    print(hdr)
    print("-" * len(hdr))
    for key, s in summary.items():
        mem, wl = key.split("/")
        for mode in MODES:
            m = s[mode]
            ratios = (f"{s['hot_over_stopcopy']['downtime']:>10.3f}{s['hot_over_stopcopy']['duration']:>11.2f}"
                      if mode == "hot" else " " * 21)
            mt = f"{-m['memtouch_slowdown_pct']:>+9.1f}%" if "memtouch_slowdown_pct" in m else f"{'':>10}"
            print(f"{mem:<8}{wl:<10}{mode:<10}{m['downtime_ms']:>12.1f}{m['duration_ms']:>12.0f}"
                  f"{m['disk_snapshot_ms']:>9.1f}{fmt_bytes(m['image_bytes']):>9}{fmt_bytes(m['stream_bytes']):>9}"
                  f"{m['image_over_stream']:>8.3f}{ratios}{mt}{m['n']:>4}/{m['n'] + m['failed']}")
    print("\nmemtouch: change of median writes_per_s during the snapshot vs the 5 s before it (negative = slowdown)")
    print("\ngoals (hot, medians):")
    for key, s in summary.items():
        print(f"  {key:<17}" + "  ".join(f"{g}={'yes' if ok else 'NO'}" for g, ok in s["goals"].items()))


def main():
    global VMCSNAP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--workloads", default="idle,memtouch")
    ap.add_argument("--gap", type=float, default=6.0, help="seconds of steady state before each snapshot")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--bin", default=VMCSNAP, help="vmcsnap binary (copied before the run)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    wls = a.workloads.split(",")
    configs = [(m, w) for m in sizes for w in wls]
    if not os.access(a.bin, os.X_OK):
        raise SystemExit(f"{a.bin} missing: run `make build` first")
    # Run a private copy: a rebuild of target/release during the run must not swap the binary
    # between the CLI and the agent it started (or between configurations).
    bindir = tempfile.mkdtemp(prefix="vmcsnap-bench-bin-")
    VMCSNAP = os.path.join(bindir, "vmcsnap")
    shutil.copy2(a.bin, VMCSNAP)
    bin_info = {"path": os.path.relpath(a.bin, ROOT), "mtime": os.path.getmtime(VMCSNAP), "size": os.path.getsize(VMCSNAP)}
    os.makedirs(a.out, exist_ok=True)
    rows = []
    try:
        for mem, wl in configs:
            rows += measure_config(mem, wl, a.reps, a.gap)
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
    summary = summarize(rows, configs)
    result = {"bench": "snapshot", "unix_time": time.time(), "reps": a.reps, "gap_s": a.gap,
              "accel": rows[0]["accel"] if rows else None, "binary": bin_info, "summary": summary, "rows": rows}
    with open(os.path.join(a.out, "snapshot.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(summary, os.path.join(a.out, "snapshot.png"))
    print_table(summary)
    print(f"\nwrote {a.out}/snapshot.json and snapshot.png")


if __name__ == "__main__":
    main()
