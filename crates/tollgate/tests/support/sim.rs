//! A simulated service for the adaptive limit's tests: `workers` requests run at once, each
//! for `work` of Tokio's time (1 ms while `fast`); the others wait for a worker.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Semaphore;
use tower::util::BoxCloneSyncService;

pub type SimService = BoxCloneSyncService<Request<Full<Bytes>>, Response<Full<Bytes>>, Infallible>;

#[derive(Clone)]
pub struct Sim {
    workers: Arc<Semaphore>,
    work: Duration,
    pub fast: Arc<AtomicBool>,
    /// Requests in the handler now (running or waiting for a worker), and the most seen.
    running: Arc<AtomicU32>,
    max_running: Arc<AtomicU32>,
    /// Answers with this status instead of 200 while not 0.
    pub status: Arc<AtomicU32>,
}

impl Sim {
    pub fn new(workers: usize, work: Duration) -> Self {
        Self {
            workers: Arc::new(Semaphore::new(workers)),
            work,
            fast: Arc::default(),
            running: Arc::default(),
            max_running: Arc::default(),
            status: Arc::default(),
        }
    }

    /// Lets `n` more requests run at once (a service of no workers holds every request
    /// until then).
    pub fn open(&self, n: usize) {
        self.workers.add_permits(n);
    }

    pub fn running(&self) -> u32 {
        self.running.load(Ordering::SeqCst)
    }

    pub fn max_running(&self) -> u32 {
        self.max_running.load(Ordering::SeqCst)
    }

    /// The service; `on_entry` sees the requests in the handler, this one included, as it
    /// enters.
    pub fn service_with(
        &self,
        on_entry: impl Fn(&Request<Full<Bytes>>, u32) + Send + Sync + Clone + 'static,
    ) -> SimService {
        let sim = self.clone();
        BoxCloneSyncService::new(tower::service_fn(move |req: Request<Full<Bytes>>| {
            let sim = sim.clone();
            let now = sim.running.fetch_add(1, Ordering::SeqCst) + 1;
            sim.max_running.fetch_max(now, Ordering::SeqCst);
            on_entry(&req, now);
            let leaving = Leaving(Arc::clone(&sim.running));
            let fut: Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(async move {
                let _leaving = leaving;
                let worker = sim.workers.acquire().await.unwrap();
                let work = if sim.fast.load(Ordering::SeqCst) {
                    Duration::from_millis(1)
                } else {
                    sim.work
                };
                tokio::time::sleep(work).await;
                drop(worker);
                let mut response = Response::new(Full::new(Bytes::new()));
                let status = sim.status.load(Ordering::SeqCst);
                if status != 0 {
                    *response.status_mut() = StatusCode::from_u16(status as u16).unwrap();
                }
                Ok(response)
            });
            fut
        }))
    }

    pub fn service(&self) -> SimService {
        self.service_with(|_, _| {})
    }
}

/// Counts a request out of the handler when its future ends or is dropped.
struct Leaving(Arc<AtomicU32>);

impl Drop for Leaving {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
