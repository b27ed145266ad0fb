//! The one rtnetlink request host access needs: delete an interface by
//! index (`RTM_DELLINK`), in the namespace of the calling thread. The
//! classic ioctls cannot delete a device, and shelling out to `ip` would
//! make iproute2 a run-time dependency.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NLMSG_HDR_LEN: usize = 16;
const IFINFOMSG_LEN: usize = 16;

/// The request: `nlmsghdr` + `ifinfomsg` for `index`.
fn dellink_request(index: u32, seq: u32) -> [u8; NLMSG_HDR_LEN + IFINFOMSG_LEN] {
    let mut m = [0u8; NLMSG_HDR_LEN + IFINFOMSG_LEN];
    m[0..4].copy_from_slice(&((NLMSG_HDR_LEN + IFINFOMSG_LEN) as u32).to_ne_bytes());
    m[4..6].copy_from_slice(&libc::RTM_DELLINK.to_ne_bytes());
    m[6..8].copy_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    // ifinfomsg: family AF_UNSPEC, pad, type, index, flags, change.
    m[NLMSG_HDR_LEN + 4..NLMSG_HDR_LEN + 8].copy_from_slice(&(index as i32).to_ne_bytes());
    m
}

/// Reads the errno of an `NLMSG_ERROR` answer to `seq` (0 is an ack).
pub(crate) fn parse_ack(buf: &[u8], seq: u32) -> io::Result<i32> {
    let bad =
        |m: &str| io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink answer: {m}"));
    if buf.len() < NLMSG_HDR_LEN + 4 {
        return Err(bad("too short"));
    }
    let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
    let ty = u16::from_ne_bytes(buf[4..6].try_into().unwrap());
    let got_seq = u32::from_ne_bytes(buf[8..12].try_into().unwrap());
    if len < NLMSG_HDR_LEN + 4 || len > buf.len() {
        return Err(bad("bad length"));
    }
    if ty != libc::NLMSG_ERROR as u16 {
        return Err(bad("not an acknowledgement"));
    }
    if got_seq != seq {
        return Err(bad("sequence number mismatch"));
    }
    Ok(-i32::from_ne_bytes(buf[16..20].try_into().unwrap()))
}

/// Deletes the interface with `index` in the calling thread's namespace.
pub(crate) fn delete_link(index: u32) -> io::Result<()> {
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let seq = 1;
    let req = dellink_request(index, seq);
    // SAFETY: `req` is a valid buffer of its length; the kernel is the default destination.
    let n = unsafe { libc::send(sock.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = [0u8; 1024];
    // SAFETY: `buf` is writable for its length.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    match parse_ack(&buf[..n as usize], seq)? {
        0 => Ok(()),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(errno: i32, seq: u32) -> Vec<u8> {
        let mut m = vec![0u8; 36];
        m[0..4].copy_from_slice(&36u32.to_ne_bytes());
        m[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        m[8..12].copy_from_slice(&seq.to_ne_bytes());
        m[16..20].copy_from_slice(&(-errno).to_ne_bytes());
        m
    }

    #[test]
    fn request_layout() {
        let r = dellink_request(7, 3);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 32);
        assert_eq!(
            u16::from_ne_bytes(r[4..6].try_into().unwrap()),
            libc::RTM_DELLINK
        );
        assert_eq!(i32::from_ne_bytes(r[20..24].try_into().unwrap()), 7);
    }

    #[test]
    fn acks_and_errors() {
        assert_eq!(parse_ack(&ack(0, 1), 1).unwrap(), 0);
        assert_eq!(parse_ack(&ack(libc::ENODEV, 1), 1).unwrap(), libc::ENODEV);
    }

    #[test]
    fn malformed_answers_are_rejected() {
        assert!(parse_ack(&[0u8; 10], 1).is_err());
        assert!(parse_ack(&ack(0, 2), 1).is_err(), "wrong sequence");
        let mut long = ack(0, 1);
        long[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert!(parse_ack(&long, 1).is_err(), "length beyond the buffer");
        let mut other = ack(0, 1);
        other[4..6].copy_from_slice(&16u16.to_ne_bytes());
        assert!(parse_ack(&other, 1).is_err(), "not NLMSG_ERROR");
    }
}
