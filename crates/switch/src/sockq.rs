//! How much a socket's peer has not read yet.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;

/// Memory held by what was written to `sock` and not yet read by its peer
/// (`SIOCOUTQ`). For a unix stream socket the kernel reports the buffers'
/// allocated size (so 1000 bytes written may show as ~2 KiB), not payload
/// bytes; it is zero exactly when the peer (a QEMU netdev) has consumed
/// everything we sent, which is what callers rely on.
pub(crate) fn unsent_bytes(sock: &impl AsRawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (== SIOCOUTQ on Linux) writes one c_int through the
    // pointer, which points at a live local of that type; the fd is owned by
    // `sock` and open for the duration of the call.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn counts_what_the_peer_has_not_read() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        assert_eq!(unsent_bytes(&a).unwrap(), 0);
        a.write_all(&[7u8; 1000]).unwrap();
        assert!(unsent_bytes(&a).unwrap() >= 1000);
        let mut buf = [0u8; 600];
        b.read_exact(&mut buf).unwrap();
        assert!(unsent_bytes(&a).unwrap() > 0, "400 bytes are still unread");
        b.read_exact(&mut buf[..400]).unwrap();
        assert_eq!(unsent_bytes(&a).unwrap(), 0);
    }
}
