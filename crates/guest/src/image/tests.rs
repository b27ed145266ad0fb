//! Tests of the image module: the contract strings in the build scripts,
//! the manifest and mountinfo parsers, and real builds (root, the Debian
//! mirror of the host's apt sources).

use std::io::Read;

use super::cache::{manifest, mount_points, parse_manifest};
use super::*;

fn script(path: &str) -> &'static str {
    EMBEDDED
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, c)| *c)
        .expect(path)
}

#[test]
fn scripts_carry_the_contract_constants() {
    let c = script("image/customize.sh");
    let fw = format!("/sys/firmware/qemu_fw_cfg/by_name/{FW_CFG_WORKLOAD}/raw");
    assert!(
        c.matches(&fw).count() >= 3,
        "the workload path, unit and runner use {fw}"
    );
    assert!(c.contains(&format!("/dev/virtio-ports/{EVENTS_PORT}")));
    assert!(c.contains(&format!("printf '{} %s\\n' \"$host\"", crate::READY_MARKER)));
    assert!(
        c.contains("echo qemu_fw_cfg >"),
        "qemu_fw_cfg is loaded at boot"
    );
    assert!(c.contains("systemctl is-system-running --wait"));
    // The ready unit must not be a oneshot: is-system-running --wait would
    // wait for its own start job forever.
    let ready = &c[c.find("unit vmcsnap-ready.service").unwrap()..];
    assert!(ready.contains("Type=exec"), "{ready}");
    assert!(!c.contains("/etc/hostname\"\n") || c.contains("rm -f \"$R/etc/hostname\""));
    let b = script("image/build-image.sh");
    for p in IMAGE_PROGRAMS {
        assert!(
            EMBEDDED
                .iter()
                .any(|(path, _)| *path == format!("src/{p}.c")),
            "{p}"
        );
    }
    for pkg in [
        "systemd-sysv",
        "linux-image-cloud-amd64",
        "qemu-guest-agent",
        "openssh-server",
    ] {
        assert!(b.contains(pkg), "{pkg}");
    }
    assert!(b.contains("mmdebstrap --mode=root --variant=minbase"));
}

#[test]
fn image_key_depends_on_the_recipe_and_the_scripts() {
    let r = ImageRecipe::redis();
    assert_eq!(image_key(&r), image_key(&r.clone()));
    assert_ne!(image_key(&r), image_key(&ImageRecipe::base()));
    let mut files = EMBEDDED.to_vec();
    assert_eq!(r.key_with(&files), image_key(&r));
    files[1].1 = "#!/bin/bash\n";
    assert_ne!(r.key_with(&files), image_key(&r));
    let dir = image_dir(Path::new("/c"), &r);
    assert_eq!(
        dir,
        Path::new("/c").join(format!("image-redis-{}", image_key(&r)))
    );
}

#[test]
fn cmdline_boots_the_root_disk_on_the_serial_console() {
    let line = image_cmdline();
    let words: Vec<&str> = line.split(' ').collect();
    for w in ["console=ttyS0", "root=/dev/vda", "rw"] {
        assert!(words.contains(&w), "{line}");
    }
    assert!(line.len() < crate::MAX_CMDLINE_LEN);
}

#[test]
fn manifest_round_trips_and_rejects_garbage() {
    let r = ImageRecipe::named("x", &["curl".into(), "jq".into()]).unwrap();
    let text = manifest(&r, "0123456789abcdef", "6.1.0-50-cloud-amd64", 41.25);
    let m = parse_manifest(&text, Path::new("/d"), 7).unwrap();
    assert_eq!(m.name, "x");
    assert_eq!(m.key, "0123456789abcdef");
    assert_eq!(m.packages, ["curl", "jq"]);
    assert_eq!(m.size_mib, r.size_mib);
    assert_eq!(m.kernel_version, "6.1.0-50-cloud-amd64");
    assert_eq!(m.build_seconds, 41.2);
    assert_eq!(m.disk_bytes, 7);
    assert_eq!(m.suite, Suite::Bookworm);
    let t = r.clone().with_suite(Suite::Trixie);
    let m = parse_manifest(
        &manifest(&t, "0123456789abcdef", "k", 1.0),
        Path::new("/d"),
        0,
    );
    assert_eq!(m.unwrap().suite, Suite::Trixie);
    // Manifests written before trixie images have no suite: bookworm.
    let old = "name=x\nkey=0123456789abcdef\npackages=\nsize_mib=1024\n";
    assert_eq!(
        parse_manifest(old, Path::new("/d"), 0).unwrap().suite,
        Suite::Bookworm
    );
    for bad in [
        "name=x\nsuite=sid\nkey=0123456789abcdef\npackages=\nsize_mib=1",
        "",
        "name=\nkey=0123456789abcdef\npackages=\nsize_mib=1",
        "name=x\nkey=0123\npackages=\nsize_mib=1",
        "name=x\nkey=0123456789abcdeg\npackages=\nsize_mib=1",
        "name=x\nkey=0123456789abcdef\nsize_mib=1",
        "name=x\nkey=0123456789abcdef\npackages=\nsize_mib=-1",
        "\u{0}\u{ff}=\n==\n",
    ] {
        assert_eq!(parse_manifest(bad, Path::new("/d"), 0), None, "{bad:?}");
    }
}

#[test]
fn mountinfo_parser_decodes_escapes_and_skips_garbage() {
    let text = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                 35 22 0:5 / /tmp/a\\040b/proc rw - proc proc rw\n\
                 garbage\n\
                 1 2 3 4\n\
                 36 22 0:6 / relative rw - x x rw\n\
                 37 22 0:7 / /x\\9zz\\ rw - x x rw\n";
    assert_eq!(
        mount_points(text),
        [
            PathBuf::from("/"),
            PathBuf::from("/tmp/a b/proc"),
            PathBuf::from("/x\\9zz\\")
        ]
    );
    assert!(cache::mounts_under(Path::new("/nonexistent-vmcsnap-dir")).is_empty());
}

#[test]
fn list_images_skips_incomplete_and_foreign_directories() {
    let root = tempfile::tempdir().unwrap();
    assert!(list_images(&root.path().join("missing"))
        .unwrap()
        .is_empty());
    let r = ImageRecipe::redis();
    let good = root.path().join("image-redis-0123456789abcdef");
    fs::create_dir_all(&good).unwrap();
    fs::write(
        good.join("recipe"),
        manifest(&r, "0123456789abcdef", "k", 1.0),
    )
    .unwrap();
    fs::write(good.join("complete"), "").unwrap();
    let partial = root.path().join("image-base-0123456789abcdef");
    fs::create_dir_all(&partial).unwrap();
    fs::write(
        partial.join("recipe"),
        manifest(&ImageRecipe::base(), "0123456789abcdef", "k", 1.0),
    )
    .unwrap();
    fs::create_dir_all(root.path().join(".image-x-0123456789abcdef-tmp")).unwrap();
    fs::create_dir_all(root.path().join("guest-0123456789abcdef")).unwrap();
    let list = list_images(root.path()).unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(
        (list[0].name.as_str(), list[0].dir.as_path()),
        ("redis", good.as_path())
    );
}

#[test]
fn find_image_takes_the_suite_asked_for() {
    let root = tempfile::tempdir().unwrap();
    let fake = |suite: Suite, key: &str| {
        let r = ImageRecipe::named("pg", &[]).unwrap().with_suite(suite);
        let dir = root.path().join(format!("image-pg-{key}"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("recipe"), manifest(&r, key, "k", 1.0)).unwrap();
        for f in ["complete", "disk.qcow2", "vmlinuz", "initrd.img"] {
            fs::write(dir.join(f), "").unwrap();
        }
        fs::write(dir.join("kernel-version"), format!("{suite}-kernel\n")).unwrap();
        dir
    };
    let trixie = fake(Suite::Trixie, "1111111111111111");
    assert_eq!(
        find_image(root.path(), "pg", Suite::Bookworm).unwrap(),
        None
    );
    let bookworm = fake(Suite::Bookworm, "0000000000000000");
    for (suite, dir) in [(Suite::Bookworm, &bookworm), (Suite::Trixie, &trixie)] {
        let b = find_image(root.path(), "pg", suite).unwrap().unwrap();
        assert_eq!((b.suite, &b.dir), (suite, dir));
        assert_eq!(b.kernel_version, format!("{suite}-kernel"));
    }
}

/// One real build of a small recipe: layout, cache hit, no debris. Needs
/// root, mmdebstrap and the host's Debian mirror (scripts/install-deps.sh).
#[test]
fn ensure_image_builds_once_then_hits_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let mut recipe = ImageRecipe::base();
    recipe.name = "test-base".into();
    recipe.size_mib = 1024;
    // Two builders at once: one builds, the other waits on the lock and
    // finds the result.
    let results: Vec<(Result<BuiltImage, String>, Vec<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut lines = Vec::new();
                    let r = ensure_image(cache.path(), &recipe, &mut |l: &str| {
                        lines.push(l.to_string())
                    });
                    (r.map_err(|e| e.to_string()), lines)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let built: Vec<&Vec<String>> = results
        .iter()
        .filter(|(_, l)| l.iter().any(|x| x.contains("mmdebstrap")))
        .map(|(_, l)| l)
        .collect();
    assert_eq!(built.len(), 1, "exactly one thread ran the build");
    let waited = results
        .iter()
        .find(|(_, l)| !l.iter().any(|x| x.contains("mmdebstrap")))
        .unwrap();
    assert!(
        waited
            .1
            .iter()
            .any(|x| x.contains("built by another process")),
        "{:?}",
        waited.1
    );
    let b = match &results[0].0 {
        Ok(b) => b.clone(),
        Err(e) => panic!("{e}\n{}", results[0].1.join("\n")),
    };
    assert_eq!(results[1].0.as_ref().ok(), Some(&b));
    assert_eq!(b.dir, image_dir(cache.path(), &recipe));
    let mut magic = [0u8; 4];
    fs::File::open(&b.disk)
        .unwrap()
        .read_exact(&mut magic)
        .unwrap();
    assert_eq!(&magic, b"QFI\xfb");
    assert!(fs::metadata(&b.kernel).unwrap().len() > 1 << 20);
    assert!(fs::metadata(&b.initrd).unwrap().len() > 1 << 20);
    let pkgs = fs::read_to_string(b.dir.join("packages.txt")).unwrap();
    for p in [
        "systemd-sysv ",
        "qemu-guest-agent ",
        "openssh-server ",
        "linux-image-6.1.",
    ] {
        assert!(pkgs.contains(p), "{p} missing from packages.txt");
    }
    let names: Vec<String> = fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with(".image-")), "{names:?}");
    let listed = list_images(cache.path()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].name.as_str(), listed[0].key.as_str()),
        ("test-base", b.key.as_str())
    );

    let mut again = Vec::new();
    let c = ensure_image(cache.path(), &recipe, &mut |l: &str| {
        again.push(l.to_string())
    })
    .unwrap();
    assert_eq!(b, c);
    assert_eq!(again.len(), 1, "{again:?}");
    assert!(again[0].contains("cached"), "{again:?}");
}

/// A build that fails (a package bookworm does not have) caches nothing
/// and leaves no temporary directory.
#[test]
fn failed_build_leaves_nothing_that_looks_cached() {
    let cache = tempfile::tempdir().unwrap();
    let recipe = ImageRecipe::named("broken", &["vmcsnap-no-such-package".into()]).unwrap();
    let mut lines = Vec::new();
    let e = ensure_image(cache.path(), &recipe, &mut |l: &str| {
        lines.push(l.to_string())
    })
    .unwrap_err();
    assert!(matches!(e, ImageError::Build { .. }), "{e}");
    assert!(e.to_string().contains("nothing was cached"), "{e}");
    assert!(!image_dir(cache.path(), &recipe).exists());
    let debris: Vec<String> = fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".lock"))
        .collect();
    assert!(debris.is_empty(), "{debris:?}");
    assert!(list_images(cache.path()).unwrap().is_empty());
}

#[test]
fn public_types_are_send_and_sync() {
    fn f<T: Send + Sync>() {}
    f::<BuiltImage>();
    f::<ImageError>();
    f::<ImageRecipe>();
    f::<CachedImage>();
}
