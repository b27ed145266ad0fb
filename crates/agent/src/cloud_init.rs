//! The cloud-init NoCloud seed of an image VM.
//!
//! cloud-init's NoCloud datasource finds a file system labelled `cidata`
//! holding `meta-data` (instance id, hostname), `user-data` (here a
//! `#cloud-config` with the hostname and the SSH keys) and
//! `network-config` (version 2: each of the VM's NICs, matched by its MAC,
//! configured by DHCP or with the static address vmcsnap assigned). The seed
//! is an ISO 9660 image with Rock Ridge and Joliet names, written by
//! `genisoimage` (Debian package genisoimage, installed by
//! `scripts/install-deps.sh`) and attached read-only as the
//! [`crate::qemu::SEED_NODE`] disk.
//!
//! The YAML is written by hand: every scalar is a JSON string, which YAML
//! reads as a double-quoted scalar, so no value can break the structure.

use std::path::{Path, PathBuf};
use std::process::Command;

use thiserror::Error;

/// `write_files` entry of the user-data: a per-boot script writing
/// `VMCSNAP-READY <hostname>` to the virtio port `org.vmcsnap.events` (the
/// marker `up` waits for; see `crates/guest/src/image`), if the port exists.
const READY_SCRIPT: &str = "write_files:
  - path: /var/lib/cloud/scripts/per-boot/vmcsnap-ready
    permissions: '0755'
    content: |
      #!/bin/sh
      port=/dev/virtio-ports/org.vmcsnap.events
      [ -e \"$port\" ] && echo \"VMCSNAP-READY $(hostname)\" > \"$port\"
      exit 0
";

/// The volume label NoCloud looks for.
pub const SEED_LABEL: &str = "cidata";

/// What can go wrong building a seed.
#[derive(Debug, Error)]
pub enum CloudInitError {
    /// `genisoimage` is not installed.
    #[error("genisoimage not found: install the Debian package genisoimage (apt-get install genisoimage, or run scripts/install-deps.sh)")]
    MissingTool,
    /// Reading or writing a file failed.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// `genisoimage` failed.
    #[error("genisoimage failed writing {path} ({status}): {stderr}")]
    Tool {
        /// The seed being written.
        path: PathBuf,
        /// Its exit status.
        status: String,
        /// What it printed.
        stderr: String,
    },
    /// A line of a keys file is not a public key.
    #[error("{path}:{line}: not a public key: {reason}")]
    BadKey {
        /// The keys file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A keys file holds no key.
    #[error("{0}: no public key in it (one \"TYPE BASE64 [COMMENT]\" per line)")]
    NoKeys(PathBuf),
}

fn io<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> CloudInitError + 'a {
    move |source| CloudInitError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// One NIC of the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedNic {
    /// Its MAC (`52:54:00:...`), which the guest's interface is matched by.
    pub mac: String,
    /// A static `A.B.C.D/NN`, or `None` for DHCP.
    pub address: Option<String>,
}

/// Everything a seed says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedConfig {
    /// cloud-init runs its once-per-instance modules again when it changes.
    pub instance_id: String,
    /// The guest's hostname (the VM name).
    pub hostname: String,
    /// Public keys for the default user and root.
    pub ssh_authorized_keys: Vec<String>,
    /// The VM's NICs.
    pub nics: Vec<SeedNic>,
}

fn q(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

impl SeedConfig {
    /// The `meta-data` file.
    pub fn meta_data(&self) -> String {
        format!(
            "instance-id: {}\nlocal-hostname: {}\n",
            q(&self.instance_id),
            q(&self.hostname)
        )
    }

    /// The `user-data` file (`#cloud-config`). `disable_root: false` lets
    /// the keys log in as root too: the VMs sit on vmcsnap's private
    /// network, and the operator works as root there.
    pub fn user_data(&self) -> String {
        let mut s = format!(
            "#cloud-config\nhostname: {}\nmanage_etc_hosts: true\ndisable_root: false\n",
            q(&self.hostname)
        );
        if !self.ssh_authorized_keys.is_empty() {
            s.push_str("ssh_authorized_keys:\n");
            for k in &self.ssh_authorized_keys {
                s.push_str(&format!("  - {}\n", q(k)));
            }
        }
        // The ready marker on vmcsnap's events port, at the end of every
        // boot (cloud-init's per-boot scripts run in its final stage), so a
        // cloud image without vmcsnap's own ready unit is seen ready too.
        s.push_str(READY_SCRIPT);
        s
    }

    /// The `network-config` file (version 2).
    pub fn network_config(&self) -> String {
        let mut s = String::from("version: 2\nethernets:\n");
        for (i, nic) in self.nics.iter().enumerate() {
            s.push_str(&format!(
                "  nic{i}:\n    match:\n      macaddress: {}\n",
                q(&nic.mac.to_ascii_lowercase())
            ));
            match &nic.address {
                Some(a) => s.push_str(&format!(
                    "    dhcp4: false\n    addresses:\n      - {}\n",
                    q(a)
                )),
                None => s.push_str("    dhcp4: true\n"),
            }
        }
        s
    }

    /// Writes the seed image to `out` (replacing it). The three files are
    /// staged in `<out>.d`, removed afterwards.
    pub fn build(&self, out: &Path) -> Result<(), CloudInitError> {
        let tool = crate::qemu::find_program(Path::new("genisoimage"), "genisoimage")
            .map_err(|_| CloudInitError::MissingTool)?;
        let mut staging = out.as_os_str().to_owned();
        staging.push(".d");
        let staging = PathBuf::from(staging);
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).map_err(io("create", &staging))?;
        let result = self.build_from(&tool, &staging, out);
        let _ = std::fs::remove_dir_all(&staging);
        result
    }

    fn build_from(&self, tool: &Path, staging: &Path, out: &Path) -> Result<(), CloudInitError> {
        let files = [
            ("meta-data", self.meta_data()),
            ("user-data", self.user_data()),
            ("network-config", self.network_config()),
        ];
        for (name, text) in &files {
            let p = staging.join(name);
            std::fs::write(&p, text).map_err(io("write", &p))?;
        }
        let _ = std::fs::remove_file(out);
        let output = Command::new(tool)
            .args(["-quiet", "-output"])
            .arg(out)
            .args(["-volid", SEED_LABEL, "-joliet", "-rock"])
            .args(files.iter().map(|(name, _)| staging.join(name)))
            .output()
            .map_err(io("run genisoimage for", out))?;
        if !output.status.success() {
            return Err(CloudInitError::Tool {
                path: out.to_path_buf(),
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
            });
        }
        Ok(())
    }
}

/// The keys of an `authorized_keys`-style file: one per line, blank lines
/// and `#` comments skipped. A file without a key is an error.
pub fn read_keys_file(path: &Path) -> Result<Vec<String>, CloudInitError> {
    let text = std::fs::read_to_string(path).map_err(io("read", path))?;
    let keys = parse_keys(&text).map_err(|(line, reason)| CloudInitError::BadKey {
        path: path.to_path_buf(),
        line,
        reason,
    })?;
    if keys.is_empty() {
        return Err(CloudInitError::NoKeys(path.to_path_buf()));
    }
    Ok(keys)
}

/// The keys of a keys file (`#` comments and blank lines skipped), or the
/// first line (1-based) that is not a public key and why.
fn parse_keys(text: &str) -> Result<Vec<String>, (usize, String)> {
    let mut keys = vec![];
    for (i, l) in text.lines().enumerate() {
        let l = l.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        vmcsnap_spec::check_public_key(l).map_err(|why| (i + 1, why))?;
        keys.push(l.to_string());
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed() -> SeedConfig {
        SeedConfig {
            instance_id: "vmcsnap-demo-alpha".into(),
            hostname: "alpha".into(),
            ssh_authorized_keys: vec![
                "ssh-ed25519 AAAAC3Nza me@host".into(),
                "ssh-rsa AAAAB3 \"quoted\": x".into(),
            ],
            nics: vec![
                SeedNic {
                    mac: "52:54:00:77:00:02".into(),
                    address: None,
                },
                SeedNic {
                    mac: "52:54:00:77:00:AB".into(),
                    address: Some("10.77.0.3/24".into()),
                },
            ],
        }
    }

    #[test]
    fn files_say_what_nocloud_needs() {
        let s = seed();
        assert_eq!(
            s.meta_data(),
            "instance-id: \"vmcsnap-demo-alpha\"\nlocal-hostname: \"alpha\"\n"
        );
        let u = s.user_data();
        assert!(u.starts_with("#cloud-config\n"), "{u}");
        assert!(u.contains("hostname: \"alpha\"\n"));
        // A key with quotes and a colon stays one quoted scalar.
        assert!(u.contains("ssh_authorized_keys:\n  - \"ssh-ed25519 AAAAC3Nza me@host\"\n  - \"ssh-rsa AAAAB3 \\\"quoted\\\": x\"\n"), "{u}");
        let n = s.network_config();
        assert_eq!(
            n,
            "version: 2\nethernets:\n  nic0:\n    match:\n      macaddress: \"52:54:00:77:00:02\"\n    dhcp4: true\n  \
             nic1:\n    match:\n      macaddress: \"52:54:00:77:00:ab\"\n    dhcp4: false\n    addresses:\n      - \"10.77.0.3/24\"\n"
        );
        let mut none = seed();
        none.ssh_authorized_keys.clear();
        assert!(!none.user_data().contains("ssh_authorized_keys"));
        // The ready marker's per-boot script: a literal block of valid sh.
        let block = u.split("    content: |\n").nth(1).expect("a content block");
        let script: String = block
            .lines()
            .map(|l| {
                l.strip_prefix("      ")
                    .unwrap_or_else(|| panic!("indented: {l:?}"))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(
            script.starts_with("#!/bin/sh\n") && script.contains("VMCSNAP-READY $(hostname)"),
            "{script}"
        );
        assert!(
            u.contains("/var/lib/cloud/scripts/per-boot/vmcsnap-ready"),
            "{u}"
        );
        let out = Command::new("sh")
            .arg("-n")
            .arg("-c")
            .arg(&script)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn isoinfo(args: &[&str]) -> String {
        let out = Command::new("isoinfo")
            .args(args)
            .output()
            .expect("isoinfo (package genisoimage) is installed");
        assert!(
            out.status.success(),
            "isoinfo {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn seed_image_reads_back_with_label_and_files() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("seed,1.iso");
        let s = seed();
        s.build(&out).unwrap();
        assert!(!d.path().join("seed,1.iso.d").exists(), "staging removed");
        let iso = out.to_str().unwrap();
        let header = isoinfo(&["-d", "-i", iso]);
        assert!(
            header.lines().any(|l| l.trim() == "Volume id: cidata"),
            "{header}"
        );
        let listing = isoinfo(&["-R", "-f", "-i", iso]);
        let mut names: Vec<&str> = listing.lines().collect();
        names.sort();
        assert_eq!(names, ["/meta-data", "/network-config", "/user-data"]);
        assert_eq!(
            isoinfo(&["-R", "-x", "/user-data", "-i", iso]),
            s.user_data()
        );
        assert_eq!(
            isoinfo(&["-R", "-x", "/meta-data", "-i", iso]),
            s.meta_data()
        );
        assert_eq!(
            isoinfo(&["-R", "-x", "/network-config", "-i", iso]),
            s.network_config()
        );
        // Building again replaces the image.
        let mut t = seed();
        t.hostname = "beta".into();
        t.build(&out).unwrap();
        assert!(isoinfo(&["-R", "-x", "/meta-data", "-i", iso]).contains("\"beta\""));
    }

    #[test]
    fn build_where_no_directory_can_be_fails_with_the_path() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let out = file.join("seed.iso");
        let e = seed().build(&out).unwrap_err();
        assert!(e.to_string().contains(out.to_str().unwrap()), "{e}");
    }

    const ED25519: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILMxwQyC9ziD+RIBARpGDOb53+S2IbtAwf2E5OZE2ZQe me@host";
    const ECDSA: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBA0ZzeXkTcyaxATdlLQrp0fkbnFdKgKfyY+rXahpjxbUE3Y6xxx1oDF7HwQ8aJpFZ3Wp8JiShhJYaRXMlcCilWY=";

    #[test]
    fn keys_files_skip_comments_and_must_hold_only_keys() {
        let text = format!("# mine\n\n{ED25519}\n  {ECDSA}  \n");
        assert_eq!(parse_keys(&text).unwrap(), [ED25519, ECDSA]);
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("keys.pub");
        std::fs::write(&p, "# nothing\n\n").unwrap();
        assert!(matches!(read_keys_file(&p), Err(CloudInitError::NoKeys(_))));
        std::fs::write(&p, &text).unwrap();
        assert_eq!(read_keys_file(&p).unwrap().len(), 2);
        assert!(matches!(
            read_keys_file(&d.path().join("none")),
            Err(CloudInitError::Io { .. })
        ));
        // Regression (issue 29): a line that is no key was skipped silently
        // (or, with three words, taken as a key); it is an error naming the
        // file and the line.
        std::fs::write(&p, format!("{text}not a key\n")).unwrap();
        let e = read_keys_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("keys.pub:5") && e.contains("not a public key"),
            "{e}"
        );
    }
}
