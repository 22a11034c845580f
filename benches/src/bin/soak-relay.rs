//! A TCP relay between the soak's servers and Redis that can hold Redis' replies back:
//! `benches/soak.sh` uses it to make Redis slower than the deadline without stopping it.
//!
//! ```text
//! soak-relay LISTEN_PORT UPSTREAM_PORT CONTROL_FILE DELAY_MS
//! ```
//!
//! Listens on 127.0.0.1:`LISTEN_PORT` and relays each connection to 127.0.0.1:`UPSTREAM_PORT`.
//! While `CONTROL_FILE` exists, every chunk of a reply waits `DELAY_MS` before it is passed on.
//! When either side closes, so does the other.

// A measurement tool: a bad argument or a failed bind should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    assert_eq!(
        args.len(),
        4,
        "usage: soak-relay LISTEN_PORT UPSTREAM_PORT CONTROL_FILE DELAY_MS"
    );
    let listen: u16 = args[0].parse().unwrap();
    let upstream: u16 = args[1].parse().unwrap();
    let control = Arc::new(PathBuf::from(&args[2]));
    let delay = Duration::from_millis(args[3].parse().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", listen)).await.unwrap();
        loop {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            let control = Arc::clone(&control);
            tokio::spawn(async move {
                if let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await {
                    relay(client, server, &control, delay).await;
                }
            });
        }
    });
}

async fn relay(client: TcpStream, server: TcpStream, control: &Path, delay: Duration) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let requests = async {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = client_rx.read(&mut buf).await {
            if server_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let replies = async {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = server_rx.read(&mut buf).await {
            if control.exists() {
                tokio::time::sleep(delay).await;
            }
            if client_tx.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        () = requests => {}
        () = replies => {}
    }
}
