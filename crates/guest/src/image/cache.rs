//! The image cache on disk: the `recipe` manifest each image directory
//! carries, listing the cached images, and removing debris safely.
//!
//! The manifest is `key=value` lines (values are single words or
//! space-separated lists: recipe fields are validated to contain no spaces).
//! Unknown keys are ignored, so newer builds can add fields.

use std::fs;
use std::path::{Path, PathBuf};

use super::{io_err, ImageError, ImageRecipe, Suite};

/// An image found in the cache by [`list_images`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CachedImage {
    pub name: String,
    /// The Debian release (manifests written before trixie images: bookworm).
    pub suite: Suite,
    pub key: String,
    pub dir: PathBuf,
    pub packages: Vec<String>,
    pub size_mib: u64,
    pub kernel_version: String,
    /// How long the build took.
    pub build_seconds: f64,
    /// Bytes the qcow2 takes on the host.
    pub disk_bytes: u64,
}

/// The `recipe` file of a built image.
pub(super) fn manifest(r: &ImageRecipe, key: &str, kernel_version: &str, seconds: f64) -> String {
    format!(
        "name={}\nsuite={}\nkey={key}\npackages={}\nservices={}\nprograms={}\nsize_mib={}\n\
         kernel_version={kernel_version}\nbuild_seconds={seconds:.1}\n",
        r.name,
        r.suite,
        r.packages.join(" "),
        r.services.join(" "),
        r.programs.join(" "),
        r.size_mib
    )
}

/// Reads a manifest back; `None` if a required field is missing or bad.
pub(super) fn parse_manifest(text: &str, dir: &Path, disk_bytes: u64) -> Option<CachedImage> {
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
            .map(str::trim)
    };
    let name = get("name").filter(|n| !n.is_empty())?.to_string();
    let key = get("key").filter(|k| k.len() == 16 && k.bytes().all(|b| b.is_ascii_hexdigit()))?;
    let suite = match get("suite") {
        None => Suite::Bookworm,
        Some(s) => Suite::parse(s).ok()?,
    };
    Some(CachedImage {
        name,
        suite,
        key: key.to_string(),
        dir: dir.to_path_buf(),
        packages: get("packages")?
            .split_whitespace()
            .map(String::from)
            .collect(),
        size_mib: get("size_mib")?.parse().ok()?,
        kernel_version: get("kernel_version").unwrap_or("").to_string(),
        build_seconds: get("build_seconds")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0.0),
        disk_bytes,
    })
}

/// The complete images under `cache_root` (`image-*/` with a `complete`
/// marker and a readable manifest), sorted by name. A missing cache root is
/// an empty list.
pub fn list_images(cache_root: &Path) -> Result<Vec<CachedImage>, ImageError> {
    let rd = match fs::read_dir(cache_root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(format!("cannot list {}", cache_root.display()))(e)),
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let dir = e.path();
        let is_image = e.file_name().to_string_lossy().starts_with("image-") && dir.is_dir();
        if !is_image || !dir.join("complete").is_file() {
            continue;
        }
        let Ok(text) = fs::read_to_string(dir.join("recipe")) else {
            continue;
        };
        let disk_bytes = fs::metadata(dir.join("disk.qcow2"))
            .map(|m| m.len())
            .unwrap_or(0);
        match parse_manifest(&text, &dir, disk_bytes) {
            Some(i) => out.push(i),
            None => log::warn!("{}: unreadable recipe manifest, skipped", dir.display()),
        }
    }
    out.sort_by(|a, b| (&a.name, a.suite, &a.key).cmp(&(&b.name, b.suite, &b.key)));
    Ok(out)
}

/// Mount points at or under `dir` (from `/proc/self/mountinfo`).
pub(super) fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mount_points(&text)
        .into_iter()
        .filter(|m| m.starts_with(dir))
        .collect()
}

/// The mount points (field 5) of mountinfo text, with `\040`-style octal
/// escapes decoded. Malformed lines are skipped.
pub(super) fn mount_points(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with('/'))
        .map(|m| PathBuf::from(unescape_octal(m)))
        .collect()
}

fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match oct.map(|d| d.iter().fold(0u32, |n, c| n * 8 + u32::from(c - b'0'))) {
            Some(v) if v <= 255 => {
                out.push(v as u8);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Removes an incomplete image directory, unless something is mounted
/// under it (a killed mmdebstrap can leave /proc, /sys or /dev of the host
/// mounted in its root: deleting through them would damage the host).
pub(super) fn remove_unless_mounted(dir: &Path) -> Result<(), ImageError> {
    let mounts = mounts_under(dir);
    if !mounts.is_empty() {
        return Err(ImageError::StaleMounts {
            dir: dir.display().to_string(),
            mounts: mounts
                .iter()
                .map(|m| m.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    fs::remove_dir_all(dir).map_err(io_err(format!(
        "cannot remove incomplete {}",
        dir.display()
    )))
}
