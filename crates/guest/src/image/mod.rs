//! Real distro images for the lab: Debian bookworm (12) or trixie (13) with
//! systemd, built from Debian's own packages, cached like the guest assets.
//!
//! [`ensure_image`] builds an [`ImageRecipe`] once per input key
//! ([`image_key`]: the recipe and the embedded `guest/image/*.sh` and C
//! sources) into `<cache_root>/image-<name>-<key>/`:
//!
//! * `disk.qcow2`: the root file system (ext4 on the whole disk, no partition
//!   table, label `root`), made by `mmdebstrap --mode=root --variant=minbase`
//!   and `mkfs.ext4 -d` + `qemu-img convert`, nothing mounted;
//! * `vmlinuz`, `initrd.img`: the image's own Debian cloud kernel (6.1 on
//!   bookworm, 6.12 on trixie) and initramfs, for direct kernel boot (`-kernel`/`-initrd`, no boot loader);
//! * `packages.txt` (every package and version), `kernel-version`, `recipe`
//!   (what it was built from, see [`list_images`]) and `complete`.
//!
//! The build runs as root (mmdebstrap's root mode) in a temporary directory
//! next to the final one and is renamed into place, so a failed or killed
//! build never looks cached; concurrent builders of one key wait on a lock
//! file (`image-<name>-<key>.lock`). The Debian mirror comes from the host's
//! apt sources ([`mirror::debian_mirror`]).
//!
//! Inside the image (see `docs/images.md`): systemd-networkd with DHCP on
//! `en*`/`eth*` (hostname from DHCP option 12, or `systemd.hostname=` on the
//! command line), sshd, the QEMU guest agent on `org.qemu.guest_agent.0`,
//! a serial getty on ttyS0, the root password locked, and two units that are
//! the contract with the host:
//!
//! * `vmcsnap-workload.service` runs, with `/bin/sh`, the script QEMU passes
//!   as fw_cfg file [`FW_CFG_WORKLOAD`] (`-fw_cfg name=opt/vmcsnap/workload,file=F`),
//!   after network-online and the recipe's services, output on the console;
//! * `vmcsnap-ready.service` writes `VMCSNAP-READY <hostname>\n`
//!   ([`crate::READY_MARKER`]) to the virtio-serial port [`EVENTS_PORT`] once
//!   `systemctl is-system-running --wait` returned (running or degraded).

mod cache;
pub mod mirror;
mod recipe;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

pub use cache::{list_images, CachedImage};
pub use recipe::{ImageRecipe, Suite, BUILTIN_RECIPES, DEFAULT_SIZE_MIB, IMAGE_PROGRAMS};

use crate::{run_streaming, FileLock, GuestError};

/// Name of the virtio-serial port the guest announces readiness on
/// (`-device virtserialport,chardev=ev,name=org.vmcsnap.events`).
pub const EVENTS_PORT: &str = "org.vmcsnap.events";

/// fw_cfg name of the workload script (`-fw_cfg name=opt/vmcsnap/workload,file=F`).
pub const FW_CFG_WORKLOAD: &str = "opt/vmcsnap/workload";

/// Bump to rebuild every image when the build's meaning changes without the
/// embedded files changing.
const FORMAT: &str = "vmcsnap-image-v1";

/// Files written to the build directory (paths mirror the repository's guest/).
const EMBEDDED: &[(&str, &str)] = &[
    (
        "image/build-image.sh",
        include_str!("../../../../guest/image/build-image.sh"),
    ),
    (
        "image/customize.sh",
        include_str!("../../../../guest/image/customize.sh"),
    ),
    (
        "src/common.h",
        include_str!("../../../../guest/src/common.h"),
    ),
    (
        "src/redisload.c",
        include_str!("../../../../guest/src/redisload.c"),
    ),
];

/// A built image in the cache.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BuiltImage {
    /// Recipe name.
    pub name: String,
    /// The Debian release it was built from.
    pub suite: Suite,
    /// `<cache_root>/image-<name>-<key>/`
    pub dir: PathBuf,
    /// The root file system, qcow2 (use it as the backing file of an overlay:
    /// never boot it directly, it is shared by every VM).
    pub disk: PathBuf,
    /// The image's kernel (`/boot/vmlinuz-*`), for `-kernel`.
    pub kernel: PathBuf,
    /// The image's initramfs (`/boot/initrd.img-*`), for `-initrd`.
    pub initrd: PathBuf,
    /// Kernel command line for `-append` (root on `/dev/vda`, console on
    /// ttyS0); add `systemd.hostname=NAME` to name a VM without DHCP.
    pub cmdline: String,
    /// [`image_key`] of the recipe.
    pub key: String,
    /// The kernel's release (`uname -r` in the guest, e.g.
    /// `6.12.57+deb13-cloud-amd64`), from the build's `kernel-version`;
    /// empty if that file is missing.
    pub kernel_version: String,
}

/// What went wrong, phrased so the user knows what to do next.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The recipe has a bad field.
    #[error("invalid image recipe: {0}")]
    InvalidRecipe(String),
    /// Building needs root.
    #[error("building image {0:?} needs root (mmdebstrap --mode=root): run vmcsnap as root, or build it once as root with `vmcsnap image build {0}`")]
    NotRoot(String),
    /// No Debian mirror configured.
    #[error("no Debian mirror with main for bookworm or trixie found in /etc/apt/sources.list or /etc/apt/sources.list.d/: add one there, or set VMCSNAP_DEBIAN_MIRROR to the archive's URI")]
    NoMirror,
    /// The build script failed.
    #[error("building image {name:?} failed ({status}); last lines of the build:\n{tail}\nFix the cause shown above (a missing host package: mmdebstrap, e2fsprogs, qemu-utils, gcc; a package name not in the suite's main; no access to the Debian mirror) and try again; nothing was cached.")]
    Build {
        name: String,
        status: String,
        tail: String,
    },
    /// A killed build left file systems mounted in its directory.
    #[error("{dir} is an incomplete build with file systems still mounted under it ({mounts}): unmount them (umount -R DIR) and remove the directory, then try again")]
    StaleMounts { dir: String, mounts: String },
    /// A host tool is missing, a file operation failed, ...
    #[error(transparent)]
    Guest(#[from] GuestError),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Guest(GuestError::Io { context, source })
}

/// The cache key of `recipe`: its fields and every embedded build file.
pub fn image_key(recipe: &ImageRecipe) -> String {
    recipe.key_with(EMBEDDED)
}

/// The cache directory of `recipe` under `cache_root`.
pub fn image_dir(cache_root: &Path, recipe: &ImageRecipe) -> PathBuf {
    cache_root.join(format!("image-{}-{}", recipe.name, image_key(recipe)))
}

/// Kernel command line for an image: root on the virtio disk, console on
/// ttyS0, and the TSC hints of [`crate::guest_tsc_khz`] (a starved TCG guest
/// otherwise can fail to calibrate its TSC and hang).
pub fn image_cmdline() -> String {
    let mut line = String::from("console=ttyS0 root=/dev/vda rw panic=-1 cryptomgr.notests");
    if let Some(khz) = crate::guest_tsc_khz() {
        line.push_str(&format!(" tsc_early_khz={khz} tsc=reliable no_timer_check"));
    }
    line
}

fn built_in(dir: &Path, recipe: &ImageRecipe, key: &str) -> Option<BuiltImage> {
    let b = BuiltImage {
        name: recipe.name.clone(),
        suite: recipe.suite,
        dir: dir.to_path_buf(),
        disk: dir.join("disk.qcow2"),
        kernel: dir.join("vmlinuz"),
        initrd: dir.join("initrd.img"),
        cmdline: image_cmdline(),
        key: key.to_string(),
        kernel_version: fs::read_to_string(dir.join("kernel-version"))
            .map(|v| v.trim().to_string())
            .unwrap_or_default(),
    };
    let complete = [&dir.join("complete"), &b.disk, &b.kernel, &b.initrd]
        .iter()
        .all(|p| p.is_file());
    complete.then_some(b)
}

/// The newest complete image in the cache named `name` and built from
/// `suite` (with `vmcsnap image build NAME --suite SUITE --packages ...`),
/// whatever its packages.
pub fn find_image(
    cache_root: &Path,
    name: &str,
    suite: Suite,
) -> Result<Option<BuiltImage>, ImageError> {
    let mut found: Vec<(std::time::SystemTime, BuiltImage)> = list_images(cache_root)?
        .into_iter()
        .filter(|i| i.name == name && i.suite == suite)
        .filter_map(|i| {
            let recipe = ImageRecipe {
                name: i.name.clone(),
                suite: i.suite,
                ..ImageRecipe::base()
            };
            let b = built_in(&i.dir, &recipe, &i.key)?;
            let t = fs::metadata(i.dir.join("complete"))
                .and_then(|m| m.modified())
                .ok()?;
            Some((t, b))
        })
        .collect();
    found.sort_by_key(|(t, _)| *t);
    Ok(found.pop().map(|(_, b)| b))
}

/// Returns the image of `recipe`, building it first if it is not cached.
///
/// A build takes about 35 s to a few minutes (mmdebstrap downloads and
/// installs ~160 packages) and needs root and the host packages mmdebstrap,
/// e2fsprogs, qemu-utils and gcc. Concurrent callers (threads or processes)
/// of one recipe wait for one build. `progress` gets human-readable lines,
/// including the build's own output.
pub fn ensure_image(
    cache_root: &Path,
    recipe: &ImageRecipe,
    progress: &mut dyn FnMut(&str),
) -> Result<BuiltImage, ImageError> {
    recipe.validate()?;
    let key = image_key(recipe);
    let name = &recipe.name;
    let final_dir = image_dir(cache_root, recipe);
    if let Some(b) = built_in(&final_dir, recipe, &key) {
        progress(&format!("image {name}: cached in {}", final_dir.display()));
        return Ok(b);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(ImageError::NotRoot(name.clone()));
    }
    fs::create_dir_all(cache_root).map_err(io_err(format!(
        "cannot create cache directory {}",
        cache_root.display()
    )))?;
    let _lock = FileLock::acquire(
        &cache_root.join(format!("image-{name}-{key}.lock")),
        progress,
    )?;
    if let Some(b) = built_in(&final_dir, recipe, &key) {
        progress(&format!(
            "image {name}: built by another process in {}",
            final_dir.display()
        ));
        return Ok(b);
    }
    if final_dir.exists() {
        // Not complete and nobody is building (we hold the lock): debris.
        cache::remove_unless_mounted(&final_dir)?;
    }
    let mirror = mirror::debian_mirror(recipe.suite)?;
    let (bash, work, src) = crate::build_workspace(
        cache_root,
        &format!(".image-{name}-{key}-"),
        EMBEDDED
            .iter()
            .map(|(path, contents)| (*path, *contents, path.ends_with(".sh"))),
    )?;
    let out = work.path().join("out");
    progress(&format!(
        "image {name}: building {} (key {key}, mirror {mirror}) into {}",
        recipe.suite,
        final_dir.display()
    ));
    let started = Instant::now();
    let mut cmd = Command::new(bash);
    cmd.arg(src.join("image/build-image.sh"))
        .arg(&out)
        .env("TMPDIR", work.path())
        .env("IMAGE_NAME", name)
        .env("IMAGE_SUITE", recipe.suite.name())
        .env("IMAGE_MIRROR", &mirror)
        .env("IMAGE_PACKAGES", recipe.packages.join(" "))
        .env("IMAGE_SERVICES", recipe.services.join(" "))
        .env("IMAGE_PROGRAMS", recipe.programs.join(" "))
        .env("IMAGE_SIZE_MIB", recipe.size_mib.to_string());
    let result = run_streaming(cmd, progress);
    let built = match result {
        Ok((status, tail)) if status.success() => Ok(tail),
        Ok((status, tail)) => Err(ImageError::Build {
            name: name.clone(),
            status: status.to_string(),
            tail,
        }),
        Err(e) => Err(e.into()),
    };
    let tail = match built {
        Ok(t) => t,
        Err(e) => {
            // mmdebstrap unmounts what it mounted; if it could not, do not
            // let the temporary directory's removal reach into them.
            if !cache::mounts_under(work.path()).is_empty() {
                log::warn!(
                    "leaving {} in place: file systems are still mounted under it",
                    work.path().display()
                );
                let _ = work.keep();
            }
            return Err(e);
        }
    };
    for f in ["disk.qcow2", "vmlinuz", "initrd.img"] {
        if !out.join(f).is_file() {
            return Err(ImageError::Build {
                name: name.clone(),
                status: format!("the build succeeded but wrote no {f}"),
                tail,
            });
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let kernel_version = fs::read_to_string(out.join("kernel-version")).unwrap_or_default();
    fs::write(
        out.join("recipe"),
        cache::manifest(recipe, &key, kernel_version.trim(), seconds),
    )
    .map_err(io_err(format!("cannot write {}/recipe", out.display())))?;
    fs::write(out.join("complete"), format!("key={key}\n"))
        .map_err(io_err(format!("cannot write {}/complete", out.display())))?;
    fs::rename(&out, &final_dir).map_err(io_err(format!(
        "cannot rename {} to {}",
        out.display(),
        final_dir.display()
    )))?;
    progress(&format!(
        "image {name}: built in {seconds:.1} s: {}",
        final_dir.display()
    ));
    built_in(&final_dir, recipe, &key).ok_or_else(|| ImageError::Build {
        name: name.clone(),
        status: "the image vanished after the build".into(),
        tail: String::new(),
    })
}

#[cfg(test)]
mod tests;
