#!/usr/bin/env python3
"""Capture a QEMU 7.2 migration stream for vmcsnap-migstream's fixtures.

Usage: capture.py OUT [--caps CAP[,CAP...]]... [--run-before SECONDS]
                  [--shm PATH] -- QEMU-ARGS...

Starts `qemu-system-x86_64 QEMU-ARGS -qmp unix:...`, waits --run-before
seconds (guest running unless -S), applies each --caps group with one
`migrate-set-capabilities` call per group (in order), runs
`migrate uri=exec:cat > OUT`, waits for status completed, reports the
counter the writer guest keeps at 0x1ff000 (if --shm names its RAM file),
then quits QEMU. See README.md for the exact invocations.
"""
import json, os, shutil, socket, struct, subprocess, sys, tempfile, time

def qmp(sock_file, cmd, **args):
    msg = {"execute": cmd}
    if args:
        msg["arguments"] = args
    sock_file.write(json.dumps(msg) + "\n")
    sock_file.flush()
    while True:
        reply = json.loads(sock_file.readline())
        if "event" in reply:
            continue
        if "error" in reply:
            raise SystemExit(f"{cmd}: {reply['error']}")
        return reply["return"]

def counter(shm):
    with open(shm, "rb") as f:
        f.seek(0x1ff000)
        return struct.unpack("<I", f.read(4))[0]

def main():
    argv = sys.argv[1:]
    sep = argv.index("--")
    opts, qemu_args = argv[:sep], argv[sep + 1:]
    out = os.path.abspath(opts.pop(0))
    cap_groups, run_before, shm = [], 0.0, None
    while opts:
        o = opts.pop(0)
        if o == "--caps":
            cap_groups.append(opts.pop(0).split(","))
        elif o == "--run-before":
            run_before = float(opts.pop(0))
        elif o == "--shm":
            shm = opts.pop(0)
        else:
            raise SystemExit(f"unknown option {o}")
    tmp = tempfile.mkdtemp(prefix="migstream-capture-")
    qsock = os.path.join(tmp, "qmp.sock")
    qemu = subprocess.Popen(["qemu-system-x86_64", *qemu_args,
                             "-qmp", f"unix:{qsock},server=on,wait=off"])
    try:
        for _ in range(200):
            if os.path.exists(qsock):
                break
            time.sleep(0.05)
        s = socket.socket(socket.AF_UNIX)
        s.connect(qsock)
        f = s.makefile("rw")
        f.readline()  # greeting
        qmp(f, "qmp_capabilities")
        time.sleep(run_before)
        for group in cap_groups:
            qmp(f, "migrate-set-capabilities", capabilities=[
                {"capability": c, "state": True} for c in group])
        if shm:
            print(f"counter before migrate: {counter(shm):#x}")
        qmp(f, "migrate", uri=f"exec:cat > {out}")
        while True:
            st = qmp(f, "query-migrate")
            if st.get("status") in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.02)
        print(json.dumps(st, indent=1))
        if st["status"] != "completed":
            raise SystemExit("migration did not complete")
        if shm:
            print(f"counter after migrate: {counter(shm):#x}")
        qmp(f, "quit")
        qemu.wait(timeout=10)
    finally:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{out}: {os.path.getsize(out)} bytes")

if __name__ == "__main__":
    main()
