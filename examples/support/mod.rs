//! What the examples share: logs filtered by `RUST_LOG`, the `PORT` they listen on, and
//! start-up errors told in one line that says what failed and why.

use std::error::Error;
use std::io::IsTerminal;
use std::net::Ipv4Addr;
use std::process::ExitCode;

use tokio::net::TcpListener;
use tracing_subscriber::filter::{EnvFilter, LevelFilter};

/// Logs to stderr at the level `RUST_LOG` sets (default `info`): the example's own lines, and
/// tollgate's (a refused reload, a backend that fails, a server without peer addresses).
pub(crate) fn init_logging() -> Result<(), String> {
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .from_env()
        .map_err(|e| {
            let value = std::env::var("RUST_LOG").unwrap_or_default();
            format!("RUST_LOG={value:?} is not a log filter (e.g. `info` or `tollgate=debug`): {e}")
        })?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(())
}

/// The port in `PORT`, or `default` when it is not set.
pub(crate) fn port(default: u16) -> Result<u16, String> {
    match std::env::var("PORT") {
        Ok(text) => text
            .trim()
            .parse()
            .map_err(|e| format!("PORT={text:?} is not a port number: {e}")),
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(e) => Err(format!("PORT: {e}")),
    }
}

/// Listens on 127.0.0.1:`port`.
pub(crate) async fn listen(port: u16) -> Result<TcpListener, String> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{port} (set PORT for another port): {e}"))
}

/// Exits 0, or prints the error and each error under it on one line and exits 1.
pub(crate) fn exit(result: Result<(), Box<dyn Error>>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", chain(&*e));
            ExitCode::FAILURE
        }
    }
}

/// `e`, then each error under it, separated by `: `; a cause already in the text once is not
/// repeated (some errors print their cause themselves).
pub(crate) fn chain(e: &dyn Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}
