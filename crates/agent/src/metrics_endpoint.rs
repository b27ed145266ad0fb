//! The HTTP endpoint operators scrape (`GET /metrics`): it serves whatever
//! text it is given to render (the agent gives `crate::metrics::render`),
//! and knows nothing of the figures.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// Why the metrics endpoint could not be served.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound.
    #[error("cannot listen for metrics on {addr}: {source}; give a free address such as 127.0.0.1:9187 to --metrics-listen (or VMCSNAP_METRICS_LISTEN)")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
}

/// Serves the text `render` gives (`crate::metrics::render`) over HTTP at `addr` (`GET /metrics`) from a thread of
/// its own; returns the address bound (its port when `addr`'s was 0).
pub fn serve(addr: SocketAddr, render: fn() -> String) -> Result<SocketAddr, MetricsError> {
    let bind = |source| MetricsError::Bind { addr, source };
    let listener = TcpListener::bind(addr).map_err(bind)?;
    let local = listener.local_addr().map_err(bind)?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(e) = answer(stream, render) {
                    tracing::debug!(error = %e, "metrics scrape failed");
                }
            }
        })
        .map_err(bind)?;
    Ok(local)
}

/// Answers one HTTP request: the metrics for `GET /metrics`, 404 otherwise.
fn answer(mut s: TcpStream, render: fn() -> String) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let ok = line.starts_with("GET /metrics ") || line.starts_with("GET /metrics?");
    let (status, ctype, body) = if ok {
        let ctype = "application/openmetrics-text; version=1.0.0; charset=utf-8";
        ("200 OK", ctype, render())
    } else {
        let body = "not found: the metrics are at GET /metrics\n".to_string();
        ("404 Not Found", "text/plain; charset=utf-8", body)
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(reply.as_bytes())
}
