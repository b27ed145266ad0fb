#!/usr/bin/env python3
"""Benchmark: the Redis cluster of examples/redis.toml (primary, replica, redisload client; Debian
images, q35): snapshot pauses, cluster snapshot backoff, restore latency, warm rejuvenation and boot,
side by side in one run. Boots the cluster (`up --json`: boot_ms per VM), waits for the replica's
link and redisload's status lines, then REPS times: a hot cluster snapshot, and per VM:
  * stop-copy snapshot; QEMU's own stop-copy of the VM into a file (stop, `migrate exec:cat`, cont,
    through its second QMP socket: kind qemu-stop-copy);
  * hot snapshot H; `stop VM` + `restore H --mode workingset`, then the same with --mode eager
    (learned records removed first); qemu-eager: a fresh QEMU with the VM's command line (sockets,
    files, RAM moved aside, disk on an overlay of H's frozen disk), `-incoming defer`,
    `migrate-incoming exec:cat FILE`, `cont`: QEMU start -> RESUME (as bench/restore.py);
  * `rejuvenate --vm VM --mode warm`.
The page cache stays warm for all three restores alike. A restore rolls the VM back to H, so
redisload reports the writes acknowledged after H as lost (REDISLOAD-CORRUPTION; counted, expected).
A failed measurement records its error; the bench carries on.
Goals (issue): hot pause <= 1/50 stop-copy's; workingset <= 0.1x QEMU eager; warm restart <= 300 ms.
Writes OUT/redis.json (rows, medians, ratios, goals) and OUT/redis.png; prints a markdown table.
Usage: bench/redis.py [--reps 3] [--out bench/results] [--replot] [--spec F] [--bin F] [--keep]
Needs target/release/vmcsnap (make build), matplotlib (apt-get install python3-matplotlib).
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from restore import Qmp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.path.join(ROOT, "target", "release", "vmcsnap")
GOAL_PAUSE_RATIO, GOAL_RESTORE_RATIO, GOAL_WARM_MS = 1 / 50, 0.1, 300.0
GAP_S = 3  # let the guest settle between measurements


def run(run_dir, *args):
    return benchlib.run(VMCSNAP, run_dir, *args)


def err_text(e):
    lines = [l for l in str(e).strip().splitlines() if l.strip()]
    return " | ".join(lines[-3:])[-600:]


def wait_for(what, pred, limit=600):
    deadline = time.time() + limit
    while time.time() < deadline:
        try:
            if pred():
                return time.time()
        except benchlib.Failed:
            pass
        time.sleep(2)
    raise benchlib.Failed(f"timed out after {limit} s waiting for {what}")


def vm_info(run_dir, vm):
    """The VM's entry in `status --json`, or {} (also when status fails)."""
    try:
        return next((v for v in run(run_dir, "status", "--json")["vms"] if v["name"] == vm), {})
    except benchlib.Failed:
        return {}


def clean(x):
    """NaN -> None, so that the JSON file is strict JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def drop_snapshot(run_dir, name):
    """Deletes a snapshot's memory image. Its frozen disk (snapshots/.disks/NAME, hard links) stays:
    a VM restored from it runs on an overlay whose backing file is that path."""
    shutil.rmtree(os.path.join(run_dir, "snapshots", name), ignore_errors=True)


def qemu_dump(run_dir, vm, out_file):
    """QEMU's own stop-copy of VM into a file, through its second QMP socket; returns its pause in ms."""
    q = Qmp(os.path.join(run_dir, "cluster", vm, "sample.sock"))
    try:
        return benchlib.qemu_stop_copy(q, out_file)
    finally:
        q.close()


def anchor_args(cmdline, work, frozen_disk):
    """An image VM's QEMU command line, rewritten for a throwaway eager-restore destination: its
    QMP, console, events, guest-agent and NIC sockets/files and its RAM file moved into WORK, the disk
    on an overlay of the snapshot's frozen disk, `-incoming` replaced by `-incoming defer`."""
    overlay = os.path.join(work, "anchor.qcow2")
    for f in ("anchor.qcow2", "anchor-qmp.sock", "anchor-net.sock", "anchor-qga.sock"):
        os.path.exists(os.path.join(work, f)) and os.remove(os.path.join(work, f))
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", frozen_disk, overlay], check=True)

    def sub(a, key, value):
        return ",".join(f"{key}={value}" if p.startswith(key + "=") else p for p in a.split(","))
    args, qmp_done, skip = [], False, False
    for i, a in enumerate(cmdline):
        if skip:
            skip = False
            continue
        if a in ("-qmp", "-incoming"):
            skip = True
            if a == "-qmp" and not qmp_done:
                args += ["-qmp", f"unix:{work}/anchor-qmp.sock,server=on,wait=off"]
                qmp_done = True
            continue
        if i > 0 and cmdline[i - 1] == "-name":
            a = "guest=anchor,process=vmcsnap-bench-anchor"
        elif a.startswith("memory-backend-file,"):
            a = sub(a, "mem-path", f"/dev/shm/vmcsnap-bench-redis-anchor-{os.getpid()}")
        elif a.startswith("file,id=con,"):
            a = sub(a, "path", f"{work}/anchor-console.log")
        elif a.startswith("file,id=events,"):
            a = sub(a, "path", f"{work}/anchor-events.log")
        elif a.startswith("socket,id=qga"):
            a = sub(a, "path", f"{work}/anchor-qga.sock")
        elif a.startswith("driver=qcow2,"):
            a = sub(a, "file.filename", overlay)
        elif a.startswith("stream,"):
            a = sub(a, "addr.path", f"{work}/anchor-net.sock")
        args.append(a)
    return args + ["-incoming", "defer"]


def qemu_eager(cmdline, work, frozen_disk, dump):
    """QEMU's own eager restore: QEMU start -> RESUME (ms), and start -> state loaded (ms)."""
    args = anchor_args(cmdline, work, frozen_disk)
    t0 = time.time()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(f"{work}/anchor-qemu.log", "w"))
    try:
        q = Qmp(f"{work}/anchor-qmp.sock")
        return benchlib.qemu_load_and_start(q, dump, t0, f"{work}/anchor-qemu.log")
    finally:
        p.kill()
        p.wait()
        shm = f"/dev/shm/vmcsnap-bench-redis-anchor-{os.getpid()}"
        if os.path.exists(shm):
            os.remove(shm)


def measure(rows, kind, vm, rep, fn):
    """Runs one measurement; appends its row (or its error) and returns the result or None."""
    try:
        r = fn()
    except (benchlib.Failed, OSError, subprocess.CalledProcessError, StopIteration, KeyError) as e:
        rows.append({"kind": kind, "vm": vm, "rep": rep, "error": err_text(e)})
        print(f"  rep {rep} {vm:<8} {kind:<16} FAILED: {err_text(e)}", file=sys.stderr)
        return None
    rows.append({"kind": kind, "vm": vm, "rep": rep, **r})
    print(f"  rep {rep} {vm:<8} {kind:<16} " + (f"{r['value_ms']:9.1f} ms" if "value_ms" in r else str(r)), file=sys.stderr)
    return r


def restore_vm(run_dir, vm, snap, mode, stop=True):
    shutil.rmtree(os.path.join(run_dir, "snapshots", snap, "restores"), ignore_errors=True)
    if stop:
        run(run_dir, "stop", vm)
    r = run(run_dir, "restore", "--wait", snap, "--mode", mode, "--json")
    time.sleep(GAP_S)  # background loading finishes; the guest settles
    keys = ("restore_latency_ms", "run_sent_ms", "full_load_ms", "ws_pages", "wss", "demand_faults", "pages_total")
    return {"value_ms": r["restore_latency_ms"], **{k: r.get(k) for k in keys}}


def one_vm(run_dir, vm, rep, rows, work):
    def snap(mode, name):
        r = run(run_dir, "snapshot", vm, "--mode", mode, "--name", name, "--json")
        keys = ("downtime_ms", "duration_ms", "stream_bytes", "pages_guest_written")
        return {"value_ms": r["downtime_ms"], **{k: r[k] for k in keys}, "frozen_disk": r["frozen_disk"]}
    sc = f"sc-{vm}-{rep}"
    measure(rows, "stop-copy", vm, rep, lambda: snap("stop-copy", sc))
    drop_snapshot(run_dir, sc)
    time.sleep(GAP_S)
    dump = os.path.join(work, f"{vm}.mig")
    cmdline = None
    try:
        pid = vm_info(run_dir, vm)["pid"]
        cmdline = [c.decode() for c in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:-1]]
    except (KeyError, OSError) as e:
        rows.append({"kind": "qemu-stop-copy", "vm": vm, "rep": rep, "error": f"command line: {err_text(e)}"})
    if cmdline:
        measure(rows, "qemu-stop-copy", vm, rep, lambda: {"value_ms": qemu_dump(run_dir, vm, dump)})
    time.sleep(GAP_S)
    hot = f"hot-{vm}-{rep}"
    h = measure(rows, "hot", vm, rep, lambda: snap("hot", hot))
    if h is not None:
        for mode in ("workingset", "eager"):
            got = measure(rows, mode, vm, rep, lambda: restore_vm(run_dir, vm, hot, mode))
            if got is None and vm_info(run_dir, vm).get("state") != "running":
                measure(rows, "recover", vm, rep, lambda: restore_vm(run_dir, vm, hot, "eager", stop=False))
        if cmdline and os.path.exists(dump):
            measure(rows, "qemu-eager", vm, rep, lambda: {
                "value_ms": (q := qemu_eager(cmdline, work, h["frozen_disk"], dump))["restore_latency_ms"], **q})
    drop_snapshot(run_dir, hot)
    if os.path.exists(dump):
        os.remove(dump)
    time.sleep(GAP_S)
    measure(rows, "warm", vm, rep, lambda: (lambda r: {"value_ms": r["downtime_ms"], **{
        k: r[k] for k in ("save_ms", "restart_ms", "load_ms", "quit_ms")}})(
        run(run_dir, "rejuvenate", "--vm", vm, "--mode", "warm", "--json")["reports"][0]))
    time.sleep(GAP_S)


def cluster_snap(run_dir, rep):
    name = f"cluster-{rep}"
    try:
        r = run(run_dir, "snapshot", "--cluster", "--mode", "hot", "--name", name, "--json")
    finally:
        drop_snapshot(run_dir, name)
    return {"value_ms": r["backoff"]["avg_ms"], "backoff_avg_ms": r["backoff"]["avg_ms"],
            "backoff_max_ms": r["backoff"]["max_ms"], "pairs": r["backoff"]["pairs"],
            "downtime_avg_ms": r["downtime_avg_ms"], "downtime_max_ms": r["downtime_max_ms"],
            "duration_ms": r["duration_ms"], "vm_downtime_ms": {v["vm"]: v["downtime_ms"] for v in r["vms"]}}


def redisload_state(run_dir, client):
    text = run(run_dir, "console", client, "--bytes", "0")
    lines = benchlib.complete_lines(text)
    status = [l for l in lines if "redisload: t=" in l and " sets=" in l]
    return {"last_status": status[-1].split("]: ", 1)[-1] if status else None,
            "corruption_lines": sum(1 for l in lines if "REDISLOAD-CORRUPTION" in l)}


def summarize(res):
    rows, vms = res["rows"], [v["name"] for v in res.get("up", {}).get("vms", [])]
    med = benchlib.med

    def m(kind, vm=None):
        return med([r["value_ms"] for r in rows if r["kind"] == kind and "error" not in r and vm in (None, r["vm"])])

    def ratio(a, b):
        return a / b if b == b and b and a == a else float("nan")
    s = {}
    for vm in vms + ["all"]:
        v = None if vm == "all" else vm
        e = {k: m(k, v) for k in ("hot", "stop-copy", "qemu-stop-copy", "workingset", "eager", "qemu-eager", "warm")}
        e["hot_over_stop_copy"] = ratio(e["hot"], e["stop-copy"])
        e["workingset_over_qemu_eager"] = ratio(e["workingset"], e["qemu-eager"])
        e["eager_over_qemu_eager"] = ratio(e["eager"], e["qemu-eager"])
        e["boot_ms"] = next((u["boot_ms"] for u in res["up"]["vms"] if u["name"] == vm), None) if v else \
            max([u["boot_ms"] for u in res.get("up", {}).get("vms", [])] or [float("nan")])
        e["goals"] = {"hot_pause_le_1/50_stop_copy": e["hot_over_stop_copy"] <= GOAL_PAUSE_RATIO,
                      "workingset_le_0.1x_qemu_eager": e["workingset_over_qemu_eager"] <= GOAL_RESTORE_RATIO,
                      "warm_le_300ms": e["warm"] <= GOAL_WARM_MS}
        e["failed"] = sum(1 for r in rows if "error" in r and v in (None, r["vm"]))
        s[vm] = e
    cl = [r for r in rows if r["kind"] == "cluster" and "error" not in r]
    s["cluster"] = {k: med([r[k] for r in cl]) for k in ("backoff_avg_ms", "backoff_max_ms", "downtime_avg_ms",
                                                          "downtime_max_ms", "duration_ms")}
    s["cluster"]["ok"] = f"{len(cl)}/{sum(1 for r in rows if r['kind'] == 'cluster')}"
    res["summary"] = s
    return s


def table(res):
    s = res["summary"]
    f = lambda x, d=1: "-" if x is None or x != x else f"{x:.{d}f}"  # noqa: E731
    out = ["| VM | boot s | hot pause ms | stop-copy pause ms | hot / stop-copy | QEMU stop-copy pause ms "
           "| workingset ms | eager ms | QEMU eager ms | workingset / QEMU | warm downtime ms |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for vm, e in s.items():
        if vm == "cluster":
            continue
        out.append(f"| {vm} | {f((e['boot_ms'] or float('nan')) / 1000)} | {f(e['hot'])} | {f(e['stop-copy'])} | "
                   f"{f(e['hot_over_stop_copy'], 3)} | {f(e['qemu-stop-copy'])} | {f(e['workingset'])} | {f(e['eager'])} | "
                   f"{f(e['qemu-eager'])} | {f(e['workingset_over_qemu_eager'], 3)} | {f(e['warm'])} |")
    c = s["cluster"]
    out.append(f"\nHot cluster snapshot ({c['ok']} ok): backoff avg {f(c['backoff_avg_ms'])} ms, max {f(c['backoff_max_ms'])} ms; "
               f"per-VM pause avg {f(c['downtime_avg_ms'])} ms, max {f(c['downtime_max_ms'])} ms; duration {f(c['duration_ms'], 0)} ms.")
    out.append("(all: medians over every VM's runs; its boot is the slowest VM's.)")
    g = s["all"]["goals"]
    out.append("Goals (medians over all VMs): " + "; ".join(f"{k}: {'met' if ok else 'NOT met'}" for k, ok in g.items()))
    errs = [r for r in res["rows"] if "error" in r]
    if errs or res.get("error"):
        out.append(f"Failures: {len(errs)} measurement(s)" + (f"; run: {res['error']}" if res.get("error") else ""))
    return "\n".join(out)


def plot(res, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    s = res["summary"]
    vms = [v for v in s if v not in ("cluster", "all")]
    fig, ax = plt.subplots(2, 3, figsize=(14, 7.5))

    def bars(a, kinds, title, log=True, goal=None):
        w = 0.8 / len(kinds)
        for j, k in enumerate(kinds):
            a.bar([i + j * w for i in range(len(vms))], [s[v][k] for v in vms], w, label=k)
        a.set_xticks([i + 0.4 - w / 2 for i in range(len(vms))], vms)
        if goal:
            a.axhline(goal, color="gray", ls=":", lw=1, label=f"goal {goal:.0f} ms")
        a.set_yscale("log") if log else a.set_ylim(0, max(a.get_ylim()[1], 1.15 * (goal or 0)))
        a.set_title(title, fontsize=10)
        a.set_ylabel("ms (median)")
        a.legend(fontsize=7)
    bars(ax[0][0], ["hot", "stop-copy", "qemu-stop-copy"], "Snapshot pause per VM")
    bars(ax[0][1], ["workingset", "eager", "qemu-eager"], "Restore latency (request -> guest running)")
    bars(ax[0][2], ["warm"], "Warm rejuvenation downtime", log=False, goal=GOAL_WARM_MS)
    c = s["cluster"]
    ax[1][0].bar(["backoff avg", "backoff max", "pause avg", "pause max"],
                 [c["backoff_avg_ms"], c["backoff_max_ms"], c["downtime_avg_ms"], c["downtime_max_ms"]])
    ax[1][0].set_title("Hot cluster snapshot (3 VMs)", fontsize=10)
    ax[1][0].set_ylabel("ms (median)")
    ax[1][1].bar(vms, [(s[v]["boot_ms"] or 0) / 1000 for v in vms])
    ax[1][1].set_title("Boot to ready (up)", fontsize=10)
    ax[1][1].set_ylabel("s")
    ratios = [s["all"]["hot_over_stop_copy"], s["all"]["workingset_over_qemu_eager"]]
    ax[1][2].bar(["hot / stop-copy", "workingset / QEMU eager"], ratios, color=["C0", "C1"])
    ax[1][2].scatter([0, 1], [GOAL_PAUSE_RATIO, GOAL_RESTORE_RATIO], marker="_", s=800, color="k", label="goal")
    ax[1][2].set_yscale("log")
    ax[1][2].set_title("Ratios (medians over all VMs)", fontsize=10)
    ax[1][2].legend(fontsize=7)
    fig.suptitle("vmcsnap on the Redis cluster (examples/redis.toml, q35, TCG)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    global VMCSNAP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--spec", default=os.path.join(ROOT, "examples", "redis.toml"))
    ap.add_argument("--replot", action="store_true", help="re-summarize and re-plot OUT/redis.json, measure nothing")
    ap.add_argument("--bin", default=VMCSNAP, help="the vmcsnap binary (copied into the run directory)")
    ap.add_argument("--keep", action="store_true", help="leave the run directory (after `down`) for inspection")
    a = ap.parse_args()
    jpath, ppath = os.path.join(a.out, "redis.json"), os.path.join(a.out, "redis.png")
    if a.replot:
        res = json.load(open(jpath))
        summarize(res)
    else:
        if not os.access(a.bin, os.X_OK):
            raise SystemExit(f"{a.bin} missing: run `make build` first")
        os.makedirs(a.out, exist_ok=True)
        run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-redis-", dir="/tmp")
        # A private copy of the binary: the agent execs itself (/proc/self/exe) for every snapshot's
        # capture, which fails once a rebuild has replaced target/release/vmcsnap mid-run.
        built = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(os.path.getmtime(a.bin)))
        VMCSNAP = shutil.copy2(a.bin, os.path.join(run_dir, "vmcsnap"))
        work = os.path.join(run_dir, "anchor")
        os.makedirs(work)
        res = {"bench": "redis", "command": " ".join(sys.argv), "started": time.time(), "reps": a.reps,
               "spec": os.path.relpath(a.spec, ROOT), "run_dir": run_dir, "rows": [], "cold_cache": False,
               "binary": {"path": a.bin, "built": built}, "git_head": subprocess.run(
                   ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
        try:
            t = time.time()
            res["up"] = run(run_dir, "up", a.spec, "--json")
            ips = {v["name"]: v["ip"].split("/")[0] for v in res["up"]["vms"]}
            print(f"up in {time.time() - t:.0f} s: " + ", ".join(f"{v['name']} {v['boot_ms']} ms" for v in res["up"]["vms"]),
                  file=sys.stderr)
            replica = "replica"
            t_rep = wait_for("the replica's link", lambda: "master_link_status:up" in run(
                run_dir, "exec", "--", "redis-cli", "-h", ips[replica], "info", "replication"))
            t_load = wait_for("redisload's status lines", lambda: sum(
                1 for l in run(run_dir, "console", "client").splitlines() if "redisload: t=" in l and "sets=" in l) >= 2)
            res["wait_after_up_s"] = {"replica_link": t_rep - t, "redisload": t_load - t}
            for rep in range(a.reps):
                measure(res["rows"], "cluster", "all", rep, lambda: cluster_snap(run_dir, rep))
                time.sleep(GAP_S)
                for vm in ips:
                    one_vm(run_dir, vm, rep, res["rows"], work)
                with open(jpath, "w") as f:
                    json.dump(res, f, indent=1)
            measure(res["rows"], "end-state", "all", a.reps, lambda: {**redisload_state(run_dir, "client"), "replica":
                    [l for l in run(run_dir, "exec", "--", "redis-cli", "-h", ips[replica], "info", "replication").splitlines()
                     if l.startswith("master_link_status")]})
        except (benchlib.Failed, StopIteration, KeyError) as e:
            res["error"] = err_text(e)
            print(f"FAILED: {res['error']}", file=sys.stderr)
        finally:
            try:
                res["agent_failures"] = [l[:400] for l in open(os.path.join(run_dir, "agent.log")) if "request failed" in l]
            except OSError:
                pass
            down = subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True, text=True)
            res["down"] = down.returncode == 0 or down.stderr[-300:]
            if not a.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
        res["finished"] = time.time()
        res.setdefault("up", {"vms": []})
        summarize(res)
    with open(jpath, "w") as f:
        json.dump(clean(res), f, indent=1)
    plot(res, ppath)
    print(table(res))
    print(f"\nwrote {jpath} and {ppath}")


if __name__ == "__main__":
    main()
