//! Image recipes: what goes into an image, and the cache key derived from it.
//!
//! A recipe is a name, the Debian packages added to the base set every image
//! has (systemd, networkd, the cloud kernel, the guest agent, sshd: see
//! `guest/image/build-image.sh`), the units the workload waits for, the
//! programs of `guest/src` compiled into `/usr/local/bin`, and the disk size.
//! Built-in: [`ImageRecipe::base`] and [`ImageRecipe::redis`]; any other
//! name is `base` plus the packages given ([`ImageRecipe::named`]). Each is
//! built from one Debian [`Suite`] (bookworm unless asked otherwise).

use sha2::{Digest, Sha256};

use super::ImageError;

/// Names of the built-in recipes.
pub const BUILTIN_RECIPES: &[&str] = &["base", "redis"];

/// Programs of `guest/src` an image can carry (compiled `gcc -static`).
pub const IMAGE_PROGRAMS: &[&str] = &["redisload"];

/// Default virtual disk size (MiB): ext4, sparse in the qcow2.
pub const DEFAULT_SIZE_MIB: u64 = 2048;

/// The Debian release an image is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Suite {
    /// Debian 12, kernel 6.1.
    #[default]
    Bookworm,
    /// Debian 13, kernel 6.12 (under QEMU 7.2's TCG the agent runs it with
    /// `-cpu max,-cx16`).
    Trixie,
}

impl Suite {
    /// Every suite vmcsnap builds, oldest first.
    pub const ALL: [Suite; 2] = [Suite::Bookworm, Suite::Trixie];

    /// Debian's name of the suite (`bookworm`, `trixie`).
    pub fn name(self) -> &'static str {
        match self {
            Suite::Bookworm => "bookworm",
            Suite::Trixie => "trixie",
        }
    }

    /// The suite called `name`, or an error listing the ones vmcsnap builds.
    pub fn parse(name: &str) -> Result<Suite, ImageError> {
        Suite::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                ImageError::InvalidRecipe(format!(
                    "Debian suite {name:?}: vmcsnap builds bookworm (Debian 12) and trixie (Debian 13)"
                ))
            })
    }
}

impl std::fmt::Display for Suite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Suite {
    type Err = ImageError;
    fn from_str(s: &str) -> Result<Suite, ImageError> {
        Suite::parse(s)
    }
}

/// What to build; see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecipe {
    /// `[a-z0-9][a-z0-9.-]*`, at most 40 characters: the cache directory's
    /// and `/etc/vmcsnap-image`'s name.
    pub name: String,
    /// The Debian release.
    pub suite: Suite,
    /// Debian packages (the suite's main) on top of the base set.
    pub packages: Vec<String>,
    /// Units `vmcsnap-workload.service` starts after (besides network-online).
    pub services: Vec<String>,
    /// Programs of [`IMAGE_PROGRAMS`] to install into `/usr/local/bin`.
    pub programs: Vec<String>,
    /// Virtual size of the root disk in MiB.
    pub size_mib: u64,
}

impl ImageRecipe {
    /// Debian with systemd, networkd (DHCP), sshd and the QEMU guest agent.
    pub fn base() -> Self {
        ImageRecipe {
            name: "base".into(),
            suite: Suite::Bookworm,
            packages: Vec::new(),
            services: Vec::new(),
            programs: Vec::new(),
            size_mib: DEFAULT_SIZE_MIB,
        }
    }

    /// `base` + Redis (listening on every address, no protected mode) and
    /// the verifying load client `/usr/local/bin/redisload`.
    pub fn redis() -> Self {
        ImageRecipe {
            name: "redis".into(),
            suite: Suite::Bookworm,
            packages: vec!["redis-server".into(), "redis-tools".into()],
            services: vec!["redis-server.service".into()],
            programs: vec!["redisload".into()],
            size_mib: DEFAULT_SIZE_MIB,
        }
    }

    /// A built-in recipe by name.
    pub fn builtin(name: &str) -> Option<Self> {
        match name {
            "base" => Some(Self::base()),
            "redis" => Some(Self::redis()),
            _ => None,
        }
    }

    /// This recipe built from `suite`.
    pub fn with_suite(mut self, suite: Suite) -> Self {
        self.suite = suite;
        self
    }

    /// The built-in recipe `name` with `extra` packages added, or, for any
    /// other name, `base` plus `extra` under that name. Validated.
    pub fn named(name: &str, extra: &[String]) -> Result<Self, ImageError> {
        let mut r = Self::builtin(name).unwrap_or_else(|| ImageRecipe {
            name: name.to_string(),
            ..Self::base()
        });
        for p in extra {
            if !r.packages.contains(p) {
                r.packages.push(p.clone());
            }
        }
        r.validate()?;
        Ok(r)
    }

    /// Checks every field (they end up on a command line and in file names).
    pub fn validate(&self) -> Result<(), ImageError> {
        let bad = |what: String| Err(ImageError::InvalidRecipe(what));
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 40
            && self.name.as_bytes()[0].is_ascii_alphanumeric()
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !name_ok {
            return bad(format!(
                "image name {:?}: use 1-40 characters of a-z 0-9 . - starting with a letter or digit",
                self.name
            ));
        }
        for p in &self.packages {
            // Debian policy 5.6.1, plus an optional :arch or =version is not allowed.
            let ok = p.len() >= 2
                && p.as_bytes()[0].is_ascii_alphanumeric()
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
            if !ok {
                return bad(format!("package name {p:?} is not a Debian package name"));
            }
        }
        for s in &self.services {
            let ok = !s.is_empty()
                && s.len() <= 100
                && s.contains('.')
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"@._-:".contains(&b));
            if !ok {
                return bad(format!(
                    "unit name {s:?}: expected something like redis-server.service"
                ));
            }
        }
        for p in &self.programs {
            if !IMAGE_PROGRAMS.contains(&p.as_str()) {
                return bad(format!(
                    "program {p:?}: images can carry {IMAGE_PROGRAMS:?}"
                ));
            }
        }
        if !(1024..=1 << 20).contains(&self.size_mib) {
            return bad(format!(
                "disk size {} MiB: use 1024 MiB to 1 TiB",
                self.size_mib
            ));
        }
        Ok(())
    }

    /// Short hex SHA-256 (16 digits) of the recipe (packages, services and
    /// programs sorted: order does not matter) and of `files` (the embedded
    /// build scripts and C sources, as (path, contents)).
    pub fn key_with(&self, files: &[(&str, &str)]) -> String {
        let mut h = Sha256::new();
        let mut field = |tag: &str, v: &[u8]| {
            h.update(tag.as_bytes());
            h.update((v.len() as u64).to_le_bytes());
            h.update(v);
        };
        field("format", super::FORMAT.as_bytes());
        field("name", self.name.as_bytes());
        field("suite", self.suite.name().as_bytes());
        for (tag, list) in [
            ("package", &self.packages),
            ("service", &self.services),
            ("program", &self.programs),
        ] {
            let mut sorted: Vec<&String> = list.iter().collect();
            sorted.sort();
            sorted.dedup();
            for v in sorted {
                field(tag, v.as_bytes());
            }
        }
        field("size_mib", &self.size_mib.to_le_bytes());
        for (path, contents) in files {
            field("path", path.as_bytes());
            field("contents", contents.as_bytes());
        }
        h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_valid_and_redis_extends_base() {
        for n in BUILTIN_RECIPES {
            let r = ImageRecipe::builtin(n).unwrap();
            assert_eq!(&r.name, n);
            r.validate().unwrap();
        }
        let r = ImageRecipe::redis();
        assert!(r.packages.contains(&"redis-server".to_string()));
        assert_eq!(r.programs, ["redisload"]);
        assert_eq!(ImageRecipe::builtin("nope"), None);
        assert_eq!(ImageRecipe::redis().suite, Suite::Bookworm);
    }

    #[test]
    fn suites_parse_by_debian_name_and_nothing_else() {
        for s in Suite::ALL {
            assert_eq!(Suite::parse(s.name()).unwrap(), s);
            assert_eq!(s.to_string(), s.name());
        }
        assert_eq!("trixie".parse::<Suite>().unwrap(), Suite::Trixie);
        for bad in ["", "Trixie", "sid", "bullseye", "trixie ", "13"] {
            let e = Suite::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("bookworm") && e.contains("trixie"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn named_adds_packages_to_base_or_a_builtin() {
        let r = ImageRecipe::named("pg", &["postgresql".into()]).unwrap();
        assert_eq!(
            (r.name.as_str(), r.packages.as_slice()),
            ("pg", &["postgresql".to_string()][..])
        );
        assert!(r.programs.is_empty());
        let r = ImageRecipe::named("redis", &["curl".into(), "redis-tools".into()]).unwrap();
        assert_eq!(r.packages, ["redis-server", "redis-tools", "curl"]);
        assert_eq!(
            ImageRecipe::named("redis", &[]).unwrap(),
            ImageRecipe::redis()
        );
    }

    #[test]
    fn bad_recipes_are_rejected() {
        for name in ["", "Redis", "-x", ".x", "a b", "a/b", &"n".repeat(41), "é"] {
            assert!(ImageRecipe::named(name, &[]).is_err(), "{name:?}");
        }
        for p in [
            "",
            "a",
            "Foo",
            "foo bar",
            "foo;rm",
            "foo,bar",
            "-foo",
            "foo=1.0",
            "foo:amd64",
        ] {
            assert!(ImageRecipe::named("x", &[p.to_string()]).is_err(), "{p:?}");
        }
        let mut r = ImageRecipe::base();
        r.services = vec!["a b.service".into()];
        assert!(r.validate().is_err());
        let mut r = ImageRecipe::base();
        r.programs = vec!["memtouch".into()];
        assert!(r.validate().is_err());
        let mut r = ImageRecipe::base();
        r.size_mib = 100;
        assert!(r.validate().is_err());
    }

    #[test]
    fn key_covers_every_input_but_not_order() {
        let files = [("a.sh", "echo a"), ("b.c", "int x;")];
        let r = ImageRecipe::named("x", &["aa".into(), "bb".into()]).unwrap();
        let k = r.key_with(&files);
        assert_eq!(k.len(), 16);
        let mut same = r.clone();
        same.packages.reverse();
        assert_eq!(same.key_with(&files), k);
        let mut variants = Vec::new();
        let mut v = r.clone();
        v.name = "y".into();
        variants.push(v);
        let mut v = r.clone();
        v.packages.push("cc".into());
        variants.push(v);
        let mut v = r.clone();
        v.services.push("cc.service".into());
        variants.push(v);
        let mut v = r.clone();
        v.programs.push("redisload".into());
        variants.push(v);
        let mut v = r.clone();
        v.size_mib += 1;
        variants.push(v);
        variants.push(r.clone().with_suite(Suite::Trixie));
        for v in &variants {
            assert_ne!(v.key_with(&files), k, "{v:?}");
        }
        assert_ne!(r.key_with(&[("a.sh", "echo b"), ("b.c", "int x;")]), k);
        assert_ne!(r.key_with(&[("a.sh", "echo a")]), k);
        // A package name cannot pass for a service.
        let mut p = ImageRecipe::base();
        p.packages = vec!["z.service".into()];
        let mut s = ImageRecipe::base();
        s.services = vec!["z.service".into()];
        assert_ne!(p.key_with(&files), s.key_with(&files));
    }
}
