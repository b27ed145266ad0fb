#!/usr/bin/env python3
"""Benchmark: locality block size and prefetch depth against demand faults and latency (issue 23, item 5).

One lab VM (1 GiB by default) whose memtouch reads 10% of RAM and writes 1% (as bench/learning.py).
Three full hot snapshots of it, one per block size (--block-pages 16, 64, 256), taken one after the
other. Then, REPS times, interleaved over every (block size, prefetch depth 0/1/4, mode lazy/workingset)
cell, with the snapshot's learned records removed before each restore (every restore is a first one):
demand faults in the first 10 s, pages sent on demand, restore latency and full load.

Writes bench/results/locality.json and locality.png, and prints a table of medians.
Usage: bench/locality.py [--reps 3] [--mem 1024] [--out DIR]
Needs: target/release/vmcsnap, root (drops the page cache), matplotlib.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import learning  # noqa: E402
import restore as rb  # noqa: E402

BLOCKS = [16, 64, 256]
PREFETCH = [0, 1, 4]
MODES = ["lazy", "workingset"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(rb.ROOT, "bench", "results"))
    a = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-lc-", dir="/var/tmp")
    spec = os.path.join(run_dir, "spec.toml")
    with open(spec, "w") as f:
        f.write(learning.spec(a.mem, 3000).replace("bench-ln", "bench-lc"))
    rows = []
    try:
        benchlib.run(rb.VMCSNAP, run_dir, "up", spec, "--json")
        time.sleep(rb.SAMPLER_WAIT_S)
        for b in BLOCKS:
            benchlib.run(rb.VMCSNAP, run_dir, "snapshot", "vm0", "--mode", "hot", "--name", f"b{b}",
                         "--full", "--block-pages", str(b), "--json")
        for rep in range(a.reps):
            for b in BLOCKS:
                for pf in PREFETCH:
                    for mode in MODES:
                        shutil.rmtree(os.path.join(run_dir, "snapshots", f"b{b}", "restores"), ignore_errors=True)
                        benchlib.drop_page_cache()
                        benchlib.run(rb.VMCSNAP, run_dir, "stop", "vm0")
                        r = benchlib.run(rb.VMCSNAP, run_dir, "restore", "--wait", f"b{b}", "--mode", mode,
                                         "--prefetch-blocks", str(pf), "--json")
                        time.sleep(3)
                        row = {"rep": rep, "block_pages": b, "prefetch": pf, "mode": mode,
                               "faults_first_10s": sum(r["demand_faults_per_100ms"]),
                               **{k: r[k] for k in ["demand_faults", "pages_on_demand", "restore_latency_ms",
                                                    "full_load_ms", "ws_pages"]}}
                        rows.append(row)
                        print(f"  rep {rep} block {b:>3} prefetch {pf} {mode:<10}: {row['faults_first_10s']:>5} faults, "
                              f"latency {row['restore_latency_ms']:6.0f} ms, full load {row['full_load_ms']:6.0f} ms",
                              file=sys.stderr)
    finally:
        subprocess.run([rb.VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    med = benchlib.med
    summary = {}
    for b in BLOCKS:
        for pf in PREFETCH:
            for mode in MODES:
                rs = [r for r in rows if (r["block_pages"], r["prefetch"], r["mode"]) == (b, pf, mode)]
                summary[f"{mode} block={b} prefetch={pf}"] = {
                    k: med([r[k] for r in rs]) for k in ["faults_first_10s", "pages_on_demand",
                                                          "restore_latency_ms", "full_load_ms"]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "locality.json"), "w") as f:
        json.dump({"memory_mib": a.mem, "reps": a.reps, "summary": summary, "rows": rows}, f, indent=1)
    plt = benchlib.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode in zip(axes, MODES):
        for pf in PREFETCH:
            ax.plot(BLOCKS, [summary[f"{mode} block={b} prefetch={pf}"]["faults_first_10s"] for b in BLOCKS],
                    "o-", label=f"prefetch {pf}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pages per locality block")
        ax.set_ylabel("demand faults in the first 10 s (median)")
        ax.set_title(mode)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "locality.png"), dpi=110)
    print(f"{'cell':<36} {'faults 10s':>10} {'on demand':>10} {'latency':>9} {'full load':>10}")
    for k, v in summary.items():
        print(f"{k:<36} {v['faults_first_10s']:>10} {v['pages_on_demand']:>10} "
              f"{v['restore_latency_ms']:>9.0f} {v['full_load_ms']:>10.0f}")


if __name__ == "__main__":
    main()
