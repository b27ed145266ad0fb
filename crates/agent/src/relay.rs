//! The stream relay: QEMU's end of a snapshot stream that outlives the agent.
//!
//! QEMU 7.2's background snapshot write-protects guest RAM with userfaultfd
//! and releases a page only once it is saved. If the stream's reader
//! vanishes mid-snapshot (the agent is killed), the migration fails and, as
//! observed with Debian's 7.2, the guest stays stuck on write faults while
//! QMP still reports `running`. So the agent never hands QEMU its own
//! socket: QEMU migrates to `exec:vmcsnap stream-relay --to SOCKET`, a child
//! of QEMU (not of the agent) that copies its stdin to the agent's socket,
//! and if the agent goes away, keeps reading and discards the rest so QEMU
//! completes the snapshot and the guest runs on. The image, never
//! committed, stays a temporary directory that no listing shows.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

/// What happened to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayOutcome {
    /// Bytes delivered to the agent.
    pub delivered: u64,
    /// Bytes read after the agent went away and thrown away.
    pub discarded: u64,
}

/// Copies `input` to the socket at `to` until end of input. If the socket
/// cannot be reached or breaks, the rest of the input is drained and
/// discarded. Fails only if reading the input fails.
pub fn relay(mut input: impl Read, to: &Path) -> std::io::Result<RelayOutcome> {
    let mut out = UnixStream::connect(to).ok();
    let mut buf = vec![0u8; 1 << 20];
    let mut outcome = RelayOutcome {
        delivered: 0,
        discarded: 0,
    };
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        match out.as_mut().map(|s| s.write_all(&buf[..n])) {
            Some(Ok(())) => outcome.delivered += n as u64,
            _ => {
                out = None;
                outcome.discarded += n as u64;
            }
        }
    }
    Ok(outcome)
}

/// The `exec:` migration URI that runs the relay from the binary `exe`.
pub fn exec_uri(exe: &Path, to: &Path) -> String {
    format!(
        "exec:{} stream-relay --to {}",
        shell_quote(exe),
        shell_quote(to)
    )
}

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn relays_everything_while_the_reader_lives() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("s");
        let l = UnixListener::bind(&sock).unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut v = Vec::new();
            s.read_to_end(&mut v).unwrap();
            v
        });
        let data: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        let o = relay(&data[..], &sock).unwrap();
        assert_eq!(
            o,
            RelayOutcome {
                delivered: data.len() as u64,
                discarded: 0
            }
        );
        assert_eq!(reader.join().unwrap(), data);
    }

    #[test]
    fn drains_the_rest_when_the_reader_dies() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("s");
        let l = UnixListener::bind(&sock).unwrap();
        let reader = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut first = vec![0u8; 1000];
            s.read_exact(&mut first).unwrap();
            // The agent dies: its end closes.
        });
        let data = vec![7u8; 64 << 20];
        let o = relay(&data[..], &sock).unwrap();
        reader.join().unwrap();
        assert_eq!(o.delivered + o.discarded, data.len() as u64);
        assert!(o.discarded > 0, "{o:?}");
    }

    #[test]
    fn drains_everything_when_nobody_listens() {
        let o = relay(&[1u8; 5000][..], Path::new("/nonexistent/sock")).unwrap();
        assert_eq!(
            o,
            RelayOutcome {
                delivered: 0,
                discarded: 5000
            }
        );
    }

    #[test]
    fn uri_quotes_paths() {
        assert_eq!(
            exec_uri(Path::new("/usr/bin/vmcsnap"), Path::new("/r/it's.sock")),
            r"exec:'/usr/bin/vmcsnap' stream-relay --to '/r/it'\''s.sock'"
        );
    }
}
