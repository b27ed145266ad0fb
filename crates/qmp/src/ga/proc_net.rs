//! The guest's TCP counters from the text of its `/proc/net/snmp` and
//! `/proc/net/netstat`.
//!
//! Both files are pairs of lines with the same prefix: a header naming the
//! fields, then their values (`Tcp: ... RetransSegs ...` / `Tcp: ... 12
//! ...`). The set of counters is the one the lab guest prints on its
//! console (guest/init): RetransSegs of `Tcp`, and TCPLossProbes,
//! TCPLossProbeRecovery, TCPTimeouts, TCPDSACKRecv and TCPDSACKOfoRecv of
//! `TcpExt`. RetransSegs is required; a `TcpExt` field the guest's kernel
//! does not have is `None` (unknown), never 0.

use std::collections::HashMap;

use thiserror::Error;

/// Errors of the `/proc/net` parser.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProcNetError {
    /// A header line without its values line.
    #[error("{file}: the header line of {prefix:?} is not followed by its values line (is this really {file}?)")]
    MissingValues {
        /// Which file.
        file: &'static str,
        /// The line prefix, e.g. `Tcp`.
        prefix: String,
    },
    /// Header and values differ in length.
    #[error("{file}: {prefix:?} names {names} fields but has {values} values (the text is cut or mixed up)")]
    LengthMismatch {
        /// Which file.
        file: &'static str,
        /// The line prefix.
        prefix: String,
        /// Fields named.
        names: usize,
        /// Values given.
        values: usize,
    },
    /// A counter is not a number.
    #[error("{file}: {prefix} {name} is {value:?}, not a counter")]
    NotANumber {
        /// Which file.
        file: &'static str,
        /// The line prefix.
        prefix: String,
        /// The field.
        name: String,
        /// What it was.
        value: String,
    },
    /// RetransSegs is missing.
    #[error("/proc/net/snmp has no Tcp RetransSegs (is this the text of /proc/net/snmp?)")]
    NoRetransSegs,
}

/// A guest's TCP counters since its boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TcpCounters {
    /// `Tcp RetransSegs`: every retransmitted segment.
    pub retrans_segs: u64,
    /// `TcpExt TCPLossProbes`: tail loss probes.
    pub tcp_loss_probes: Option<u64>,
    /// `TcpExt TCPLossProbeRecovery`: tail loss probes that repaired a loss.
    pub tcp_loss_probe_recovery: Option<u64>,
    /// `TcpExt TCPTimeouts`: retransmission timeouts.
    pub tcp_timeouts: Option<u64>,
    /// `TcpExt TCPDSACKRecv`: duplicate SACKs received.
    pub dsack_recv: Option<u64>,
    /// `TcpExt TCPDSACKOfoRecv`: out-of-order duplicate SACKs received.
    pub dsack_ofo_recv: Option<u64>,
}

impl TcpCounters {
    /// Duplicate SACKs received of both kinds (the lab guest's `dsack=`):
    /// one per retransmitted segment the peer already had.
    pub fn dsack_total(&self) -> Option<u64> {
        Some(self.dsack_recv? + self.dsack_ofo_recv?)
    }
}

/// Parses the text of `/proc/net/snmp` and of `/proc/net/netstat`.
pub fn parse_tcp_counters(snmp: &str, netstat: &str) -> Result<TcpCounters, ProcNetError> {
    let snmp_t = table("/proc/net/snmp", snmp)?;
    let netstat_t = table("/proc/net/netstat", netstat)?;
    let retrans_segs = counter(&snmp_t, "/proc/net/snmp", "Tcp", "RetransSegs")?
        .ok_or(ProcNetError::NoRetransSegs)?;
    let ext = |name: &str| counter(&netstat_t, "/proc/net/netstat", "TcpExt", name);
    Ok(TcpCounters {
        retrans_segs,
        tcp_loss_probes: ext("TCPLossProbes")?,
        tcp_loss_probe_recovery: ext("TCPLossProbeRecovery")?,
        tcp_timeouts: ext("TCPTimeouts")?,
        dsack_recv: ext("TCPDSACKRecv")?,
        dsack_ofo_recv: ext("TCPDSACKOfoRecv")?,
    })
}

/// RetransSegs alone, from `/proc/net/snmp`.
pub fn parse_retrans_segs(snmp: &str) -> Result<u64, ProcNetError> {
    let t = table("/proc/net/snmp", snmp)?;
    counter(&t, "/proc/net/snmp", "Tcp", "RetransSegs")?.ok_or(ProcNetError::NoRetransSegs)
}

type Table<'a> = HashMap<(&'a str, &'a str), &'a str>;

/// (prefix, field) → value text of every header/values line pair.
fn table<'a>(file: &'static str, text: &'a str) -> Result<Table<'a>, ProcNetError> {
    let mut out = HashMap::new();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    while let Some(header) = lines.next() {
        let Some((prefix, names)) = header.split_once(':') else {
            continue;
        };
        let values = match lines.next().and_then(|l| l.split_once(':')) {
            Some((p, v)) if p == prefix => v,
            _ => {
                return Err(ProcNetError::MissingValues {
                    file,
                    prefix: prefix.to_string(),
                })
            }
        };
        let names: Vec<&str> = names.split_whitespace().collect();
        let values: Vec<&str> = values.split_whitespace().collect();
        if names.len() != values.len() {
            return Err(ProcNetError::LengthMismatch {
                file,
                prefix: prefix.to_string(),
                names: names.len(),
                values: values.len(),
            });
        }
        for (n, v) in names.into_iter().zip(values) {
            out.insert((prefix, n), v);
        }
    }
    Ok(out)
}

fn counter(
    t: &Table<'_>,
    file: &'static str,
    prefix: &str,
    name: &str,
) -> Result<Option<u64>, ProcNetError> {
    let Some(v) = t.get(&(prefix, name)) else {
        return Ok(None);
    };
    v.parse().map(Some).map_err(|_| ProcNetError::NotANumber {
        file,
        prefix: prefix.to_string(),
        name: name.to_string(),
        value: v.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This host's files when the fixtures were taken (Linux 6.18).
    const SNMP: &str = include_str!("../ga_fixtures/snmp");
    const NETSTAT: &str = include_str!("../ga_fixtures/netstat");

    #[test]
    fn reads_the_counters_of_real_files() {
        let c = parse_tcp_counters(SNMP, NETSTAT).unwrap();
        // The fixture's values, checked by hand against the files.
        assert_eq!(c.retrans_segs, 0);
        assert_eq!(c.tcp_loss_probes, Some(0));
        assert_eq!(c.tcp_loss_probe_recovery, Some(0));
        assert_eq!(c.tcp_timeouts, Some(2));
        assert_eq!(c.dsack_recv, Some(0));
        assert_eq!(c.dsack_ofo_recv, Some(0));
        assert_eq!(c.dsack_total(), Some(0));
        assert_eq!(parse_retrans_segs(SNMP).unwrap(), 0);
    }

    #[test]
    fn picks_each_field_by_its_name() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
                    Tcp: RtoAlgorithm MaxConn RetransSegs InErrs\nTcp: 1 -1 42 0\n";
        let netstat = "TcpExt: TCPTimeouts TCPLossProbes TCPLossProbeRecovery TCPDSACKRecvSegs TCPDSACKRecv TCPDSACKOfoRecv\n\
                       TcpExt: 7 5 1 99 3 2\n\
                       IpExt: InNoRoutes\nIpExt: 0\n";
        let c = parse_tcp_counters(snmp, netstat).unwrap();
        assert_eq!(
            c,
            TcpCounters {
                retrans_segs: 42,
                tcp_loss_probes: Some(5),
                tcp_loss_probe_recovery: Some(1),
                tcp_timeouts: Some(7),
                dsack_recv: Some(3),
                dsack_ofo_recv: Some(2),
            }
        );
        assert_eq!(
            c.dsack_total(),
            Some(5),
            "TCPDSACKRecvSegs is not TCPDSACKRecv"
        );
    }

    #[test]
    fn a_field_the_kernel_lacks_is_unknown_not_zero() {
        let snmp = "Tcp: RetransSegs\nTcp: 4\n";
        let c = parse_tcp_counters(snmp, "TcpExt: TCPTimeouts\nTcpExt: 1\n").unwrap();
        assert_eq!(
            (
                c.retrans_segs,
                c.tcp_timeouts,
                c.tcp_loss_probes,
                c.dsack_total()
            ),
            (4, Some(1), None, None)
        );
        let c = parse_tcp_counters(snmp, "").unwrap();
        assert_eq!(c.tcp_timeouts, None);
    }

    #[test]
    fn malformed_text_is_an_error() {
        let ok_netstat = "TcpExt: TCPTimeouts\nTcpExt: 1\n";
        assert_eq!(
            parse_tcp_counters("", ok_netstat),
            Err(ProcNetError::NoRetransSegs)
        );
        assert_eq!(
            parse_tcp_counters("garbage without colons\n", ok_netstat),
            Err(ProcNetError::NoRetransSegs)
        );
        assert_eq!(
            parse_tcp_counters(NETSTAT, SNMP),
            Err(ProcNetError::NoRetransSegs),
            "files swapped"
        );
        assert!(matches!(
            parse_tcp_counters("Tcp: RetransSegs InErrs\nTcp: 4\n", ok_netstat),
            Err(ProcNetError::LengthMismatch {
                names: 2,
                values: 1,
                ..
            })
        ));
        assert!(matches!(
            parse_tcp_counters("Tcp: RetransSegs\n", ok_netstat),
            Err(ProcNetError::MissingValues { .. })
        ));
        assert!(matches!(
            parse_tcp_counters("Tcp: RetransSegs\nUdp: 4\n", ok_netstat),
            Err(ProcNetError::MissingValues { .. })
        ));
        assert!(matches!(
            parse_tcp_counters("Tcp: RetransSegs\nTcp: -4\n", ok_netstat),
            Err(ProcNetError::NotANumber { .. })
        ));
        assert!(matches!(
            parse_tcp_counters(
                "Tcp: RetransSegs\nTcp: 4\n",
                "TcpExt: TCPTimeouts\nTcpExt: x\n"
            ),
            Err(ProcNetError::NotANumber { .. })
        ));
        // A file cut in the middle of its values line.
        let cut = &SNMP[..SNMP.find("RetransSegs").unwrap() + 200];
        assert!(parse_tcp_counters(cut, NETSTAT).is_err());
    }
}
