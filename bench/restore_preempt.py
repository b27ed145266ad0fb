#!/usr/bin/env python3
"""Benchmark: demand-fault latency with and without QEMU 10.0's postcopy-preempt channel
(`vmcsnap restore --preempt`, issue 30 item 5), side by side in one run.

One cluster under QEMU 10.0 (scripts/install-qemu.sh 10.0) with one lab guest (--mib, default
256 MiB) running memtouch, which rewrites pages as fast as it can over its hot set (-m/-H), so
that the restored guest faults while the background push fills the migration socket. One hot
snapshot of it; then REPS times, per mode (workingset, lazy), the two variants interleaved (the
order alternates between reps, so that the other helpers' load hits both alike):
  * `restore --wait SNAP --mode MODE`            (one channel: a requested page waits behind
                                                  what is queued on the socket);
  * `restore --wait SNAP --mode MODE --preempt`  (requested pages on the preempt channel).
Per restore, from the report: demand faults, pages on the preempt channel, the page source's
service time per fault (request read -> page written: p50/p90/max), and QEMU's own measure of
the vCPUs' blocked time (`postcopy-vcpu-blocktime`, summed over vCPUs) per demand fault.
Prints medians over the reps and the preempt/one-channel ratios; writes
bench/results/restore_preempt.json and restore_preempt.png.

Usage: bench/restore_preempt.py [--reps 5] [--mib 256] [--modes workingset,lazy] [--bin PATH]
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qemu10():
    out = subprocess.run([os.path.join(ROOT, "scripts", "install-qemu.sh"), "10.0"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def vmcsnap(binary, run_dir, qemu, *args):
    env = dict(os.environ, VMCSNAP_QEMU=qemu)
    out = subprocess.run([binary, "--run-dir", run_dir, *args], capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        raise benchlib.Failed(f"vmcsnap {' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout) if "--json" in args else out.stdout


def row_of(r, mode, preempt, rep):
    served = r.get("demand_served_ms") or {}
    faults = r.get("demand_faults") or 0
    bt = r.get("vcpu_blocktime_ms")
    return {"mode": mode, "preempt": preempt, "rep": rep,
            "latency_ms": r["restore_latency_ms"], "full_load_ms": r["full_load_ms"],
            "demand_faults": faults, "pages_on_preempt": r.get("pages_on_preempt"),
            "served_p50_ms": served.get("p50"), "served_p90_ms": served.get("p90"),
            "served_max_ms": served.get("max"), "vcpu_blocktime_ms": bt,
            "blocktime_per_fault_ms": (bt / faults) if (bt is not None and faults) else None}


KEYS = ["served_p50_ms", "served_p90_ms", "served_max_ms", "blocktime_per_fault_ms",
        "vcpu_blocktime_ms", "demand_faults", "pages_on_preempt", "latency_ms", "full_load_ms"]


def summarise(rows, modes):
    summary = {}
    for mode in modes:
        for pre in (False, True):
            rs = [r for r in rows if r["mode"] == mode and r["preempt"] == pre]
            s = {k: benchlib.med([r[k] for r in rs]) for k in KEYS}
            # Pooled over the reps: every fault weighs the same.
            faults = sum(r["demand_faults"] for r in rs if r["vcpu_blocktime_ms"] is not None)
            blocked = sum(r["vcpu_blocktime_ms"] for r in rs if r["vcpu_blocktime_ms"] is not None)
            s["pooled_blocked_per_fault_ms"] = blocked / faults if faults else float("nan")
            s["total_blocked_ms"] = blocked
            s["total_faults"] = faults
            summary[f"{mode}{'+preempt' if pre else ''}"] = s
    return summary


def plot(summary, modes, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    metrics = [("served_p50_ms", "served p50"), ("served_p90_ms", "served p90"),
               ("blocktime_per_fault_ms", "vCPU blocked / fault")]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        xs = range(len(metrics))
        for k, (pre, label) in enumerate([(False, "one channel"), (True, "--preempt")]):
            s = summary[f"{mode}{'+preempt' if pre else ''}"]
            ax.bar([x + 0.38 * k for x in xs], [s[m] for m, _ in metrics], 0.38, label=label)
        ax.set_xticks([x + 0.19 for x in xs])
        ax.set_xticklabels([n for _, n in metrics])
        ax.set_ylabel("ms (median over restores)")
        ax.set_title(f"{mode} restore, QEMU 10.0 (TCG)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--modes", default="workingset,lazy")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "vmcsnap"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    modes = a.modes.split(",")
    q = qemu10()
    d = tempfile.mkdtemp(prefix="vmcsnap-bench-preempt-", dir="/var/tmp")
    rows = []
    try:
        spec = os.path.join(d, "spec.toml")
        with open(spec, "w") as f:
            f.write(f'[cluster]\nname = "preempt"\naccel = "auto"\n\n[[vm]]\nname = "lab"\n'
                    f'memory_mib = {a.mib}\nworkload = """\nmemtouch -m 96 -H 48 -r 0 &\n"""\n')
        vmcsnap(a.bin, d, q, "up", spec, "--json")
        time.sleep(10)  # memtouch writes its whole set once, then rewrites the hot part
        vmcsnap(a.bin, d, q, "snapshot", "lab", "--mode", "hot", "--name", "pre", "--json")
        for rep in range(a.reps):
            for mode in modes:
                order = [False, True] if rep % 2 == 0 else [True, False]
                for pre in order:
                    vmcsnap(a.bin, d, q, "stop", "lab")
                    args = ["restore", "--wait", "pre", "--mode", mode, "--json"]
                    r = vmcsnap(a.bin, d, q, *(args + (["--preempt"] if pre else [])))
                    row = row_of(r, mode, pre, rep)
                    rows.append(row)
                    print(f"{mode:<10} {'preempt' if pre else 'one-chan':<8} rep {rep}: "
                          f"{row['demand_faults']} faults, {row['pages_on_preempt']} on preempt, "
                          f"served p50 {row['served_p50_ms']} p90 {row['served_p90_ms']} ms, "
                          f"vCPU blocked {row['vcpu_blocktime_ms']} ms", file=sys.stderr)
    finally:
        try:
            vmcsnap(a.bin, d, q, "down")
        except benchlib.Failed as e:
            print(e, file=sys.stderr)
        shutil.rmtree(d, ignore_errors=True)
    summary = summarise(rows, modes)
    print(f"\n{a.mib} MiB lab guest under QEMU 10.0, medians of {a.reps} interleaved restores each")
    print(f"{'variant':<20}{'faults':>8}{'on preempt':>11}{'served p50':>11}{'p90':>8}"
          f"{'max':>8}{'blocked/fault':>14}{'pooled':>8}")
    for k, s in summary.items():
        print(f"{k:<20}{s['demand_faults']:>8.0f}{s['pages_on_preempt']:>11.0f}"
              f"{s['served_p50_ms']:>11.3f}{s['served_p90_ms']:>8.3f}{s['served_max_ms']:>8.1f}"
              f"{s['blocktime_per_fault_ms']:>14.3f}{s['pooled_blocked_per_fault_ms']:>8.3f}")
    ratios = {}
    for mode in modes:
        off, on = summary[mode], summary[f"{mode}+preempt"]
        ratios[mode] = {k: (on[k] / off[k] if off[k] else float("nan"))
                        for k in ["served_p50_ms", "served_p90_ms", "blocktime_per_fault_ms",
                                  "pooled_blocked_per_fault_ms", "demand_faults"]}
        print(f"{mode}: preempt / one channel: " + ", ".join(
            f"{k} {v:.2f}" for k, v in ratios[mode].items()))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "restore_preempt.json"), "w") as f:
        json.dump({"mib": a.mib, "reps": a.reps, "modes": modes, "rows": rows,
                   "summary": summary, "ratios": ratios,
                   "command": " ".join(["bench/restore_preempt.py"] + sys.argv[1:])}, f, indent=1)
    plot(summary, modes, os.path.join(a.out, "restore_preempt.png"))


if __name__ == "__main__":
    main()
