//! A QEMU version vmcsnap does not speak is one clear error at `up`, before
//! anything is asked of the VM (issue 30). The QEMU here is a stand-in (a
//! small Python program given as `VMCSNAP_QEMU`) whose `--version` says
//! what `FAKE_QEMU_VERSION` holds, that answers QMP like a QEMU 9.2.0 and
//! records every command it gets. Two lines of defence: `up` asks the
//! binary's `--version` before starting anything; and a QEMU whose QMP
//! greeting reports a version vmcsnap does not speak is refused after the
//! greeting's `qmp_capabilities` (and the teardown's `quit`), nothing else.

mod common;

use common::Env;

const FAKE_QEMU: &str = r#"#!/usr/bin/env python3
import json, os, socket, sys, threading
args = sys.argv[1:]
if "--version" in args:
    print("QEMU emulator version " + os.environ["FAKE_QEMU_VERSION"])
    sys.exit(0)
open(os.environ["FAKE_QEMU_RECORD"] + ".started", "w").close()
qmp = [a.split(",")[0][len("unix:"):] for i, a in enumerate(args) if i > 0 and args[i - 1] == "-qmp"]
record = os.environ["FAKE_QEMU_RECORD"]

def serve(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(4)
    while True:
        c, _ = s.accept()
        threading.Thread(target=session, args=(c,), daemon=True).start()

def session(c):
    f = c.makefile("rw")
    f.write(json.dumps({"QMP": {"version": {"qemu": {"major": 9, "minor": 2, "micro": 0},
                                            "package": ""}, "capabilities": []}}) + "\n")
    f.flush()
    for line in f:
        msg = json.loads(line)
        with open(record, "a") as r:
            r.write(msg.get("execute", "?") + "\n")
        reply = {"return": {}}
        if "id" in msg:
            reply["id"] = msg["id"]
        f.write(json.dumps(reply) + "\n")
        f.flush()
        if msg.get("execute") == "quit":
            os._exit(0)

for p in qmp[1:]:
    threading.Thread(target=serve, args=(p,), daemon=True).start()
serve(qmp[0])
"#;

/// `up` with the stand-in whose `--version` says `version`: its error, and
/// the QMP commands the stand-in got (`None`: it was never started).
fn up_on_fake(version: &str) -> (String, Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("qemu-system-x86_64");
    std::fs::write(&fake, FAKE_QEMU).unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let record = dir.path().join("commands");
    let mut env = Env::with_qemu(&fake);
    env.extra_env
        .push(("FAKE_QEMU_RECORD".into(), record.display().to_string()));
    env.extra_env
        .push(("FAKE_QEMU_VERSION".into(), version.to_string()));
    let spec = env.write_spec(
        "[cluster]\nname = \"uq\"\naccel = \"tcg\"\n\n[[vm]]\nname = \"a\"\nmemory_mib = 128\n",
    );
    let out = env.vmcsnap(&["up", spec.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "up succeeded on QEMU 9.2.0");
    assert!(
        stderr.contains("QEMU 9.2.0 is not supported") && stderr.contains("install-qemu.sh"),
        "{stderr}"
    );
    let started = record.with_extension("started").exists();
    let commands = started.then(|| std::fs::read_to_string(&record).unwrap_or_default());
    eprintln!("up said: {stderr}");
    // Torn down: no QEMU, socket or RAM file left (the agent exits idle).
    env.assert_clean();
    (stderr.into_owned(), commands)
}

#[test]
fn up_on_a_qemu_binary_of_an_unknown_version_fails_before_starting_it() {
    let (_, commands) = up_on_fake("9.2.0");
    assert_eq!(commands, None, "the QEMU was started");
}

#[test]
fn a_qemu_that_greets_with_an_unknown_version_is_asked_nothing_more() {
    // --version says 10.0.2 (it passes the first check); QMP says 9.2.0.
    let (_, commands) = up_on_fake("10.0.2");
    let commands = commands.expect("the stand-in QEMU was started");
    assert!(
        commands
            .lines()
            .all(|c| c == "qmp_capabilities" || c == "quit"),
        "the VM was asked for more than its greeting: {commands}"
    );
    assert!(commands.contains("qmp_capabilities"), "{commands}");
}
