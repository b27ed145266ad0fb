#!/usr/bin/env python3
"""Benchmark: VMM rejuvenation downtime, warm vs saved vs cold (issue: warm-VM reboot).

Side by side in one run, on real QEMU guests booted by vmcsnap:
  * downtime per VM at 256 MiB, 1 GiB and 4 GiB of guest RAM (one VM, REPS restarts per mode)
  * downtime per VM and total wall time for 1, 2 and 4 VMs rejuvenated in parallel (--all)
Writes bench/results/rejuvenate.json and bench/results/rejuvenate.png (downtime vs
memory size, one line per mode, like the paper's figure 5) and prints a table.
Medians are reported; the machine is shared and noisy, so compare modes within one run.

With --flat, the warm downtime's parts side by side instead (is it flat in guest RAM?): one
cluster holds one VM per size; before each restart the VM's QEMU reads all of guest RAM once
(`pmemsave` to /dev/null, as a hot snapshot does), so that its page tables map all of it, as in a
VM that has used its memory; the sizes take turns, and with --compare OLD_VMCSNAP a second
cluster run by that binary takes turns with them. Writes bench/results/rejuvenate-flat.json and
rejuvenate-flat.png: per binary and size the median downtime and its parts (save, quit, start,
load, resume; see the Report of crates/agent/src/rejuvenate.rs) and the largest/smallest ratio.

Usage: bench/rejuvenate.py [--reps N] [--sizes 256,1024,4096] [--vms 1,2,4] [--out DIR]
       bench/rejuvenate.py --flat [--reps N] [--sizes 256,1024,4096] [--compare OLD_VMCSNAP]
Needs: target/release/vmcsnap (make build; $VMCSNAP_BIN names another), matplotlib
(pip-installed if missing).
"""
import argparse, json, os, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from restore import Qmp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.environ.get("VMCSNAP_BIN") or os.path.join(ROOT, "target", "release", "vmcsnap")
MODES = ["warm", "saved", "cold"]
# The parts of a warm restart's downtime, in order (Report of crates/agent/src/rejuvenate.rs).
PARTS = ["save_ms", "quit_ms", "start_ms", "load_ms", "resume_ms"]


def run(run_dir, *args, vmcsnap=None):
    try:
        return benchlib.run(vmcsnap or VMCSNAP, run_dir, *args)
    except benchlib.Failed as e:
        raise SystemExit(str(e))


def spec(n, mem):
    vms = "".join(
        f'\n[[vm]]\nname = "vm{i}"\nmemory_mib = {mem}\nworkload = """\nmemtouch -m 32 &\n"""\n' for i in range(n)
    )
    return f'[cluster]\nname = "bench"\naccel = "auto"\n{vms}'


def with_cluster(n, mem, fn):
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-", dir="/var/tmp")
    path = os.path.join(run_dir, "spec.toml")
    with open(path, "w") as f:
        f.write(spec(n, mem))
    run(run_dir, "up", path, "--json")
    time.sleep(3)  # let memtouch fill its memory
    try:
        return fn(run_dir)
    finally:
        subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)


def by_size(sizes, reps):
    rows = []
    for mem in sizes:
        def measure(run_dir):
            out = []
            for mode in MODES:
                for _ in range(reps):
                    r = run(run_dir, "rejuvenate", "--all", "--mode", mode, "--json")
                    out.append({"mode": mode, "memory_mib": mem, **r["reports"][0]})
                    time.sleep(1)
            return out
        print(f"== {mem} MiB", file=sys.stderr)
        rows += with_cluster(1, mem, measure)
    return rows


def by_count(counts, reps):
    rows = []
    for n in counts:
        def measure(run_dir):
            out = []
            for mode in MODES:
                for _ in range(reps):
                    r = run(run_dir, "rejuvenate", "--all", "--mode", mode, "--json")
                    out.append({"mode": mode, "vms": n, "total_ms": r["total_ms"],
                                "downtimes_ms": [x["downtime_ms"] for x in r["reports"]]})
                    time.sleep(1)
            return out
        print(f"== {n} VMs", file=sys.stderr)
        rows += with_cluster(n, 256, measure)
    return rows




def summarize(size_rows, count_rows, sizes, counts):
    s = {"by_size": {}, "by_count": {}}
    for mode in MODES:
        s["by_size"][mode] = {str(m): benchlib.med([r["downtime_ms"] for r in size_rows if r["mode"] == mode and r["memory_mib"] == m]) for m in sizes}
        s["by_count"][mode] = {
            str(n): {
                "median_vm_downtime_ms": benchlib.med([d for r in count_rows if r["mode"] == mode and r["vms"] == n for d in r["downtimes_ms"]]),
                "median_total_ms": benchlib.med([r["total_ms"] for r in count_rows if r["mode"] == mode and r["vms"] == n]),
            } for n in counts
        }
    return s


def plot(summary, sizes, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in zip(MODES, "os^"):
        ax.plot(sizes, [summary["by_size"][mode][str(m)] / 1000 for m in sizes], marker=marker, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{m} MiB" if m < 1024 else f"{m // 1024} GiB" for m in sizes])
    ax.set_xlabel("guest memory")
    ax.set_ylabel("downtime per VM (s, median)")
    ax.set_title("VMM rejuvenation downtime (vmcsnap, TCG)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def flat_spec(sizes):
    vms = "".join(
        f'\n[[vm]]\nname = "m{m}"\nmemory_mib = {m}\nworkload = """\nmemtouch -m 32 -V 2048 &\n"""\n' for m in sizes
    )
    return f'[cluster]\nname = "flat"\naccel = "auto"\n{vms}'


def read_all_ram(run_dir, vm, mem):
    """Makes the VM's QEMU map all of guest RAM (as a hot snapshot's first read does): pmemsave
    to /dev/null in 8 MiB pieces through the sampler's QMP socket. microvm maps RAM below 3 GiB
    and the rest from 4 GiB. Returns the seconds it took."""
    t = time.monotonic()
    q = Qmp(os.path.join(run_dir, "cluster", vm, "sample.sock"))
    try:
        ram = (mem * 1024 + 8) * 1024  # + the TCG pad (TCG_DIRTY_TRACKING_PAD_KIB)
        low = 3 << 30
        for base, length in ((0, min(ram, low)), (4 << 30, max(0, ram - low))):
            for off in range(0, length, 8 << 20):
                q.cmd("pmemsave", {"val": base + off, "size": min(8 << 20, length - off), "filename": "/dev/null"})
    finally:
        q.close()
    return time.monotonic() - t


def flat(sizes, reps, bins):
    """Warm restarts of one VM per size in each binary's cluster, taking turns; see --flat."""
    clusters = {}
    try:
        for label, binary in bins:
            run_dir = tempfile.mkdtemp(prefix=f"vmcsnap-flat-{label}-", dir="/var/tmp")
            clusters[label] = (run_dir, binary)
            path = os.path.join(run_dir, "spec.toml")
            with open(path, "w") as f:
                f.write(flat_spec(sizes))
            run(run_dir, "up", path, "--json", vmcsnap=binary)
        time.sleep(3)
        rows = []
        for rep in range(reps):
            order = bins if rep % 2 == 0 else bins[::-1]
            for mem in sizes:
                for label, _ in order:
                    run_dir, binary = clusters[label]
                    populate_s = read_all_ram(run_dir, f"m{mem}", mem)
                    time.sleep(1)  # the previous restart's old QEMU has gone; the guest settles
                    r = run(run_dir, "rejuvenate", "--vm", f"m{mem}", "--mode", "warm", "--json", vmcsnap=binary)
                    rep_ = r["reports"][0]
                    rows.append({"bin": label, "rep": rep, "memory_mib": mem, "populate_s": populate_s, **rep_})
                    print(f"rep {rep} {label:<7} {mem:>5} MiB: downtime {rep_['downtime_ms']:7.1f} ms  "
                          + " ".join(f"{k[:-3]} {rep_.get(k, 0):6.1f}" for k in PARTS), file=sys.stderr)
        return rows
    finally:
        for run_dir, binary in clusters.values():
            subprocess.run([binary, "--run-dir", run_dir, "down"], capture_output=True)


def flat_summary(rows, sizes, bins):
    s = {}
    for label, _ in bins:
        per = {}
        for m in sizes:
            rs = [r for r in rows if r["bin"] == label and r["memory_mib"] == m]
            per[str(m)] = {k: benchlib.med([r.get(k) for r in rs]) for k in ["downtime_ms", *PARTS, "restart_ms"]}
        lo, hi = str(min(sizes)), str(max(sizes))
        s[label] = {"by_size": per, "ratio_largest_to_smallest": per[hi]["downtime_ms"] / per[lo]["downtime_ms"]}
    return s


def flat_plot(summary, sizes, bins, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for (label, _), marker in zip(bins, "os"):
        a1.plot(sizes, [summary[label]["by_size"][str(m)]["downtime_ms"] for m in sizes], marker=marker,
                label=f"{label} ({summary[label]['ratio_largest_to_smallest']:.2f}x)")
    a1.set_xscale("log", base=2)
    a1.set_xticks(sizes, [f"{m} MiB" if m < 1024 else f"{m // 1024} GiB" for m in sizes])
    a1.set_ylim(bottom=0)
    a1.set_xlabel("guest memory (all of it mapped by QEMU)")
    a1.set_ylabel("warm downtime (ms, median)")
    a1.grid(True, alpha=0.3)
    a1.legend()
    width = 0.8 / len(bins)
    for i, (label, _) in enumerate(bins):
        bottom = [0.0] * len(sizes)
        for k, color in zip(PARTS, ["C0", "C3", "C2", "C1", "C4"]):
            vals = [summary[label]["by_size"][str(m)][k] for m in sizes]
            xs = [j + i * width for j in range(len(sizes))]
            a2.bar(xs, vals, width, bottom=bottom, color=color, edgecolor="black" if i else "none",
                   label=k[:-3] if i == 0 else None, hatch="//" if i else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_xticks([j + width * (len(bins) - 1) / 2 for j in range(len(sizes))],
                  [f"{m} MiB" if m < 1024 else f"{m // 1024} GiB" for m in sizes])
    a2.set_ylabel("median of each part (ms)")
    a2.set_title(" | ".join(f"{'plain' if i == 0 else 'hatched'}: {label}" for i, (label, _) in enumerate(bins)), fontsize=9)
    a2.legend(fontsize=8)
    fig.suptitle("warm VMM rejuvenation downtime by guest memory (vmcsnap, TCG)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main_flat(a, sizes):
    bins = [("after" if a.compare else "current", VMCSNAP)]
    if a.compare:
        bins.insert(0, ("before", a.compare))
    for _, b in bins:
        if not os.access(b, os.X_OK):
            raise SystemExit(f"{b} missing: run `make build` first")
    rows = flat(sizes, a.reps, bins)
    summary = flat_summary(rows, sizes, bins)
    result = {"bench": "rejuvenate-flat", "unix_time": time.time(), "reps": a.reps, "sizes": sizes,
              "bins": dict(bins), "summary": summary, "rows": rows}
    with open(os.path.join(a.out, "rejuvenate-flat.json"), "w") as f:
        json.dump(result, f, indent=1)
    flat_plot(summary, sizes, bins, os.path.join(a.out, "rejuvenate-flat.png"))
    print("warm downtime and its parts (median ms), guest RAM all mapped by QEMU")
    print(f"{'binary':<8}{'MiB':>6}{'downtime':>10}" + "".join(f"{k[:-3]:>9}" for k in PARTS))
    for label, _ in bins:
        for m in sizes:
            v = summary[label]["by_size"][str(m)]
            print(f"{label:<8}{m:>6}{v['downtime_ms']:>10.1f}" + "".join(f"{v[k]:>9.1f}" for k in PARTS))
        print(f"{label:<8} {max(sizes)}/{min(sizes)} MiB: {summary[label]['ratio_largest_to_smallest']:.2f}x")
    print(f"\nwrote {a.out}/rejuvenate-flat.json and rejuvenate-flat.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--vms", default="1,2,4")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--flat", action="store_true", help="the warm downtime's parts by size (see above)")
    ap.add_argument("--compare", metavar="OLD_VMCSNAP", help="with --flat: also run this vmcsnap, in turns")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    os.makedirs(a.out, exist_ok=True)
    if a.flat:
        return main_flat(a, sizes)
    counts = [int(x) for x in a.vms.split(",")]
    if not os.access(VMCSNAP, os.X_OK):
        raise SystemExit(f"{VMCSNAP} missing: run `make build` first")
    os.makedirs(a.out, exist_ok=True)
    size_rows = by_size(sizes, a.reps)
    count_rows = by_count(counts, a.reps)
    summary = summarize(size_rows, count_rows, sizes, counts)
    result = {"bench": "rejuvenate", "unix_time": time.time(), "reps": a.reps, "summary": summary,
              "by_size": size_rows, "by_count": count_rows}
    with open(os.path.join(a.out, "rejuvenate.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(summary, sizes, os.path.join(a.out, "rejuvenate.png"))
    print("downtime per VM (median ms) by guest memory")
    print(f"{'mode':<6}" + "".join(f"{m:>10} MiB" for m in sizes))
    for mode in MODES:
        print(f"{mode:<6}" + "".join(f"{summary['by_size'][mode][str(m)]:>14.1f}" for m in sizes))
    print("\nVMs in parallel (256 MiB each): median per-VM downtime / median total ms")
    print(f"{'mode':<6}" + "".join(f"{n:>14} VMs" for n in counts))
    for mode in MODES:
        print(f"{mode:<6}" + "".join(
            f"{summary['by_count'][mode][str(n)]['median_vm_downtime_ms']:>8.1f}/{summary['by_count'][mode][str(n)]['median_total_ms']:<8.1f}"
            for n in counts))
    print(f"\nwrote {a.out}/rejuvenate.json and rejuvenate.png")


if __name__ == "__main__":
    main()
