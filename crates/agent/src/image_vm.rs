//! Preparing an image VM: a user's Debian/Ubuntu disk image, or one that
//! `vmcsnap image build` makes (see `docs/images.md`, `docs/cluster-spec.md`).
//!
//! Nothing here writes the user's image: the VM runs on a qcow2 overlay in
//! its directory whose backing file is the image (named by absolute path).
//! Before anything is created the image is checked: it must exist and be a
//! disk image (qcow2, or raw with a partition table or a file system), so
//! a typo or a wrong file is one clear error.
//!
//! ```text
//! cluster/<vm>/root.qcow2     overlay of the image (node root0)
//! cluster/<vm>/disk<i>.qcow2  extra disks (overlays, or fresh)
//! cluster/<vm>/seed.iso       cloud-init NoCloud seed (read-only)
//! cluster/<vm>/workload.sh    the workload, given to the guest by fw_cfg
//! cluster/<vm>/events.log     the events port: `VMCSNAP-READY <host>`
//! cluster/<vm>/qga.sock       the guest agent's port
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

use vmcsnap_guest::image::Suite;
use vmcsnap_spec::{
    Boot, ClusterSpec, DiskFormat, ExtraDisk, ImageGuest, ImageSource, ImageSuite, SshKeys,
    VmAddress, VmSpec,
};

use crate::qemu::{DiskConfig, ImageDevices};
use crate::AgentError;

/// What an image VM's QEMU configuration gets from its preparation.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Disks in device order: root, extra disks, seed.
    pub disks: Vec<DiskConfig>,
    /// Direct boot: kernel, initrd, command line.
    pub kernel: Option<PathBuf>,
    /// Initramfs for direct boot.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest agent, events port, workload.
    pub devices: ImageDevices,
    /// The release of the kernel the VM boots, where vmcsnap knows it (a
    /// recipe image's own kernel); it decides the CPU model
    /// ([`crate::cpu_model::choose`]).
    pub kernel_release: Option<String>,
}

/// The format of a disk image file, or why it is not one.
pub fn detect_format(path: &Path, declared: Option<DiskFormat>) -> Result<DiskFormat, AgentError> {
    let bad = |why: String| AgentError::BadImage {
        path: path.to_path_buf(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| bad(format!("cannot read it ({e})")))?;
    if !meta.is_file() {
        return Err(bad("it is not a file".into()));
    }
    let qemu_img = crate::qemu::find_qemu_img()?;
    let out = Command::new(&qemu_img)
        .args(["info", "-U", "--output=json"])
        .arg(path)
        .output()
        .map_err(AgentError::io("running qemu-img info on", path))?;
    if !out.status.success() {
        return Err(bad(format!(
            "qemu-img cannot open it: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let info: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| bad(format!("qemu-img info said something unreadable: {e}")))?;
    let found = match info["format"].as_str() {
        Some("qcow2") => DiskFormat::Qcow2,
        Some("raw") => {
            // qemu-img calls any file raw: ask for a partition table or a
            // file system at the start, as a disk image has.
            if !looks_like_a_disk(path) {
                return Err(bad("it holds no partition table (MBR/GPT) and no ext2/3/4 file system: not a disk image".into()));
            }
            DiskFormat::Raw
        }
        Some(other) => return Err(bad(format!("its format is {other}; vmcsnap runs qcow2 and raw images (convert it with qemu-img convert -O qcow2)"))),
        None => return Err(bad("qemu-img reports no format".into())),
    };
    if let Some(d) = declared {
        if d != found {
            return Err(bad(format!(
                "the spec says {} but the file is {}",
                d.driver(),
                found.driver()
            )));
        }
    }
    Ok(found)
}

/// An MBR or GPT signature, or an ext2/3/4 superblock, where a disk has one.
fn looks_like_a_disk(path: &Path) -> bool {
    use std::io::Read;
    let mut head = vec![0u8; 2048];
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let n = f.read(&mut head).unwrap_or(0);
    if n < 1082 {
        return false;
    }
    let mbr = head[510] == 0x55 && head[511] == 0xaa;
    let gpt = &head[512..520] == b"EFI PART";
    let ext = head[1080] == 0x53 && head[1081] == 0xef;
    mbr || gpt || ext
}

fn qemu_img(args: &[&std::ffi::OsStr]) -> Result<(), AgentError> {
    crate::disk_chain::qemu_img(&crate::qemu::find_qemu_img()?, args).map(drop)
}

/// A qcow2 overlay at `overlay` of `base` (absolute path) in `format`.
fn overlay_of(base: &Path, format: DiskFormat, overlay: &Path) -> Result<(), AgentError> {
    let base = std::fs::canonicalize(base).map_err(AgentError::io("resolving", base))?;
    let _ = std::fs::remove_file(overlay);
    qemu_img(&[
        "create".as_ref(),
        "-q".as_ref(),
        "-f".as_ref(),
        "qcow2".as_ref(),
        "-F".as_ref(),
        format.driver().as_ref(),
        "-b".as_ref(),
        base.as_os_str(),
        overlay.as_os_str(),
    ])
}

/// Checks the image of a VM without creating anything (the checks `up`
/// makes for every VM before it starts any).
pub fn check(g: &ImageGuest<'_>) -> Result<(), AgentError> {
    if let ImageSource::Path { path, format } = g.source {
        detect_format(path, format)?;
    }
    for d in &g.disks {
        if let ExtraDisk::Image { path, format } = d {
            detect_format(path, *format)?;
        }
    }
    // A keys file is read now: a line that is no key fails `up` here.
    if let Some(SshKeys::File(p)) = g.ssh_keys {
        crate::cloud_init::read_keys_file(p)?;
    }
    if let Boot::Direct { kernel, initrd, .. } = g.boot {
        for p in std::iter::once(kernel).chain(initrd) {
            if !p.is_file() {
                return Err(AgentError::BadImage {
                    path: p.to_path_buf(),
                    why: "no such file (kernel/initrd of the spec)".into(),
                });
            }
        }
    }
    Ok(())
}

/// The image builder's suite of the spec's `image_suite`.
pub fn image_suite(suite: ImageSuite) -> Suite {
    match suite {
        ImageSuite::Bookworm => Suite::Bookworm,
        ImageSuite::Trixie => Suite::Trixie,
    }
}

/// The root disk of a recipe image: the cached build, built first if it
/// is a built-in recipe that is not cached yet.
fn recipe_image(
    name: &str,
    suite: Suite,
    progress: &mut dyn FnMut(&str),
) -> Result<vmcsnap_guest::image::BuiltImage, AgentError> {
    use vmcsnap_guest::image::{ensure_image, find_image, ImageRecipe};
    let cache = vmcsnap_guest::default_cache_root();
    if let Some(r) = ImageRecipe::builtin(name) {
        return ensure_image(&cache, &r.with_suite(suite), progress).map_err(AgentError::from);
    }
    find_image(&cache, name, suite)?.ok_or_else(|| AgentError::BadRequest(format!(
        "image_recipe {name:?} (image_suite {suite}) is not a built-in recipe ({}) and no such image is cached in {}: build it with `vmcsnap image build {name} --suite {suite} --packages P,...`",
        vmcsnap_guest::image::BUILTIN_RECIPES.join(", "),
        cache.display()
    )))
}

/// Creates the files of image VM `vm` in `dir` and says how to boot it.
pub fn prepare(
    spec: &ClusterSpec,
    vm: &VmSpec,
    g: &ImageGuest<'_>,
    address: &VmAddress,
    dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Prepared, AgentError> {
    let root = dir.join("root.qcow2");
    let (mut kernel, mut initrd, mut cmdline) = (None, None, String::new());
    let mut kernel_release = None;
    match g.source {
        ImageSource::Path { path, format } => {
            let format = detect_format(path, format)?;
            progress(&format!(
                "{}: overlay of {} ({})",
                vm.name,
                path.display(),
                format.driver()
            ));
            overlay_of(path, format, &root)?;
        }
        ImageSource::Recipe { name, suite } => {
            let built = recipe_image(name, image_suite(suite), progress)?;
            kernel_release = Some(built.kernel_version.clone()).filter(|v| !v.is_empty());
            overlay_of(&built.disk, DiskFormat::Qcow2, &root)?;
            // Recipe images boot directly (they have no bootloader).
            kernel = Some(built.kernel);
            initrd = Some(built.initrd);
            cmdline = format!("{} systemd.hostname={}", built.cmdline, vm.name);
        }
    }
    if let Boot::Direct {
        kernel: k,
        initrd: i,
        cmdline: c,
    } = g.boot
    {
        kernel = Some(k.to_path_buf());
        initrd = i.map(Path::to_path_buf);
        cmdline = c.unwrap_or_default().to_string();
        kernel_release = None;
    }
    let mut disks = vec![DiskConfig::qcow2(crate::qemu::ROOT_NODE, &root)];
    for (i, d) in g.disks.iter().enumerate() {
        let node = crate::qemu::extra_disk_node(i);
        let file = dir.join(format!("{node}.qcow2"));
        match d {
            ExtraDisk::Image { path, format } => {
                overlay_of(path, detect_format(path, *format)?, &file)?
            }
            ExtraDisk::Empty { size_mib } => {
                let _ = std::fs::remove_file(&file);
                let size = format!("{size_mib}M");
                qemu_img(&[
                    "create".as_ref(),
                    "-q".as_ref(),
                    "-f".as_ref(),
                    "qcow2".as_ref(),
                    file.as_os_str(),
                    size.as_ref(),
                ])?;
            }
        }
        disks.push(DiskConfig::qcow2(&node, &file));
    }
    if g.cloud_init {
        let keys = match g.ssh_keys {
            None => vec![],
            Some(SshKeys::Keys(k)) => k.clone(),
            Some(SshKeys::File(p)) => crate::cloud_init::read_keys_file(p)?,
        };
        let seed = crate::cloud_init::SeedConfig {
            // Stable across restarts and restores of the VM, so cloud-init
            // runs its once-per-instance modules once.
            instance_id: format!("vmcsnap-{}-{}", spec.cluster.name, vm.name),
            hostname: vm.name.clone(),
            ssh_authorized_keys: keys,
            nics: vec![crate::cloud_init::SeedNic {
                mac: address.mac_string(),
                address: None,
            }],
        };
        let iso = dir.join("seed.iso");
        seed.build(&iso)?;
        disks.push(DiskConfig::read_only_raw(crate::qemu::SEED_NODE, &iso));
    }
    let workload = spec
        .expand_workload(&vm.name)
        .map_err(|source| AgentError::Spec {
            path: "spec".into(),
            source,
        })?;
    let workload_file = if workload.trim().is_empty() {
        None
    } else {
        let f = dir.join("workload.sh");
        std::fs::write(&f, workload).map_err(AgentError::io("writing", &f))?;
        Some(f)
    };
    let devices = ImageDevices {
        qga_socket: dir.join("qga.sock"),
        events_log: dir.join("events.log"),
        workload_file,
    };
    Ok(Prepared {
        disks,
        kernel,
        initrd,
        cmdline,
        devices,
        kernel_release,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_that_are_not_disk_images_are_refused_with_the_reason() {
        let d = tempfile::tempdir().unwrap();
        let text = d.path().join("notes.txt");
        std::fs::write(&text, "hello\n".repeat(1000)).unwrap();
        let e = detect_format(&text, None).unwrap_err().to_string();
        assert!(
            e.contains("notes.txt") && e.contains("not a disk image"),
            "{e}"
        );
        let e = detect_format(&d.path().join("missing.qcow2"), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing.qcow2") && e.contains("cannot read"),
            "{e}"
        );
        let e = detect_format(d.path(), None).unwrap_err().to_string();
        assert!(e.contains("not a file"), "{e}");
    }

    #[test]
    fn qcow2_and_raw_disks_are_recognised() {
        let d = tempfile::tempdir().unwrap();
        let q = d.path().join("a.qcow2");
        qemu_img(&[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            q.as_os_str(),
            "16M".as_ref(),
        ])
        .unwrap();
        assert_eq!(detect_format(&q, None).unwrap(), DiskFormat::Qcow2);
        let e = detect_format(&q, Some(DiskFormat::Raw))
            .unwrap_err()
            .to_string();
        assert!(e.contains("spec says raw"), "{e}");
        let r = d.path().join("a.raw");
        let mut bytes = vec![0u8; 1 << 20];
        bytes[510] = 0x55;
        bytes[511] = 0xaa;
        std::fs::write(&r, bytes).unwrap();
        assert_eq!(detect_format(&r, None).unwrap(), DiskFormat::Raw);
        let o = d.path().join("o.qcow2");
        overlay_of(&r, DiskFormat::Raw, &o).unwrap();
        assert_eq!(detect_format(&o, None).unwrap(), DiskFormat::Qcow2);
    }
}
