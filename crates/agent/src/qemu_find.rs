//! Finding a VM's QEMU among the host's processes by its command line (the
//! VM's QMP socket, or its directory): how a new agent finds the QEMU of a
//! recorded VM, and how a pid that may have been reused is checked.

use std::path::Path;

/// Whether `pid` is a live process whose command line names `qmp_socket`
/// (i.e. the QEMU of that VM, not a process that reused its pid).
pub fn is_qemu_of(pid: u32, qmp_socket: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = qmp_socket.as_os_str().as_encoded_bytes();
    cmdline
        .split(|&b| b == 0)
        .any(|arg| arg.windows(needle.len()).any(|w| w == needle))
        // A zombie (ours, not reaped yet) is not running, nor is a QEMU
        // that quit and is exiting (the old QEMU of a warm restart, whose
        // exit goes on in the background while the new one runs the VM).
        && !crate::qemu_exit::exiting(pid)
}

/// The live QEMU of the VM whose QMP socket is `qmp_socket`: `pid` if it
/// still is that, else any process whose command line names the socket
/// (the newest, should two be found while one quits).
pub fn find_qemu(pid: Option<u32>, qmp_socket: &Path) -> Option<u32> {
    if let Some(p) = pid.filter(|&p| is_qemu_of(p, qmp_socket)) {
        return Some(p);
    }
    let mut found: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id() && is_qemu_of(p, qmp_socket))
        .collect();
    found.sort_unstable();
    found.pop()
}

/// Live QEMU processes whose command line mentions `dir` (a cluster
/// directory about to be removed): they must not lose their files.
pub fn qemus_using(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    let needle = dir.as_os_str().as_encoded_bytes().to_vec();
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != std::process::id())
        .filter(|p| {
            let exe = std::fs::read_link(format!("/proc/{p}/exe")).unwrap_or_default();
            let is_qemu = exe
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("qemu"));
            is_qemu
                && std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle.as_slice()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn processes_are_recognised_by_their_command_line() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("qmp.sock");
        // `read` is a builtin: the shell never forks a child that would
        // carry the same command line for a moment (a `sleep` did, and the
        // scan found that child: a flaky test).
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("read x; : \"$0\"")
            .arg(&sock)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        // The child may still be between fork and exec for a moment.
        let t = std::time::Instant::now();
        while !is_qemu_of(pid, &sock) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(is_qemu_of(pid, &sock));
        assert!(!is_qemu_of(pid, &d.path().join("other.sock")));
        assert_eq!(
            find_qemu(Some(999_999_999), &sock),
            Some(pid),
            "found by scanning when the pid is wrong"
        );
        assert_eq!(find_qemu(None, &sock), Some(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        let left = find_qemu(Some(pid), &sock);
        let cmd = left.map(|p| std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default());
        assert_eq!(
            left,
            None,
            "{:?}",
            cmd.map(|c| String::from_utf8_lossy(&c).into_owned())
        );
    }
}
