//! Requests from a client address (and a tenant, a principal), and a service behind a layer
//! whose handler says whether the request it got was allowlisted or counted.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response};
use tollgate::engine::Backend;
use tollgate::{Decision, RateLimitLayer};
use tower::{service_fn, Layer, ServiceExt};

pub type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// `layer` around a handler that answers `allowlisted` or `counted`, from the Decision it
/// reads.
pub fn app<B: Backend>(layer: &RateLimitLayer<B>) -> Svc {
    let handler = service_fn(|req: Request<Body>| async move {
        let d = req.extensions().get::<Decision>().cloned().unwrap();
        let body = if d.is_allowlisted() {
            "allowlisted"
        } else {
            "counted"
        };
        Ok::<_, Infallible>(Response::new(Body::from(body)))
    });
    tower::util::BoxCloneService::new(
        layer
            .clone()
            .layer(handler)
            .map_response(|r| r.map(Body::new)),
    )
}

/// A request from the peer `ip`, with an `x-shop-domain` and a principal (a `String`) if
/// given.
pub fn from(ip: &str, shop: Option<&str>, user: Option<&str>) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    let ip: IpAddr = ip.parse().unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::new(ip, 4000)));
    if let Some(shop) = shop {
        req.headers_mut()
            .insert("x-shop-domain", shop.parse().unwrap());
    }
    if let Some(user) = user {
        req.extensions_mut().insert(user.to_owned());
    }
    req
}
