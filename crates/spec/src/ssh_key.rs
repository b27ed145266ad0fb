//! What counts as an SSH public key in `ssh_authorized_keys` (a list entry
//! or a line of a keys file): one line of OpenSSH's `authorized_keys`
//! format, `[OPTIONS] TYPE BASE64 [COMMENT]`, whose TYPE is a key type
//! OpenSSH knows and whose BASE64 decodes to a key blob of that same type
//! (the blob starts with its type as a length-prefixed string). So a typo,
//! a private key, a fingerprint or any other text is refused before a VM
//! boots, instead of a guest nobody can log in to.

/// The key types OpenSSH accepts in `authorized_keys` (`ssh -Q key`).
pub const KEY_TYPES: &[&str] = &[
    "ssh-ed25519",
    "ssh-rsa",
    "ssh-dss",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
    "ssh-ed25519-cert-v01@openssh.com",
    "ssh-rsa-cert-v01@openssh.com",
    "ssh-dss-cert-v01@openssh.com",
    "ecdsa-sha2-nistp256-cert-v01@openssh.com",
    "ecdsa-sha2-nistp384-cert-v01@openssh.com",
    "ecdsa-sha2-nistp521-cert-v01@openssh.com",
    "sk-ssh-ed25519-cert-v01@openssh.com",
    "sk-ecdsa-sha2-nistp256-cert-v01@openssh.com",
];

/// Checks one public key line; the error says what is wrong with it.
pub fn check_public_key(line: &str) -> Result<(), String> {
    let line = line.trim();
    if line.is_empty() {
        return Err("an empty key".into());
    }
    if line.contains(['\n', '\r']) {
        return Err("a key spans several lines: give one key per list entry".into());
    }
    if line.contains("PRIVATE KEY") {
        return Err("this is a private key: give the public one (the .pub file)".into());
    }
    let rest = strip_options(line);
    let mut words = rest.split_whitespace();
    let mut kind = words.next().unwrap_or_default();
    if !KEY_TYPES.contains(&kind) {
        // Name what the line starts with, options or not.
        kind = line.split_whitespace().next().unwrap_or_default();
        return Err(format!(
            "{kind:?} is not an SSH key type (expected \"TYPE BASE64 [COMMENT]\" with TYPE one of ssh-ed25519, ssh-rsa, ecdsa-sha2-nistp256, ...: a line of a .pub file)"
        ));
    }
    let Some(b64) = words.next() else {
        return Err(format!("the {kind} key has no BASE64 part"));
    };
    let blob = decode_base64(b64)
        .ok_or_else(|| format!("the {kind} key's BASE64 part does not decode"))?;
    if blob_type(&blob) != Some(kind.as_bytes()) {
        return Err(format!(
            "the {kind} key's BASE64 part is not a {kind} key (truncated or from another key?)"
        ));
    }
    Ok(())
}

/// The line without its leading `authorized_keys` options, if it has
/// some (a first word that is no key type: options are separated by
/// commas and may hold quoted spaces).
fn strip_options(line: &str) -> &str {
    let first = line.split_whitespace().next().unwrap_or_default();
    if KEY_TYPES.contains(&first) {
        return line;
    }
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => return line[i..].trim_start(),
            _ => {}
        }
    }
    line
}

/// Standard base64 with its padding, as in `.pub` files; `None` if `text`
/// is not that. (Small enough not to add a dependency to the spec crate,
/// whose fuzz target builds on its own lock file.)
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    if bytes.is_empty() || !bytes.len().is_multiple_of(4) {
        return None;
    }
    let pad = bytes.iter().rev().take_while(|&&b| b == b'=').count();
    if pad > 2 {
        return None;
    }
    let value = |b: u8| -> Option<u32> {
        Some(u32::from(match b {
            b'A'..=b'Z' => b - b'A',
            b'a'..=b'z' => b - b'a' + 26,
            b'0'..=b'9' => b - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    };
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    let body = bytes.len() - pad;
    for (i, quad) in bytes.chunks(4).enumerate() {
        let mut n = 0u32;
        for (j, &b) in quad.iter().enumerate() {
            let v = if i * 4 + j >= body { 0 } else { value(b)? };
            n = n << 6 | v;
        }
        out.extend_from_slice(&n.to_be_bytes()[1..]);
    }
    out.truncate(out.len() - pad);
    Some(out)
}

/// The type string a key blob starts with (a big-endian u32 length and
/// that many bytes).
fn blob_type(blob: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(blob.get(..4)?.try_into().ok()?) as usize;
    blob.get(4..4usize.checked_add(len)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real keys (made with ssh-keygen for these tests).
    const ED25519: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILMxwQyC9ziD+RIBARpGDOb53+S2IbtAwf2E5OZE2ZQe me@host";
    const ECDSA: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBA0ZzeXkTcyaxATdlLQrp0fkbnFdKgKfyY+rXahpjxbUE3Y6xxx1oDF7HwQ8aJpFZ3Wp8JiShhJYaRXMlcCilWY= e";

    #[test]
    fn base64_decodes_like_the_standard() {
        assert_eq!(decode_base64("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(decode_base64("aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(decode_base64("aGk=").unwrap(), b"hi");
        assert_eq!(decode_base64("aA==").unwrap(), b"h");
        for bad in ["", "aGk", "a===", "aG!=", "aGVsbG8"] {
            assert!(decode_base64(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn real_keys_pass_with_or_without_comment_and_options() {
        for k in [
            ED25519,
            ECDSA,
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILMxwQyC9ziD+RIBARpGDOb53+S2IbtAwf2E5OZE2ZQe",
            &format!("  {ED25519}  "),
            &format!("from=\"10.0.0.1,a b\",no-pty {ED25519}"),
        ] {
            assert_eq!(check_public_key(k), Ok(()), "{k}");
        }
    }

    /// Regression (issue 29): `ssh_authorized_keys = ["not a key"]` passed
    /// (three words looked like TYPE BASE64 COMMENT).
    #[test]
    fn text_that_is_no_key_is_refused_with_the_reason() {
        let cases = [
            ("not a key", "\"not\" is not an SSH key type"),
            ("", "empty"),
            ("ssh-ed25519", "no BASE64"),
            ("ssh-ed25519 AAAA", "not a ssh-ed25519 key"),
            ("ssh-ed25519 !!notbase64!! x", "does not decode"),
            ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILMx= x", "does not decode"),
            (
                // An ECDSA blob under the ed25519 type.
                "ssh-ed25519 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBA0ZzeXkTcyaxATdlLQrp0fkbnFdKgKfyY+rXahpjxbUE3Y6xxx1oDF7HwQ8aJpFZ3Wp8JiShhJYaRXMlcCilWY=",
                "not a ssh-ed25519 key",
            ),
            ("-----BEGIN OPENSSH PRIVATE KEY-----", "private key"),
            ("SHA256:abcdef me@host", "not an SSH key type"),
            ("ssh-ed25519 AAAA\nssh-rsa BBBB", "several lines"),
        ];
        for (k, want) in cases {
            let e = check_public_key(k).unwrap_err();
            assert!(e.contains(want), "{k:?}: {e}");
        }
    }
}
