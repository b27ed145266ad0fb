//! The TAP interface: created with `/dev/net/tun` (`IFF_TAP | IFF_NO_PI`, no
//! vnet header, not persistent, so it disappears with the last open file)
//! and configured with the classic interface ioctls (MAC, IPv4 address and
//! netmask, up). All of it runs on a thread inside the target namespace
//! ([`crate::netns::in_netns`]), since the device and the ioctl socket
//! belong to the namespace of the thread that makes them.
//!
//! An interface of the same name left by a crashed owner is deleted first
//! (rtnetlink `RTM_DELLINK`): in a namespace of ours whatever it is, in the
//! host's stack only if it is a TUN/TAP device.

use std::ffi::CStr;
use std::fs::OpenOptions;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{HostNetError, Result};

/// `IFNAMSIZ - 1`.
pub const MAX_IFNAME_LEN: usize = 15;

/// `struct ifreq`: a name and a 24-byte union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(ifname: &str) -> Self {
        let mut r = IfReq {
            name: [0; libc::IFNAMSIZ],
            data: [0; 24],
        };
        r.name[..ifname.len()].copy_from_slice(ifname.as_bytes());
        r
    }
    fn set_flags(&mut self, flags: i16) {
        self.data[..2].copy_from_slice(&flags.to_ne_bytes());
    }
    fn flags(&self) -> i16 {
        i16::from_ne_bytes([self.data[0], self.data[1]])
    }
    fn set_ipv4(&mut self, ip: Ipv4Addr) {
        // struct sockaddr_in: family, port (be), address (be).
        self.data = [0; 24];
        self.data[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        self.data[4..8].copy_from_slice(&ip.octets());
    }
    fn set_hwaddr(&mut self, mac: [u8; 6]) {
        self.data = [0; 24];
        self.data[..2].copy_from_slice(&libc::ARPHRD_ETHER.to_ne_bytes());
        self.data[2..8].copy_from_slice(&mac);
    }
}

/// Checks an interface name as the kernel's `dev_valid_name` does.
pub fn validate_ifname(name: &str) -> Result<()> {
    let bad = name.is_empty()
        || name.len() > MAX_IFNAME_LEN
        || name == "."
        || name == ".."
        || name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace());
    if bad {
        return Err(HostNetError::InvalidIfname { name: name.into() });
    }
    Ok(())
}

/// How the tap is set up.
#[derive(Debug, Clone)]
pub(crate) struct TapSpec {
    pub ifname: String,
    pub mac: [u8; 6],
    pub ip: Ipv4Addr,
    pub prefix: u8,
    /// Inside a namespace of ours: replace any leftover interface of the
    /// name and bring `lo` up; in the host's stack: replace only TUN/TAP.
    pub own_namespace: bool,
}

/// Creates and configures the tap in the calling thread's namespace;
/// returns its non-blocking file.
pub(crate) fn create(spec: &TapSpec) -> Result<OwnedFd> {
    validate_ifname(&spec.ifname)?;
    let ctl = ioctl_socket()?;
    if spec.own_namespace {
        set_up(&ctl, "lo")?;
    }
    remove_leftover(spec)?;
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => HostNetError::TunMissing,
            _ => HostNetError::io("cannot open /dev/net/tun", e),
        })?;
    let mut req = IfReq::new(&spec.ifname);
    req.set_flags((libc::IFF_TAP | libc::IFF_NO_PI) as i16);
    // SAFETY: TUNSETIFF reads (and writes back the name of) a struct ifreq, which `req` is.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } != 0 {
        return Err(HostNetError::last_os(format!(
            "cannot create TAP device {} (TUNSETIFF)",
            spec.ifname
        )));
    }
    let mut req = IfReq::new(&spec.ifname);
    req.set_hwaddr(spec.mac);
    ioctl(
        &ctl,
        libc::SIOCSIFHWADDR,
        &mut req,
        &spec.ifname,
        "set the MAC address of",
    )?;
    let mut req = IfReq::new(&spec.ifname);
    req.set_ipv4(spec.ip);
    ioctl(
        &ctl,
        libc::SIOCSIFADDR,
        &mut req,
        &spec.ifname,
        "set the IPv4 address of",
    )?;
    let mut req = IfReq::new(&spec.ifname);
    req.set_ipv4(netmask(spec.prefix));
    ioctl(
        &ctl,
        libc::SIOCSIFNETMASK,
        &mut req,
        &spec.ifname,
        "set the netmask of",
    )?;
    set_up(&ctl, &spec.ifname)?;
    Ok(tun.into())
}

/// The netmask of a prefix length (clamped to 32).
pub(crate) fn netmask(prefix: u8) -> Ipv4Addr {
    let p = u32::from(prefix.min(32));
    Ipv4Addr::from(if p == 0 { 0 } else { u32::MAX << (32 - p) })
}

fn ioctl_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(HostNetError::last_os(
            "cannot open a socket for interface ioctls",
        ));
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ioctl(ctl: &OwnedFd, op: libc::Ioctl, req: &mut IfReq, ifname: &str, what: &str) -> Result<()> {
    // SAFETY: every op used here reads or writes a struct ifreq, which `req` is.
    if unsafe { libc::ioctl(ctl.as_raw_fd(), op, req as *mut IfReq) } != 0 {
        return Err(HostNetError::last_os(format!("cannot {what} {ifname}")));
    }
    Ok(())
}

fn set_up(ctl: &OwnedFd, ifname: &str) -> Result<()> {
    let mut req = IfReq::new(ifname);
    ioctl(
        ctl,
        libc::SIOCGIFFLAGS,
        &mut req,
        ifname,
        "read the flags of",
    )?;
    let flags = req.flags() | libc::IFF_UP as i16;
    req.set_flags(flags);
    ioctl(ctl, libc::SIOCSIFFLAGS, &mut req, ifname, "bring up")
}

/// Index of `ifname` in the calling thread's namespace, if it exists.
pub(crate) fn ifindex(ifname: &str) -> Option<u32> {
    let c = std::ffi::CString::new(ifname).ok()?;
    // SAFETY: NUL-terminated name.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (idx != 0).then_some(idx)
}

fn remove_leftover(spec: &TapSpec) -> Result<()> {
    let Some(index) = ifindex(&spec.ifname) else {
        return Ok(());
    };
    if !spec.own_namespace
        && !Path::new(&format!("/sys/class/net/{}/tun_flags", spec.ifname)).exists()
    {
        return Err(HostNetError::InterfaceExists {
            name: spec.ifname.clone(),
        });
    }
    log::warn!(
        "replacing the leftover interface {} (index {index})",
        spec.ifname
    );
    crate::netlink::delete_link(index).map_err(|e| {
        HostNetError::io(
            format!("cannot delete the leftover interface {}", spec.ifname),
            e,
        )
    })
}

/// Names of the interfaces of the calling thread's namespace.
pub(crate) fn interface_names() -> Vec<String> {
    // SAFETY: if_nameindex returns a NULL-terminated array (or NULL) that we free below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return vec![];
    }
    let mut out = vec![];
    let mut p = list;
    // SAFETY: entries are valid until the terminating zero entry; names are C strings.
    unsafe {
        while (*p).if_index != 0 {
            out.push(CStr::from_ptr((*p).if_name).to_string_lossy().into_owned());
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netmasks() {
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(0), Ipv4Addr::new(0, 0, 0, 0));
        assert_eq!(netmask(32), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(netmask(40), Ipv4Addr::new(255, 255, 255, 255));
    }

    #[test]
    fn ifnames() {
        validate_ifname("vmcs0").unwrap();
        validate_ifname(&"a".repeat(15)).unwrap();
        for bad in ["", ".", "..", "a/b", "a:b", "a b", "a\0"] {
            assert!(validate_ifname(bad).is_err(), "{bad:?}");
        }
        assert!(validate_ifname(&"a".repeat(16)).is_err());
    }
}
