//! The stream relay: QEMU's end of a snapshot stream that outlives the agent.
//!
//! QEMU 7.2's background snapshot write-protects guest RAM with userfaultfd
//! and releases a page only once it is saved. If the stream's reader
//! vanishes mid-snapshot (the agent is killed), the migration fails and, as
//! observed with Debian's 7.2, the guest stays stuck on write faults while
//! QMP still reports `running`. So the agent never hands QEMU its own
//! socket: QEMU writes to a pipe read by `vmcsnap stream-relay --to
//! SOCKET`, a process of its own (not the agent's child) that copies the
//! stream to the agent's socket and, if the agent goes away, keeps reading
//! and discards the rest so QEMU completes the snapshot and the guest runs
//! on. The image, never committed, stays a temporary directory that no
//! listing shows.
//!
//! The relay is started before the snapshot's pause ([`spawn`]): it forks
//! and its first process exits (`--detach`), so init reaps it; it runs in a
//! process group of its own (a signal to the agent's group does not reach
//! it). The pipe's write end goes to QEMU over QMP (`getfd`) and the
//! migration writes to it (`fd:` URI). Before, QEMU started the relay
//! itself through an `exec:` URI, forking a shell inside the pause.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

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

/// A relay started and waiting for its stream.
pub struct Spawned {
    /// The pipe's write end: handed to QEMU, then dropped here (the relay
    /// sees the stream's end once QEMU closes its copy).
    pub write_end: OwnedFd,
}

/// Starts `exe stream-relay --to to --detach` reading from a new pipe, and
/// waits for it to detach (its first process exits once it has forked the
/// relay, which init then reaps).
pub fn spawn(exe: &Path, to: &Path) -> std::io::Result<Spawned> {
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // A larger pipe lets QEMU write ahead of the relay (best effort: the
    // system limit may be lower).
    let _ = rustix::pipe::fcntl_setpipe_size(&write_end, 1 << 20);
    let status = Command::new(exe)
        .arg("stream-relay")
        .arg("--to")
        .arg(to)
        .arg("--detach")
        .stdin(Stdio::from(read_end))
        .stdout(Stdio::null())
        .process_group(0)
        .status()?;
    if !status.success() {
        return Err(std::io::Error::other(format!(
            "the stream relay ({}) could not start: {status}",
            exe.display()
        )));
    }
    Ok(Spawned { write_end })
}

/// Forks; the parent exits at once and the child returns. For the relay's
/// own process (`stream-relay --detach`), before it starts any thread.
#[allow(unsafe_code)]
pub fn detach() -> std::io::Result<()> {
    // SAFETY: called by the stream-relay command at its start, while the
    // process has a single thread, so the child may run any code; the
    // parent only calls `_exit`.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        // SAFETY: `_exit` ends the parent without running destructors or
        // atexit handlers, which belong to the child now.
        pid if pid > 0 => unsafe { libc::_exit(0) },
        _ => Ok(()),
    }
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
    fn a_spawned_relay_delivers_what_is_written_to_its_pipe() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("s");
        let l = UnixListener::bind(&sock).unwrap();
        // Stands in for `vmcsnap stream-relay --to SOCK --detach`: copies
        // its stdin to SOCK from a background process, and exits.
        let script = d.path().join("relay");
        std::fs::write(
            &script,
            "#!/bin/sh\nexec 3<&0\npython3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(sys.stdin.buffer.read())' \"$3\" <&3 &\n",
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let r = spawn(&script, &sock).unwrap();
        let mut w = std::fs::File::from(r.write_end);
        w.write_all(b"stream bytes").unwrap();
        drop(w);
        let (mut s, _) = l.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"stream bytes");
    }

    #[test]
    fn a_relay_that_cannot_start_is_an_error() {
        let e = spawn(Path::new("/bin/false"), Path::new("/nonexistent"))
            .err()
            .expect("/bin/false exits 1");
        assert!(e.to_string().contains("could not start"), "{e}");
    }
}
