//! The machine's side of a test server: the `redis-server` binary, free loopback ports,
//! temporary directories, a raw `PING` and signals.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a server may take to answer its first `PING`.
pub(crate) const STARTUP: Duration = Duration::from_secs(10);
/// How long a cluster may take to agree that it is whole.
pub(crate) const CLUSTER_STARTUP: Duration = Duration::from_secs(30);
/// Ports are chosen below the kernel's ephemeral range (32768 and up on Linux), so that an
/// outgoing connection never holds a port we are about to hand to a server; a cluster node also
/// needs `port + 10_000` for its bus, which stays below 32768 too.
pub(crate) const PORT_LOW: u32 = 12_000;
pub(crate) const PORT_SPAN: u32 = 10_000;
const CLUSTER_BUS_OFFSET: u16 = 10_000;

pub(crate) static NEXT: AtomicU32 = AtomicU32::new(0);
/// Ports handed out in this process: a port that was free when checked stays free only until
/// its server binds it, so a thread must never pick one another thread is about to use. Base
/// ports (12000..22000) and bus ports (22000..32000) cannot overlap.
pub(crate) static TAKEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());

pub(crate) fn redis_server_binary() -> &'static str {
    static CHECKED: OnceLock<()> = OnceLock::new();
    CHECKED.get_or_init(|| {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            found,
            "redis-server is not on PATH: tollgate's Redis tests start real servers. \
             Install Debian's `redis-server` package (`apt-get install redis-server`; CI installs it)."
        );
    });
    "redis-server"
}

/// A number that differs between processes and between calls, to spread port and directory
/// choices of tests running at the same time.
pub(crate) fn unique() -> u32 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::process::id()
        .wrapping_mul(7_919)
        .wrapping_add(nanos / 1_000)
        .wrapping_add(n.wrapping_mul(104_729))
}

pub(crate) fn port_is_free(port: u16) -> bool {
    TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).is_ok()
}

/// A loopback port that is free now (and `port + 10_000` too when `with_bus`).
pub(crate) fn free_port(with_bus: bool) -> u16 {
    let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1_000 {
        let port = (PORT_LOW + unique() % PORT_SPAN) as u16;
        if !taken.contains(&port)
            && port_is_free(port)
            && (!with_bus || port_is_free(port + CLUSTER_BUS_OFFSET))
        {
            taken.push(port);
            return port;
        }
    }
    panic!("no free loopback port found for redis-server");
}

pub(crate) fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tollgate-{label}-{}-{}",
        std::process::id(),
        unique()
    ));
    std::fs::create_dir_all(&dir).expect("create a temporary directory for redis-server");
    dir
}

/// Sends `PING` over a raw socket and waits for `+PONG`.
pub(crate) fn pings(port: u16, timeout: Duration) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, timeout) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

pub(crate) fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid} failed");
}
