//! Helpers for robustness tests and fuzzing (not needed by normal users).
//!
//! [`sample_requests`] and [`sample_replies`] are valid lines of each
//! kind; [`exercise_request`] reads a request as the agent does and
//! [`exercise_replies`] reads replies as the CLI does. The `control_request`
//! fuzz target (`crates/control/fuzz`) and the unit tests in
//! `src/tests_fuzz.rs` run them.

use std::path::PathBuf;

use crate::wire::read_line;
use crate::{read_request, write_reply, ControlError, Reply, Request};

/// One of every request, each one line of JSON ending in `\n`.
pub fn sample_requests() -> Vec<Vec<u8>> {
    let requests = [
        Request::Ping,
        Request::Up {
            spec_path: PathBuf::from("/specs/demo.toml"),
            spec_toml: "[cluster]\nname = \"demo\"\n".into(),
        },
        Request::Status,
        Request::Console {
            vm: "alpha".into(),
            tail_bytes: 4096,
        },
        Request::Rejuvenate {
            vm: Some("alpha".into()),
            mode: crate::RejuvenateMode::Warm,
            qemu: Some(PathBuf::from("/opt/qemu/bin/qemu-system-x86_64")),
            recover: None,
        },
        Request::Rejuvenate {
            vm: None,
            mode: crate::RejuvenateMode::Warm,
            qemu: None,
            recover: Some(crate::Recover::Rollback),
        },
        Request::Snapshot {
            vm: "alpha".into(),
            mode: crate::SnapshotMode::Hot,
            name: Some("s1".into()),
            reference: Some(PathBuf::from("snapshots/s0")),
            storage: Some("lz4,no-disk".parse().expect("a storage")),
            full: true,
            block_pages: Some(16),
            access_window_s: Some(10),
        },
        Request::PauseLimit { vm: "alpha".into() },
        Request::ClusterSnapshot {
            mode: crate::SnapshotMode::Hot,
            name: None,
            no_cut_probes: true,
        },
        Request::ClusterRestore {
            snapshot: "c1".into(),
            mode: crate::ClusterRestoreMode::Hotrestore,
            no_priorities: false,
            start_quiet_ms: Some(250),
            wait: true,
        },
        Request::Restore {
            snapshot: "s1".into(),
            mode: crate::RestoreMode::Lazy,
            wss: Some(1 << 20),
            paused: true,
            trace: false,
            no_background: true,
            no_priorities: false,
            start_quiet_ms: None,
            prefetch_blocks: Some(4),
            preempt: true,
            wait: false,
        },
        Request::Stop { vm: "beta".into() },
        Request::Down,
        Request::Gc,
        Request::SnapshotsDelete {
            names: vec!["s1".into(), "demo-1".into()],
        },
        Request::SnapshotsPrune {
            keep: 2,
            vm: Some("alpha".into()),
            dry_run: true,
        },
        Request::RestartAgent,
        Request::Shutdown,
    ];
    requests.iter().map(line).collect()
}

/// A progress, a done (with a typed result, floats included) and a
/// failed reply, each one line of JSON ending in `\n`.
pub fn sample_replies() -> Vec<Vec<u8>> {
    let replies = [
        Reply::Progress {
            message: "booting 3 VMs (tcg)".into(),
        },
        Reply::done(crate::Response::PauseLimit(crate::PauseLimitReport {
            vm: "alpha".into(),
            memory_mib: 65536,
            downtime_ms: 8.25,
            setup_while_running_ms: 0.5,
            duration_ms: 1234.0,
        })),
        Reply::Failed {
            error: "no VM named \"x\"".into(),
        },
    ];
    replies.iter().map(line).collect()
}

fn line<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec(msg).unwrap_or_default();
    v.push(b'\n');
    v
}

/// Reads the one request of a connection from `bytes` as the agent does
/// ([`read_request`]; what the `control_request` fuzz target runs). A
/// request that reads must encode (as the CLI sends it) to one line that
/// reads back to the same request. Panics otherwise, which is a bug; never
/// on input it rejects.
pub fn exercise_request(bytes: &[u8]) -> Result<Request, ControlError> {
    let mut r = bytes;
    let req = read_request(&mut r)?;
    let again = line(&req);
    assert_eq!(
        again.iter().filter(|&&c| c == b'\n').count(),
        1,
        "a request is one line"
    );
    match read_request(&mut &again[..]) {
        Ok(back) => assert_eq!(back, req, "re-encoding changed the request"),
        Err(e) => panic!("a re-encoded request does not read: {e}"),
    }
    Ok(req)
}

/// Reads reply lines from `bytes` as the CLI does until a final reply
/// (done or failed), an error or the end. Each reply that reads must be
/// written by [`write_reply`] as one line that reads back the same.
/// Returns how many replies were read. Panics on a violation, which is a
/// bug; never on input it rejects.
pub fn exercise_replies(bytes: &[u8]) -> Result<usize, ControlError> {
    let mut r: &[u8] = bytes;
    let mut n = 0;
    while let Some(l) = read_line(&mut r)? {
        let reply: Reply = serde_json::from_slice(&l)
            .map_err(|e| ControlError::Protocol(format!("bad reply: {e}")))?;
        n += 1;
        let mut again = Vec::new();
        write_reply(&mut again, &reply)?;
        assert_eq!(again.iter().filter(|&&c| c == b'\n').count(), 1);
        let mut back_r: &[u8] = &again;
        let back: Reply =
            match read_line(&mut back_r).map(|l| l.map(|l| serde_json::from_slice(&l))) {
                Ok(Some(Ok(b))) => b,
                other => panic!("a re-written reply does not read: {other:?}"),
            };
        assert_eq!(back, reply, "re-writing changed the reply");
        if !matches!(reply, Reply::Progress { .. }) {
            break;
        }
    }
    Ok(n)
}
