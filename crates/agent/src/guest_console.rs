//! What a guest says on its console about itself: the lab guest's
//! `vmcsnap-stat` lines (TCP counters) and pingpong's per-second lines
//! (guest/README.md has the formats). Read by the agent of the VM's host
//! (the console log is a file there) for cluster snapshot and restore
//! reports and for the guest counters a metrics scrape shows.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use serde::{Deserialize, Serialize};
use vmcsnap_control::TcpCounters;

/// What a guest's console said after a given offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GuestView {
    /// The TCP counters of the guest's last `vmcsnap-stat` line (all `None`
    /// if no line was seen).
    pub tcp: TcpCounters,
    /// All counters of the first stat line.
    pub tcp_first: TcpCounters,
    /// The largest per-second `maxgap_ms=` of pingpong client lines.
    pub pingpong_max_gap_ms: Option<u64>,
    /// How many `vmcsnap-stat` lines were seen (one per second).
    pub stat_lines: u64,
}

/// Parses console text (see guest/README.md for the line formats).
///
/// Only complete lines count: the guest's serial port writes a line into
/// the console log a byte at a time, so text read while a guest writes
/// ends in a line cut anywhere (`retrans=1` of `retrans=12`, or before its
/// counters), which would read as a wrong or missing value. A stat line
/// without `retrans=` (cut by kernel messages on the same port) is
/// skipped.
pub fn parse_console(text: &str) -> GuestView {
    let mut v = GuestView::default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    for line in complete.lines() {
        if line.starts_with("vmcsnap-stat ") && field(line, "retrans").is_some() {
            v.stat_lines += 1;
            v.tcp = TcpCounters::parse(line);
            if v.stat_lines == 1 {
                v.tcp_first = v.tcp;
            }
        } else if line.starts_with("pingpong: ") {
            if let Some(g) = field(line, "maxgap_ms") {
                v.pingpong_max_gap_ms = Some(v.pingpong_max_gap_ms.map_or(g, |m| m.max(g)));
            }
        }
    }
    v
}

/// A console log's length now (where to read from later).
pub fn console_offset(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// The console text from `offset` on (lossy UTF-8; empty if unreadable).
pub fn console_since(path: &Path, offset: u64) -> String {
    let mut out = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        if f.seek(SeekFrom::Start(offset)).is_ok() {
            let _ = f.read_to_end(&mut out);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A whole console log (lossy UTF-8; empty if unreadable).
pub fn console_text(path: &Path) -> String {
    console_since(path, 0)
}

/// The TCP counters of the last stat line in the last few KiB of a console.
pub fn tcp_now(path: &Path) -> TcpCounters {
    let len = console_offset(path);
    parse_console(&console_since(path, len.saturating_sub(8192))).tcp
}

fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_lines_give_retrans_and_pingpong_gap() {
        let text = "vmcsnap-stat name=a uptime=1.0 retrans=3\n\
                    pingpong: t=1 conn=1 reqs=700 total=700 maxgap_ms=4 maxgap_all_ms=9\n\
                    noise retrans=99\n\
                    pingpong: t=2 conn=1 reqs=650 total=1350 maxgap_ms=31 maxgap_all_ms=31\n\
                    vmcsnap-stat name=a uptime=2.0 retrans=5 tlp=2 rto=1\n";
        let v = parse_console(text);
        assert_eq!(v.tcp.retrans, Some(5));
        assert_eq!((v.tcp.tlp, v.tcp.rto), (Some(2), Some(1)));
        assert_eq!(
            parse_console("vmcsnap-stat name=a uptime=2.0 retrans=5\n")
                .tcp
                .tlp,
            None,
            "older guests print no tlp"
        );
        assert_eq!(v.pingpong_max_gap_ms, Some(31));
        assert_eq!(
            v.tcp,
            TcpCounters {
                retrans: Some(5),
                tlp: Some(2),
                tlp_recovered: None,
                rto: Some(1),
                dsack: None
            }
        );
        assert_eq!(v.tcp_first.retrans, Some(3));
        let later =
            TcpCounters::parse("vmcsnap-stat name=a uptime=3.0 retrans=9 tlp=4 tlprec=1 rto=1");
        assert_eq!(later.tlp_recovered, Some(1));
        let g = later.growth_since(&v.tcp);
        assert_eq!(
            (g.retrans, g.tlp, g.tlp_recovered, g.rto),
            (Some(4), Some(2), None, Some(0))
        );
        assert_eq!(
            g.lost(),
            None,
            "no dsack= on the earlier line: loss unknown"
        );
        assert_eq!(v.stat_lines, 2);
        assert_eq!(parse_console("").tcp.retrans, None);
    }

    /// Regression: a cluster restore report read a guest's console while
    /// the guest was writing its last stat line, and reported that VM's TCP
    /// counters as unknown (2 of 24 VMs in an 8-VM benchmark run); a line
    /// cut inside a number would have given a wrong count.
    #[test]
    fn a_line_still_being_written_is_not_read() {
        let done = "vmcsnap-stat name=a uptime=1.0 retrans=12 tlp=3 tlprec=0 rto=0 dsack=3\n\
                    pingpong: t=1 conn=1 reqs=700 total=700 maxgap_ms=40 maxgap_all_ms=40\n";
        for cut in [
            "vmcsnap-stat name=a uptime=2.0 retr",
            "vmcsnap-stat name=a uptime=2.0 retrans=1",
            "pingpong: t=2 maxgap_ms=9",
        ] {
            let v = parse_console(&format!("{done}{cut}"));
            assert_eq!(v.stat_lines, 1, "{cut:?}");
            assert_eq!(v.tcp.retrans, Some(12), "{cut:?}");
            assert_eq!(v.tcp.dsack, Some(3), "{cut:?}");
            assert_eq!(v.pingpong_max_gap_ms, Some(40), "{cut:?}");
        }
        let v = parse_console("vmcsnap-stat name=a upt\n[   12.3] kernel says\nvmcsnap-stat name=a uptime=3.0 retrans=14\n");
        assert_eq!(
            (v.stat_lines, v.tcp_first.retrans),
            (1, Some(14)),
            "a stat line cut by a kernel message is skipped"
        );
        assert_eq!(
            parse_console("vmcsnap-stat name=a uptime=2.0 retrans=5").stat_lines,
            0
        );
    }
}
