//! redisload (guest/src/redisload.c) against a real redis-server on
//! loopback: a clean run verifies with no errors, broken connections are
//! survived without false alarms, and data changed behind its back is
//! reported as corruption. Also a fake server speaking garbage.
//!
//! Needs redis-server, redis-cli and gcc (scripts/install-deps.sh); the test
//! fails if they are missing.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn repo_guest_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest")
}

/// Compiles redisload with build.sh's flags into `dir`.
fn build_redisload(dir: &Path) -> PathBuf {
    let out = dir.join("redisload");
    let st = Command::new("gcc")
        .args(["-static", "-O2", "-Wall", "-Wextra", "-Werror", "-s", "-o"])
        .arg(&out)
        .arg(repo_guest_dir().join("src/redisload.c"))
        .status()
        .expect("gcc (apt-get install gcc libc6-dev)");
    assert!(st.success(), "compiling redisload failed");
    out
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Redis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Redis {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server not found: run scripts/install-deps.sh (apt-get install redis-server redis-tools)");
        let r = Redis {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while r.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli not found: apt-get install redis-tools");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(bin: &Path, port: u16, args: &[&str]) -> Child {
    Command::new(bin)
        .args(["127.0.0.1", &port.to_string()])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The numbers of the last status line.
fn last_status(out: &str) -> Vec<(String, u64)> {
    let line = out
        .lines()
        .rfind(|l| l.starts_with("redisload: t=") && l.contains(" sets="))
        .expect(out);
    line.split(' ')
        .skip(1)
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

fn field(st: &[(String, u64)], k: &str) -> u64 {
    st.iter().find(|(n, _)| n == k).map(|(_, v)| *v).unwrap()
}

/// Waits until the client printed a status line, i.e. it wrote some keys.
fn wait_for_status(port: u16, redis: &Redis) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while redis.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap_or(0) == 0 {
        assert!(
            Instant::now() < deadline,
            "redisload wrote nothing to port {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn clean_run_verifies_every_key_with_no_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build_redisload(dir.path());
    let redis = Redis::start();
    let o = run(&bin, redis.port, &["-k", "500", "-d", "2"])
        .wait_with_output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let st = last_status(&out);
    assert_eq!(field(&st, "errors"), 0, "{out}");
    assert!(field(&st, "sets") > 0 && field(&st, "gets") > 0, "{out}");
    assert_eq!(field(&st, "sets"), field(&st, "acked"), "{out}");
    assert!(out.contains("redisload: done, errors=0"), "{out}");
    assert!(!out.contains("REDISLOAD-CORRUPTION"), "{out}");
}

#[test]
fn killed_connections_are_survived_without_false_alarms() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build_redisload(dir.path());
    let redis = Redis::start();
    let child = run(&bin, redis.port, &["-k", "50", "-d", "3"]);
    wait_for_status(redis.port, &redis);
    for _ in 0..5 {
        redis.cli(&["CLIENT", "KILL", "TYPE", "normal"]);
        std::thread::sleep(Duration::from_millis(300));
    }
    let o = child.wait_with_output().unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let st = last_status(&out);
    assert!(field(&st, "reconnects") >= 1, "{out}");
    assert_eq!(field(&st, "conn"), field(&st, "reconnects") + 1, "{out}");
    assert_eq!(field(&st, "errors"), 0, "{out}");
}

#[test]
fn flushall_behind_its_back_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build_redisload(dir.path());
    let redis = Redis::start();
    let child = run(&bin, redis.port, &["-k", "100", "-r", "500", "-d", "3"]);
    wait_for_status(redis.port, &redis);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(redis.cli(&["FLUSHALL"]).trim(), "OK");
    let o = child.wait_with_output().unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(field(&last_status(&out), "errors") >= 1, "{out}");
    let bad = out
        .lines()
        .find(|l| l.starts_with("REDISLOAD-CORRUPTION key=key:"))
        .expect(&out);
    assert!(bad.ends_with(" got=nil"), "{bad}");
}

#[test]
fn a_changed_value_is_reported_with_what_was_found() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build_redisload(dir.path());
    let redis = Redis::start();
    // One key, reads only (the first operation writes it): nothing but this
    // client's single write can explain the value.
    let child = run(
        &bin,
        redis.port,
        &["-k", "1", "-w", "0", "-r", "200", "-d", "3"],
    );
    wait_for_status(redis.port, &redis);
    assert_eq!(redis.cli(&["SET", "key:0", "bogus"]).trim(), "OK");
    let o = child.wait_with_output().unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    let bad: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("REDISLOAD-CORRUPTION"))
        .collect();
    assert_eq!(bad.len(), 1, "counted once, then adopted:\n{out}");
    assert!(
        bad[0].starts_with("REDISLOAD-CORRUPTION key=key:0 want=1 got='bogus'"),
        "{}",
        bad[0]
    );
    assert_eq!(field(&last_status(&out), "errors"), 1, "{out}");
}

/// The `full-check` lines of an output: (keys, errors).
fn full_checks(out: &str) -> Vec<(u64, u64)> {
    out.lines()
        .filter(|l| l.contains(" full-check "))
        .map(|l| {
            let f = |k: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(k)?.parse::<u64>().ok())
                    .unwrap()
            };
            (f("keys="), f("errors="))
        })
        .collect()
}

#[test]
fn full_checks_read_back_every_key_and_count_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build_redisload(dir.path());
    let redis = Redis::start();
    let child = run(
        &bin,
        redis.port,
        &["-k", "200", "-r", "400", "-V", "1", "-d", "4"],
    );
    wait_for_status(redis.port, &redis);
    std::thread::sleep(Duration::from_millis(1500));
    // Written keys go missing behind its back: the next full check sees them.
    assert_eq!(redis.cli(&["FLUSHALL"]).trim(), "OK");
    let o = child.wait_with_output().unwrap();
    let out = text(&o);
    let checks = full_checks(&out);
    assert!(
        checks.len() >= 2,
        "a full check every second:
{out}"
    );
    assert!(
        checks[0].0 > 0 && checks[0].1 == 0,
        "clean before the flush: {checks:?}
{out}"
    );
    assert!(
        checks.iter().any(|c| c.1 > 0),
        "the flush was seen by a full check: {checks:?}
{out}"
    );
}

/// A fake server answering every request with `reply`.
fn fake_server(reply: &'static [u8]) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s): Result<TcpStream, _> = s else {
                return;
            };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(reply).is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

#[test]
fn malformed_replies_drop_the_connection_and_never_crash() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build_redisload(dir.path());
    for (reply, why) in [
        (&b"*1\r\n"[..], "unexpected reply type"),
        (&b"$99999999\r\n"[..], "bad bulk length"),
        (&b"$-5\r\n"[..], "bad bulk length"),
        (&b"$3\r\nabcXY"[..], "bulk not followed by CRLF"),
    ] {
        let port = fake_server(reply);
        let o = run(&bin, port, &["-k", "10", "-d", "1", "-t", "1"])
            .wait_with_output()
            .unwrap();
        let out = text(&o);
        assert!(out.contains(&format!("lost: {why}")), "{reply:?}:\n{out}");
        assert!(field(&last_status(&out), "reconnects") >= 1, "{out}");
        // Sets that got no valid answer are in doubt: the final pass cannot
        // resolve them against this server and says so.
        assert_eq!(o.status.code(), Some(1), "{out}");
        assert!(out.contains("verification incomplete"), "{out}");
    }
}

#[test]
fn bad_arguments_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bin = build_redisload(dir.path());
    for args in [
        &["localhost", "6379"][..],
        &["127.0.0.1", "0"],
        &["127.0.0.1", "6379", "-k", "0"],
        &["127.0.0.1", "6379", "-s", "10"],
        &["127.0.0.1", "6379", "-w", "101"],
        &["127.0.0.1"],
    ] {
        let o = Command::new(&bin).args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains("usage: redisload"), "{args:?}");
    }
}
