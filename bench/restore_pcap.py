#!/usr/bin/env python3
"""What the guests' TCP did right after a cluster restore, from the switch's packet capture.

Run a cluster restore with VMCSNAP_PCAP_DIR set in the agent's environment (see
docs/architecture.md, "Capturing the traffic"; bench/cluster_restore.py --pcap DIR does it), then:

    bench/restore_pcap.py REPORT.json PCAP_DIR [--run K]

REPORT.json is the output of `vmcsnap restore --cluster ... --json`, or a results file of
bench/cluster_restore.py (then --run K picks its K-th run, 0-based, default all). For each VM, from
its guest's start (`started_unix_us`), in the capture file of its port that covers that start:

- first_out_ms: its first TCP segment sent;
- first_in_ms: the first TCP segment handed to it;
- reply_ms: from that segment to the VM's first segment back on its connection (how long the
  restored guest took to react; a few ms in steady running);
- spurious: the data segments it sent after its start that the peer then answered with a duplicate
  SACK (it had them already: the sender's loss-probe or retransmission timer fired, the peer was only
  slow), with when they were sent, ms after the start; within the first 3 s, about the window of
  the RetransSegs growth the restore reports.

Prints a table and, with --json, the rows.
"""
import argparse, functools, glob, json, os, struct, sys


@functools.lru_cache(maxsize=None)  # each file once, however many runs and VMs ask for it
def records(path):
    """(unix µs, outbound, frame) of the packets of a pcapng file as vmcsnap's switch writes it
    (little endian, one Ethernet interface, microsecond time stamps, epb_flags with the direction:
    outbound = sent by the VM)."""
    with open(path, "rb") as f:
        b = f.read()
    if len(b) < 12 or struct.unpack_from("<II", b, 0)[0] != 0x0A0D0D0A or struct.unpack_from("<I", b, 8)[0] != 0x1A2B3C4D:
        raise SystemExit(f"{path}: not a little-endian pcapng file")
    at, out = 0, []
    while at + 12 <= len(b):
        kind, length = struct.unpack_from("<II", b, at)
        if length < 12 or at + length > len(b):
            break  # a block cut short (the capture was still being written)
        if kind == 6:  # enhanced packet block
            hi, lo, incl = struct.unpack_from("<III", b, at + 12)
            frame = b[at + 28:at + 28 + incl]
            opts, flags = at + 28 + (incl + 3) // 4 * 4, 0
            while opts + 4 <= at + length - 4:
                code, olen = struct.unpack_from("<HH", b, opts)
                if code == 0:
                    break
                if code == 2 and olen == 4:
                    flags = struct.unpack_from("<I", b, opts + 4)[0]
                opts += 4 + (olen + 3) // 4 * 4
            out.append(((hi << 32) | lo, flags & 3 == 2, frame))
        at += length
    return out


def tcp(frame):
    """The TCP segment of an Ethernet/IPv4 frame as a dict, or None."""
    if len(frame) < 54 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
        return None
    ihl = (frame[14] & 15) * 4
    t = 14 + ihl
    sp, dp, seq, ack = struct.unpack_from(">HHII", frame, t)
    off = (frame[t + 12] >> 4) * 4
    total = struct.unpack_from(">H", frame, 16)[0]
    return {"flow": (frame[26:30], sp, frame[30:34], dp), "seq": seq, "ack": ack,
            "len": total - ihl - off, "sack": sack_blocks(frame[t + 20:t + off])}


def sack_blocks(opts):
    i, out = 0, []
    while i < len(opts):
        kind = opts[i]
        if kind == 0:
            break
        if kind == 1:
            i += 1
            continue
        if i + 1 >= len(opts):
            break
        n = max(opts[i + 1], 2)
        if kind == 5:
            out = [struct.unpack_from(">II", opts, j) for j in range(i + 2, i + n - 7, 8)]
        i += n
    return out


def before(a, b):
    """a < b in 32-bit sequence space."""
    return ((a - b) & 0xFFFFFFFF) > 0x7FFFFFFF


def capture_for(pcap_dir, vm, at_us):
    """The capture file of `vm`'s port whose records span `at_us` (a restored port's first frame
    comes at the start: QEMU announces the VM on its virtual clock, which runs from the start)."""
    for path in sorted(glob.glob(os.path.join(pcap_dir, f"{vm}.pcapng")) + glob.glob(os.path.join(pcap_dir, f"{vm}.*.pcapng"))):
        r = records(path)
        if r and r[0][0] - 2_000_000 <= at_us <= r[-1][0]:
            return path, r
    return None, []


WINDOW_MS = 3000  # about the window of the restore's RetransSegs growth (the cut to 3 stat lines after)


def analyse(vm, start_us, recs):
    row = {"vm": vm, "first_out_ms": None, "first_in_ms": None, "reply_ms": None, "spurious": []}
    sent = []  # (t, flow, seq, end) of data segments the VM sent after its start
    first_in = None  # (t, flow) of the first segment handed to it
    for ts, outbound, f in recs:
        if ts < start_us:
            continue
        ms = round((ts - start_us) / 1000, 1)
        if ms > WINDOW_MS:
            break
        p = tcp(f)
        if not p:
            continue
        if outbound:
            row["first_out_ms"] = row["first_out_ms"] if row["first_out_ms"] is not None else ms
            back = (p["flow"][2], p["flow"][3], p["flow"][0], p["flow"][1])
            if first_in and row["reply_ms"] is None and first_in[1] == back:
                row["reply_ms"] = round(ms - first_in[0], 1)
            if p["len"] > 0:
                sent.append((ms, p["flow"], p["seq"], (p["seq"] + p["len"]) & 0xFFFFFFFF))
        else:
            row["first_in_ms"] = row["first_in_ms"] if row["first_in_ms"] is not None else ms
            first_in = first_in or (ms, p["flow"])
            # A duplicate SACK (its first block below the cumulative ACK) answers the last copy
            # of those bytes the VM sent: the peer had them already.
            if p["sack"] and before(p["sack"][0][0], p["ack"]):
                left, right = p["sack"][0]
                back = (p["flow"][2], p["flow"][3], p["flow"][0], p["flow"][1])
                dup = [s for s in sent if s[1] == back and not before(s[2], left) and not before(right, s[3])]
                if dup and dup[-1][0] not in row["spurious"]:
                    row["spurious"].append(dup[-1][0])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("pcap_dir")
    ap.add_argument("--run", type=int)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with open(a.report) as f:
        rep = json.load(f)
    runs = rep["runs"] if "runs" in rep else [rep]
    if a.run is not None:
        runs = [runs[a.run]]
    out = []
    for r in runs:
        if "error" in r:
            continue
        for v in sorted(r["vms"], key=lambda v: v["vm"]):
            if not v.get("started_unix_us"):
                raise SystemExit(f"{v['vm']}: no started_unix_us in the report (older vmcsnap?)")
            path, recs = capture_for(a.pcap_dir, v["vm"], v["started_unix_us"])
            if not recs:
                print(f"{r.get('mode', '')} {v['vm']}: no capture spans its start", file=sys.stderr)
                continue
            row = analyse(v["vm"], v["started_unix_us"], recs)
            row.update(mode=r.get("mode"), capture=path, demand_faults=v.get("demand_faults"),
                       retrans=(v.get("tcp_growth") or {}).get("retrans"))
            out.append(row)
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        return
    print(f"{'mode':<19} {'vm':<5} {'first out ms':>12} {'first in ms':>11} {'reply ms':>8} {'faults':>6} {'retrans':>7}  "
          f"spurious sent at (ms after start, first {WINDOW_MS} ms)")
    for row in out:
        fmt = lambda x: "-" if x is None else f"{x:.1f}"
        print(f"{row['mode'] or '':<19} {row['vm']:<5} {fmt(row['first_out_ms']):>12} {fmt(row['first_in_ms']):>11} {fmt(row['reply_ms']):>8} "
              f"{row['demand_faults'] if row['demand_faults'] is not None else '-':>6} {row['retrans'] if row['retrans'] is not None else '-':>7}  {row['spurious']}")


if __name__ == "__main__":
    main()
