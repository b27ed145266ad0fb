//! A QEMU version vmcsnap does not speak is one clear error at `up`, before
//! anything is asked of the VM (issue 30). The QEMU here is a stand-in (a
//! small Python program given as `VMCSNAP_QEMU`) that answers QMP like a
//! QEMU 9.2.0 and records every command it gets: only the greeting's
//! `qmp_capabilities` (and the teardown's `quit`) may come.

mod common;

use common::Env;

const FAKE_QEMU: &str = r#"#!/usr/bin/env python3
import json, os, socket, sys, threading
args = sys.argv[1:]
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

#[test]
fn up_on_an_unknown_qemu_version_fails_naming_it_before_touching_the_vm() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("qemu-system-x86_64");
    std::fs::write(&fake, FAKE_QEMU).unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let record = dir.path().join("commands");
    let mut env = Env::with_qemu(&fake);
    env.extra_env
        .push(("FAKE_QEMU_RECORD".into(), record.display().to_string()));
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
    let commands = std::fs::read_to_string(&record).unwrap_or_default();
    assert!(
        commands
            .lines()
            .all(|c| c == "qmp_capabilities" || c == "quit"),
        "the VM was asked for more than its greeting: {commands}"
    );
    assert!(commands.contains("qmp_capabilities"), "{commands}");
    eprintln!("up said: {stderr}");
    // Torn down: no QEMU, socket or RAM file left (the agent exits idle).
    env.assert_clean();
}
