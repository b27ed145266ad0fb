#!/usr/bin/env python3
"""Benchmark: VMM rejuvenation downtime, warm vs saved vs cold (issue: warm-VM reboot).

Side by side in one run, on real QEMU guests booted by vmcsnap:
  * downtime per VM at 256 MiB, 1 GiB and 4 GiB of guest RAM (one VM, REPS restarts per mode)
  * downtime per VM and total wall time for 1, 2 and 4 VMs rejuvenated in parallel (--all)
Writes bench/results/rejuvenate.json and bench/results/rejuvenate.png (downtime vs
memory size, one line per mode, like the paper's figure 5) and prints a table.
Medians are reported; the machine is shared and noisy, so compare modes within one run.

Usage: bench/rejuvenate.py [--reps N] [--sizes 256,1024,4096] [--vms 1,2,4] [--out DIR]
Needs: target/release/vmcsnap (make build), matplotlib (pip-installed if missing).
"""
import argparse, json, os, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")
MODES = ["warm", "saved", "cold"]


def run(run_dir, *args):
    try:
        return benchlib.run(VMCSNAP, run_dir, *args)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--vms", default="1,2,4")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
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
