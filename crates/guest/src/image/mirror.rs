//! Which Debian archive to build images from: the host's own apt
//! configuration, so that an image uses the same mirror (or proxy, or
//! snapshot) as the host, and no host name is baked into vmcsnap.
//!
//! `$VMCSNAP_DEBIAN_MIRROR` wins; otherwise the first `deb` entry for the
//! image's suite with the component `main` in `/etc/apt/sources.list`,
//! `/etc/apt/sources.list.d/*.list` (one-line format) or
//! `/etc/apt/sources.list.d/*.sources` (deb822), in that order (files of a
//! directory sorted by name, other extensions ignored, as apt does). A host
//! has entries for its own release only (a Debian 12 host: bookworm), so
//! when no entry names the suite, the first entry of any suite vmcsnap
//! builds ([`Suite::ALL`]) is taken: a Debian archive serves every release.

use std::fs;
use std::path::{Path, PathBuf};

use super::{ImageError, Suite};

/// Environment variable that overrides the mirror taken from apt's sources.
pub const MIRROR_ENV: &str = "VMCSNAP_DEBIAN_MIRROR";

/// The Debian mirror URI to build `suite` from (see the module
/// documentation).
pub fn debian_mirror(suite: Suite) -> Result<String, ImageError> {
    if let Some(m) = std::env::var_os(MIRROR_ENV).filter(|v| !v.is_empty()) {
        return Ok(m.to_string_lossy().into_owned());
    }
    let etc = Path::new("/etc/apt");
    let mut files: Vec<PathBuf> = vec![etc.join("sources.list")];
    if let Ok(rd) = fs::read_dir(etc.join("sources.list.d")) {
        let mut more: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("list" | "sources")
                )
            })
            .collect();
        more.sort();
        files.extend(more);
    }
    let texts: Vec<(PathBuf, String)> = files
        .into_iter()
        .filter_map(|p| fs::read_to_string(&p).ok().map(|t| (p, t)))
        .collect();
    mirror_for(suite, &texts).ok_or(ImageError::NoMirror)
}

/// The mirror for `suite` in apt sources files (path, text), in apt's
/// order: an entry naming `suite`, else one naming another suite vmcsnap
/// builds.
pub fn mirror_for(suite: Suite, files: &[(PathBuf, String)]) -> Option<String> {
    let fallback = Suite::ALL.into_iter().filter(|s| *s != suite);
    std::iter::once(suite)
        .chain(fallback)
        .find_map(|s| files.iter().find_map(|(p, t)| mirror_in(s.name(), p, t)))
}

/// The `suite`/main URI in one apt sources file, judged by its name.
pub fn mirror_in(suite: &str, path: &Path, text: &str) -> Option<String> {
    if path.extension().and_then(|e| e.to_str()) == Some("sources") {
        mirror_in_deb822(suite, text)
    } else {
        mirror_in_one_line(suite, text)
    }
}

/// `deb [options] URI SUITE COMPONENT...` lines.
pub fn mirror_in_one_line(want: &str, text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or("").trim();
        let rest = line.strip_prefix("deb")?;
        if !rest.starts_with([' ', '\t']) {
            return None; // deb-src, or garbage
        }
        let mut rest = rest.trim_start();
        if let Some(opts) = rest.strip_prefix('[') {
            rest = opts.split_once(']')?.1.trim_start();
        }
        let mut words = rest.split_whitespace();
        let uri = words.next()?;
        let suite = words.next()?;
        let components: Vec<&str> = words.collect();
        (suite == want && components.contains(&"main") && is_uri(uri))
            .then(|| uri.trim_end_matches('/').to_string())
    })
}

/// deb822 stanzas (`Types:`, `URIs:`, `Suites:`, `Components:`, `Enabled:`).
pub fn mirror_in_deb822(suite: &str, text: &str) -> Option<String> {
    let mut stanzas: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for line in text.lines() {
        if line.trim().is_empty() {
            stanzas.push(Vec::new());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let cur = stanzas.last_mut().expect("never empty");
        if line.starts_with([' ', '\t']) {
            // Continuation of the previous field.
            if let Some((_, v)) = cur.last_mut() {
                v.push(' ');
                v.push_str(line.trim());
            }
            continue;
        }
        if let Some((k, v)) = line.split_once(':') {
            cur.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    stanzas.iter().find_map(|s| {
        let field = |name: &str| -> Vec<&str> {
            s.iter()
                .filter(|(k, _)| k == name)
                .flat_map(|(_, v)| v.split_whitespace())
                .collect()
        };
        let enabled = field("enabled")
            .first()
            .is_none_or(|v| !v.eq_ignore_ascii_case("no"));
        let ok = enabled
            && field("types").contains(&"deb")
            && field("suites").contains(&suite)
            && field("components").contains(&"main");
        if !ok {
            return None;
        }
        field("uris")
            .into_iter()
            .find(|u| is_uri(u))
            .map(|u| u.trim_end_matches('/').to_string())
    })
}

fn is_uri(s: &str) -> bool {
    ["http://", "https://", "file:/", "mirror+", "copy:/"]
        .iter()
        .any(|p| s.starts_with(p))
        && !s.contains(['"', '\'', '\\'])
}

#[cfg(test)]
mod tests {
    use super::*;

    // Made-up addresses: never a real mirror's name in this repository.
    const A: &str = "http://mirror-a.invalid/debian";
    const B: &str = "http://mirror-b.invalid/debian";

    #[test]
    fn one_line_format() {
        let text = format!(
            "# comment\n\
             deb-src {B} bookworm main\n\
             deb {B}-security bookworm-security main\n\
             deb [signed-by=/k.gpg arch=amd64] {A}/ bookworm contrib main # trailing\n\
             deb {B} bookworm main\n"
        );
        assert_eq!(mirror_in_one_line("bookworm", &text).as_deref(), Some(A));
        assert_eq!(
            mirror_in_one_line("bookworm", &format!("deb {A} bookworm contrib\n")),
            None
        );
        assert_eq!(
            mirror_in_one_line("bookworm", &format!("deb {A} trixie main\n")),
            None
        );
        assert_eq!(
            mirror_in_one_line(
                "trixie",
                &format!("deb {B} bookworm main\ndeb {A} trixie main\n")
            )
            .as_deref(),
            Some(A)
        );
    }

    #[test]
    fn deb822_format() {
        let text = format!(
            "Types: deb\nURIs: {B}-security\nSuites: bookworm-security\nComponents: main\n\n\
             Types: deb deb-src\nURIs: {B}\nSuites: bookworm\nComponents: main\nEnabled: no\n\n\
             # the one\n\
             Types: deb\nURIs: {A}\nSuites: bookworm\n  bookworm-updates\nComponents: main\n\
             Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        );
        assert_eq!(mirror_in_deb822("bookworm", &text).as_deref(), Some(A));
        assert_eq!(
            mirror_in("bookworm", Path::new("x.sources"), &text).as_deref(),
            Some(A)
        );
        // The same text read as a .list file has no one-line entries.
        assert_eq!(mirror_in("bookworm", Path::new("x.list"), &text), None);
    }

    #[test]
    fn malformed_input_finds_nothing_and_does_not_panic() {
        for text in [
            "",
            "deb",
            "deb ",
            "deb [unterminated http://x.invalid bookworm main",
            "deb bookworm main",
            "debhttp://x.invalid bookworm main",
            "deb not-a-uri bookworm main",
            "deb \"http://x.invalid\" bookworm main",
            "\u{0}\u{ff}garbage\n:::\n",
        ] {
            assert_eq!(mirror_in_one_line("bookworm", text), None, "{text:?}");
            assert_eq!(mirror_in_deb822("bookworm", text), None, "{text:?}");
        }
        for text in [
            "Types: deb\nURIs:\nSuites: bookworm\nComponents: main\n",
            "URIs: http://x.invalid\nSuites: bookworm\nComponents: main\n",
            " continuation first\nTypes deb\n",
            "Types: deb\nURIs: http://x.invalid\nSuites: bookworm\nComponents: main\nEnabled: no\n",
        ] {
            assert_eq!(mirror_in_deb822("bookworm", text), None, "{text:?}");
        }
    }

    #[test]
    fn a_suite_without_its_own_entry_takes_another_suites_archive() {
        let files = |list: &[(&str, String)]| -> Vec<(PathBuf, String)> {
            list.iter()
                .map(|(p, t)| (PathBuf::from(p), t.clone()))
                .collect()
        };
        // A Debian 12 host: bookworm only, in deb822.
        let host = files(&[(
            "debian.sources",
            format!("Types: deb\nURIs: {A}\nSuites: bookworm bookworm-updates\nComponents: main\n"),
        )]);
        for s in Suite::ALL {
            assert_eq!(mirror_for(s, &host).as_deref(), Some(A), "{s}");
        }
        // An entry naming the suite wins over an earlier one of another suite.
        let both = files(&[
            ("a.list", format!("deb {A} bookworm main\n")),
            ("b.list", format!("deb {B} trixie main\n")),
        ]);
        assert_eq!(mirror_for(Suite::Trixie, &both).as_deref(), Some(B));
        assert_eq!(mirror_for(Suite::Bookworm, &both).as_deref(), Some(A));
        // Other suites (sid, security) are no fallback: their layout differs.
        let other = files(&[(
            "a.list",
            format!("deb {A} sid main\ndeb {B}-security trixie-security main\n"),
        )]);
        assert_eq!(mirror_for(Suite::Trixie, &other), None);
    }

    #[test]
    fn this_host_has_a_mirror() {
        // The image build depends on it; the check reads /etc/apt only.
        for s in Suite::ALL {
            let m = debian_mirror(s).unwrap_or_else(|e| panic!("{e}"));
            assert!(is_uri(&m), "{m}");
        }
    }
}
