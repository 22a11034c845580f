//! The hand-written Redis limiter that tollgate is measured against.
//!
//! What a team writes when it needs a shared limit by Friday: per request, `INCR` a counter
//! named after the client address, then `EXPIRE <key> 60 NX` so the first request of a window
//! starts a 60-second TTL, and answer 429 once the count passes the limit. Two commands and two
//! round trips per request, every request, allowed or not. A failed Redis call lets the request
//! through, as such middleware usually does.

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use redis::aio::MultiplexedConnection;

/// The middleware's state: one multiplexed connection shared by every request, and the limit.
#[derive(Clone)]
pub struct NaiveIncr {
    conn: MultiplexedConnection,
    limit: u64,
}

impl std::fmt::Debug for NaiveIncr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NaiveIncr")
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl NaiveIncr {
    /// Connects to `url` and limits each client address to `limit` requests per 60 s window.
    ///
    /// # Errors
    ///
    /// When the URL is invalid or Redis cannot be reached.
    pub async fn connect(url: &str, limit: u64) -> redis::RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let conn = client.get_multiplexed_async_connection().await?;
        Ok(Self { conn, limit })
    }

    /// The middleware, for `axum::middleware::from_fn_with_state`.
    pub async fn middleware(State(state): State<Self>, req: Request, next: Next) -> Response {
        let Some(ConnectInfo(peer)) = req.extensions().get::<ConnectInfo<SocketAddr>>() else {
            return next.run(req).await;
        };
        let key = format!("naive:{}", peer.ip());
        let mut conn = state.conn.clone();
        let count: redis::RedisResult<u64> =
            redis::cmd("INCR").arg(&key).query_async(&mut conn).await;
        let expire: redis::RedisResult<i64> = redis::cmd("EXPIRE")
            .arg(&key)
            .arg(60)
            .arg("NX")
            .query_async(&mut conn)
            .await;
        match (count, expire) {
            (Ok(count), Ok(_)) if count > state.limit => {
                (StatusCode::TOO_MANY_REQUESTS, Body::from("slow down\n")).into_response()
            }
            _ => next.run(req).await,
        }
    }
}
