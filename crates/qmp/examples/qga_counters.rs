//! Asks a guest agent for the guest's TCP counters and runs `uname -r`:
//! `cargo run -p vmcsnap-qmp --example qga_counters -- /path/to/qga.sock`.
//! For checking an image's qemu-guest-agent by hand.

use std::time::Duration;

use vmcsnap_qmp::ga::{read_tcp_counters, GuestAgent};

fn main() {
    let sock = std::env::args().nth(1).expect("usage: qga_counters SOCKET");
    let sock = std::path::Path::new(&sock);
    let t = Duration::from_secs(5);
    match read_tcp_counters(sock, t) {
        Ok(c) => println!("{c:?}"),
        Err(e) => println!("counters: {e}"),
    }
    match GuestAgent::connect(sock, t).and_then(|mut ga| ga.exec("/bin/uname", &["-r"])) {
        Ok(out) => println!(
            "uname -r: exit {:?}, stdout {:?}",
            out.exit_code,
            String::from_utf8_lossy(&out.stdout)
        ),
        Err(e) => println!("exec: {e}"),
    }
}
