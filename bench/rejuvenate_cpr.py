#!/usr/bin/env python3
"""Benchmark: warm rejuvenation on QEMU 10.0 vs QEMU's own cpr-transfer, and the 7.2 -> 10.0
upgrade vs a same-version warm restart (issue 30, items 4-5).

Side by side in one run, per guest size (lab guest, 256 MiB and 1 GiB by default), REPS rounds,
each round in this order (so that the kinds are interleaved, not run in blocks):

  warm-7.2        vmcsnap warm restart, QEMU 7.2 -> 7.2 (VM of a vmcsnap cluster)
  upgrade         vmcsnap warm restart with --qemu, 7.2 -> 10.0 (the same VM)
  warm-10.0       vmcsnap warm restart, 10.0 -> 10.0 (the same VM)
  vmcsnap-cpr     vmcsnap rejuvenate --mode cpr, QEMU 10.0's cpr-transfer driven by the agent
                  (the same VM; the warm restarts onto 10.0 made it cpr-ready)
  cpr-transfer    QEMU 10.0's cpr-transfer, 10.0 -> 10.0, of a lab guest QEMU started by this
                  script with the same devices (vmcsnap does not run it: the new QEMU must start
                  beside the old one, on other socket paths)
  (then a cold restart takes the VM back to 7.2 for the next round: not measured)

Downtime is QEMU's own: the old QEMU's STOP event to the new QEMU's RESUME event (the
timestamps QEMU puts on its QMP events), for vmcsnap and cpr-transfer alike. For cpr-transfer the
new QEMU is started, and its device model built, while the old one still runs the guest (that is
the point of the mode); the old one stops once the new one listens on the main channel, and the
guest's RAM stays in place (memory-backend-file share=on, x-ignore-shared, aux-ram-share=on).

Writes bench/results/rejuvenate-cpr.json and rejuvenate-cpr.png (median downtime per kind and
size) and prints the table. Medians; the machine is shared and noisy: compare within one run.

Usage: bench/rejuvenate_cpr.py [--reps 5] [--sizes 256,1024] [--out DIR]
Needs: target/release/vmcsnap ($VMCSNAP_BIN names another), QEMU 10.0 from
scripts/install-qemu.sh 10.0 ($VMCSNAP_QEMU10 names another), the guest assets (vmcsnap guest
build), matplotlib (pip-installed if missing).
"""
import argparse, base64, glob, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from restore import Qmp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VMCSNAP = os.environ.get("VMCSNAP_BIN") or os.path.join(ROOT, "target", "release", "vmcsnap")
KINDS = ["warm-7.2", "upgrade", "warm-10.0", "vmcsnap-cpr", "cpr-transfer"]
WORKLOAD = "memtouch -m 32 &\n"


def qemu10():
    q = os.environ.get("VMCSNAP_QEMU10")
    if q:
        return q
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install-qemu.sh"), "10.0"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def qemu7():
    return shutil.which("qemu-system-x86_64")


def run(run_dir, *args, env=None):
    out = subprocess.run([VMCSNAP, "--run-dir", run_dir, *args], capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise SystemExit(f"vmcsnap {' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout) if "--json" in args else out.stdout


def warm(run_dir, qemu, mode="warm"):
    r = run(run_dir, "rejuvenate", "--vm", "v", "--mode", mode, "--qemu", qemu, "--json")["reports"][0]
    if r["fell_back_to_old_binary"]:
        raise SystemExit(f"the restart fell back: {r}")
    return r["downtime_ms"]


def wait_memtouch(run_dir, n_before, limit=180):
    """Waits for a memtouch report beyond the first n_before (the guest runs memtouch again)."""
    path = os.path.join(run_dir, "cluster", "v", "console.log")
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            lines = [l for l in f if l.startswith("memtouch: t=")]
        if len(lines) > n_before:
            if "errors=0" not in lines[-1]:
                raise SystemExit(f"memtouch reports errors: {lines[-1]}")
            return len(lines)
        time.sleep(0.5)
    raise SystemExit("memtouch did not report after the restart")


def memtouch_count(run_dir):
    with open(os.path.join(run_dir, "cluster", "v", "console.log"), errors="replace") as f:
        return sum(1 for l in f if l.startswith("memtouch: t="))


class CprGuest:
    """A lab guest QEMU 10.0 run by this script, moved by cpr-transfer between two sets of
    socket paths (a and b) on one RAM file."""

    def __init__(self, q10, mem, work):
        self.q10, self.mem, self.work = q10, mem, work
        self.prefix = os.path.dirname(os.path.dirname(q10))
        self.ram = f"/dev/shm/vmcsnap-bench-cpr-{os.getpid()}-{mem}"
        guest = sorted(glob.glob(os.path.expanduser("~/.cache/vmcsnap/guest-*/vmlinuz")))
        if not guest:
            raise SystemExit("no guest assets: run `vmcsnap guest build`")
        self.assets = os.path.dirname(guest[-1])
        khz = None
        try:
            with open("/proc/cpuinfo") as f:
                khz = int(float(next(l for l in f if l.startswith("cpu MHz")).split(":")[1]) * 1000)
        except (OSError, StopIteration, ValueError):
            pass
        tsc = f" tsc_early_khz={khz} tsc=reliable no_timer_check" if khz else ""
        self.cmdline = ("console=ttyS0 quiet loglevel=1 panic=-1 cryptomgr.notests" + tsc +
                        " vmcsnap.name=cpr vmcsnap.ip=10.0.0.2/24 vmcsnap.run=" +
                        base64.b64encode(WORKLOAD.encode()).decode())
        self.side, self.proc, self.qmp = "a", None, None

    def args(self, side, incoming):
        d = lambda n: os.path.join(self.work, f"{side}-{n}")  # noqa: E731
        data = os.path.join(self.prefix, "share", "qemu")
        a = [self.q10, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
             "-M", "microvm,acpi=on,memory-backend=mem,aux-ram-share=on",
             "-accel", "tcg", "-cpu", "max", "-m", f"{self.mem}M", "-smp", "1",
             "-object", f"memory-backend-file,id=mem,size={self.mem}M,mem-path={self.ram},share=on",
             "-kernel", os.path.join(self.assets, "vmlinuz"), "-initrd", os.path.join(self.assets, "initrd.img"),
             "-append", self.cmdline,
             "-chardev", f"file,id=con,path={os.path.join(self.work, 'console.log')},append=on",
             "-serial", "chardev:con", "-qmp", f"unix:{d('qmp')},server=on,wait=off",
             "-netdev", f"stream,id=net0,server=on,addr.type=unix,addr.path={d('port')}",
             "-device", "virtio-net-device,netdev=net0,mac=52:54:00:12:34:56"]
        if os.path.isdir(data):
            a += ["-L", data]
        if incoming:
            a += ["-incoming", "defer", "-incoming", json.dumps(
                {"channel-type": "cpr", "addr": {"transport": "socket", "type": "unix", "path": d("cpr")}})]
        return a

    def env(self):
        mods = glob.glob(os.path.join(self.prefix, "lib", "*", "qemu"))
        return {**os.environ, **({"QEMU_MODULE_DIR": mods[0]} if mods else {})}

    def start(self):
        self.proc = subprocess.Popen(self.args("a", False), env=self.env(),
                                     stderr=open(os.path.join(self.work, "qemu.log"), "a"))
        self.qmp = Qmp(os.path.join(self.work, "a-qmp"))

    def transfer(self):
        """One cpr-transfer to the other side; returns STOP->RESUME in ms."""
        new_side = "b" if self.side == "a" else "a"
        for n in ("qmp", "port", "cpr", "main"):
            p = os.path.join(self.work, f"{new_side}-{n}")
            if os.path.exists(p):
                os.unlink(p)
        new = subprocess.Popen(self.args(new_side, True), env=self.env(),
                               stderr=open(os.path.join(self.work, "qemu.log"), "a"))
        try:
            return self._transfer(new, new_side)
        except BaseException:
            new.kill()
            new.wait()
            raise

    def _transfer(self, new, new_side):
        cpr_sock = os.path.join(self.work, f"{new_side}-cpr")
        deadline = time.monotonic() + 30
        while not os.path.exists(cpr_sock):
            if new.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the new QEMU did not listen on its cpr channel: {self.log_tail()}")
            time.sleep(0.005)
        old = self.qmp
        old.events.clear()
        caps = {"capabilities": [{"capability": "x-ignore-shared", "state": True}]}
        old.cmd("migrate-set-capabilities", caps)
        old.cmd("migrate-set-parameters", {"mode": "cpr-transfer"})
        main = {"transport": "socket", "type": "unix", "path": os.path.join(self.work, f"{new_side}-main")}
        channels = {"channels": [
            {"channel-type": "main", "addr": main},
            {"channel-type": "cpr", "addr": {"transport": "socket", "type": "unix", "path": cpr_sock}}]}
        # The socket file exists from bind(), a moment before listen(): retry a refused connect
        # (the old QEMU fails that migration before stopping the guest).
        for attempt in range(1000):
            try:
                old.cmd("migrate", channels)
                break
            except benchlib.Failed as e:
                if "Connection refused" not in str(e) or attempt == 999:
                    raise
                while old.cmd("query-migrate").get("status") not in (None, "failed", "cancelled", "completed"):
                    time.sleep(0.005)
                time.sleep(0.005)
        # The new QEMU opens its monitor once it has read the cpr channel.
        q = Qmp(os.path.join(self.work, f"{new_side}-qmp"))
        q.cmd("migrate-set-capabilities", caps)
        q.cmd("migrate-set-parameters", {"mode": "cpr-transfer"})
        q.cmd("migrate-incoming", {"channels": [{"channel-type": "main", "addr": main}]})
        resume = q.wait_event("RESUME")
        stop = old.wait_event("STOP")
        ts = lambda e: e["timestamp"]["seconds"] + e["timestamp"]["microseconds"] / 1e6  # noqa: E731
        downtime = (ts(resume) - ts(stop)) * 1000
        while old.cmd("query-migrate").get("status") not in ("completed", "failed"):
            time.sleep(0.005)
        old.cmd("quit")
        self.proc.wait()
        self.proc, self.qmp, self.side = new, q, new_side
        return downtime

    def memtouch_reports(self):
        with open(os.path.join(self.work, "console.log"), errors="replace") as f:
            return [l for l in f if l.startswith("memtouch: t=")]

    def log_tail(self):
        with open(os.path.join(self.work, "qemu.log"), errors="replace") as f:
            return f.read()[-1000:]

    def stop(self):
        if self.qmp:
            try:
                self.qmp.cmd("quit")
            except Exception:  # noqa: BLE001 (already gone)
                pass
        if self.proc:
            self.proc.wait()
        if os.path.exists(self.ram):
            os.unlink(self.ram)


def measure_size(mem, reps, q7, q10):
    run_dir = tempfile.mkdtemp(prefix="vmcsnap-bench-cpr-", dir="/var/tmp")
    spec = os.path.join(run_dir, "spec.toml")
    with open(spec, "w") as f:
        f.write(f'[cluster]\nname = "cpr"\naccel = "auto"\n\n[[vm]]\nname = "v"\nmemory_mib = {mem}\n'
                f'workload = """\n{WORKLOAD}"""\n')
    cpr = CprGuest(q10, mem, tempfile.mkdtemp(prefix="vmcsnap-bench-cprq-", dir="/var/tmp"))
    rows = []
    try:
        run(run_dir, "up", spec, "--json", env={"VMCSNAP_QEMU": q7})
        n = wait_memtouch(run_dir, 0)
        cpr.start()
        while not cpr.memtouch_reports():
            time.sleep(0.5)
        for rep in range(reps):
            row = {"memory_mib": mem, "rep": rep}
            row["warm-7.2"] = warm(run_dir, q7)
            n = wait_memtouch(run_dir, n)
            row["upgrade"] = warm(run_dir, q10)
            n = wait_memtouch(run_dir, n)
            row["warm-10.0"] = warm(run_dir, q10)
            n = wait_memtouch(run_dir, n)
            row["vmcsnap-cpr"] = warm(run_dir, q10, "cpr")
            n = wait_memtouch(run_dir, n)
            seen = len(cpr.memtouch_reports())
            row["cpr-transfer"] = cpr.transfer()
            deadline = time.monotonic() + 60
            while len(cpr.memtouch_reports()) <= seen:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the cpr-transferred guest stopped reporting: {cpr.log_tail()}")
                time.sleep(0.2)
            if "errors=0" not in cpr.memtouch_reports()[-1]:
                raise SystemExit(f"memtouch errors after cpr-transfer: {cpr.memtouch_reports()[-1]}")
            print(f"{mem} MiB round {rep}: " + ", ".join(f"{k} {row[k]:.1f}" for k in KINDS), file=sys.stderr)
            rows.append(row)
            # Back to 7.2 for the next round (boots again; not measured).
            run(run_dir, "rejuvenate", "--vm", "v", "--mode", "cold", "--qemu", q7, "--json")
            n = wait_memtouch(run_dir, memtouch_count(run_dir))
    finally:
        cpr.stop()
        subprocess.run([VMCSNAP, "--run-dir", run_dir, "down"], capture_output=True)
    return rows


def plot(summary, sizes, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(KINDS)
    for i, k in enumerate(KINDS):
        xs = [j + i * width for j in range(len(sizes))]
        ax.bar(xs, [summary[str(m)][k] for m in sizes], width, label=k)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))],
                  [f"{m} MiB" if m < 1024 else f"{m // 1024} GiB" for m in sizes])
    ax.set_ylabel("downtime, STOP to RESUME (ms, median)")
    ax.set_yscale("log")
    ax.set_title("Warm restarts, upgrade 7.2 -> 10.0, cpr-transfer (TCG)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="256,1024")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    q7, q10 = qemu7(), qemu10()
    rows = []
    for mem in sizes:
        print(f"== {mem} MiB", file=sys.stderr)
        rows += measure_size(mem, a.reps, q7, q10)
    summary = {str(m): {k: benchlib.med([r[k] for r in rows if r["memory_mib"] == m]) for k in KINDS}
               for m in sizes}
    for m in sizes:
        s = summary[str(m)]
        s["warm-10.0 / cpr-transfer"] = s["warm-10.0"] / s["cpr-transfer"]
        s["vmcsnap-cpr / cpr-transfer"] = s["vmcsnap-cpr"] / s["cpr-transfer"]
        s["upgrade / warm-7.2"] = s["upgrade"] / s["warm-7.2"]
        s["upgrade / warm-10.0"] = s["upgrade"] / s["warm-10.0"]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "rejuvenate-cpr.json"), "w") as f:
        json.dump({"reps": a.reps, "sizes_mib": sizes, "qemu7": q7, "qemu10": q10,
                   "rows": rows, "median_ms": summary}, f, indent=1)
    plot(summary, sizes, os.path.join(a.out, "rejuvenate-cpr.png"))
    print(f"{'MiB':>6} " + " ".join(f"{k:>13}" for k in KINDS) + "  warm10/cpr  upgrade/warm7.2")
    for m in sizes:
        s = summary[str(m)]
        print(f"{m:>6} " + " ".join(f"{s[k]:>13.1f}" for k in KINDS) +
              f"  {s['warm-10.0 / cpr-transfer']:>9.2f}x  {s['upgrade / warm-7.2']:>9.2f}x")


if __name__ == "__main__":
    main()
