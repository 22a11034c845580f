//! The redis-rs clients a builder makes: one server's, the sentinels', and the certificates
//! they are made with.

use crate::error::BuildError;
use crate::tls::TlsFiles;

/// The client for one server's URL, with the builder's certificates when there are some.
pub(super) fn client(
    url: &str,
    certs: Option<&Certificates>,
    bad_url: impl Fn(redis::RedisError) -> BuildError,
) -> Result<redis::Client, BuildError> {
    let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(&bad_url)?;
    match certs {
        #[cfg(feature = "tls")]
        Some(certs) => {
            redis::Client::build_with_tls(info, certs.clone()).map_err(|e| BuildError::Tls {
                reason: e.to_string(),
            })
        }
        _ => redis::Client::open(info).map_err(bad_url),
    }
}

/// The client that asks `urls`, sentinels, where `master` is; over TLS (to the sentinels and
/// then to the master, with `certs`) when `tls`.
pub(super) fn sentinel_client(
    urls: &[String],
    master: &str,
    tls: bool,
    certs: Option<&Certificates>,
    bad_url: impl Fn(redis::RedisError) -> BuildError,
) -> Result<redis::sentinel::SentinelClient, BuildError> {
    use redis::sentinel::{SentinelClient, SentinelServerType};
    let infos = urls
        .iter()
        .map(|url| client(url, None, &bad_url).map(|c| c.get_connection_info().clone()))
        .collect::<Result<Vec<_>, _>>()?;
    #[cfg(feature = "tls")]
    if tls {
        // Only redis-rs's builder takes certificates for the master as well as for the
        // sentinels; it takes one login for every sentinel.
        let mut builder = redis::sentinel::SentinelClientBuilder::new(
            infos.iter().map(|info| info.addr().clone()),
            master,
            SentinelServerType::Master,
        )
        .map_err(&bad_url)?
        .set_client_to_redis_tls_mode(redis::TlsMode::Secure);
        if let Some(login) = infos
            .iter()
            .map(redis::ConnectionInfo::redis_settings)
            .find(|s| s.username().is_some() || s.password().is_some())
        {
            if let Some(username) = login.username() {
                builder = builder.set_client_to_sentinel_username(username);
            }
            if let Some(password) = login.password() {
                builder = builder.set_client_to_sentinel_password(password);
            }
        }
        if let Some(certs) = certs {
            builder = builder
                .set_client_to_sentinel_certificates(certs.clone())
                .set_client_to_redis_certificates(certs.clone());
        }
        return builder.build().map_err(bad_url);
    }
    let _ = (tls, certs);
    // redis-rs takes the master's name as a `String`, or with its TLS features (which another
    // crate of the build may turn on) as any `AsRef<str>`: an owned one suits both.
    #[allow(clippy::unnecessary_to_owned)]
    SentinelClient::build(infos, master.to_owned(), None, SentinelServerType::Master)
        .map_err(bad_url)
}

#[cfg(feature = "tls")]
pub(super) type Certificates = redis::TlsCertificates;
/// No certificates without the `tls` feature.
#[cfg(not(feature = "tls"))]
pub(super) type Certificates = std::convert::Infallible;

/// The builder's certificates, checked, ready for redis-rs.
pub(super) fn certificates(
    files: &TlsFiles,
    tls: bool,
) -> Result<Option<Certificates>, BuildError> {
    #[cfg(feature = "tls")]
    {
        if tls {
            crate::tls::install_provider();
        }
        files
            .certificates()
            .map_err(|reason| BuildError::Tls { reason })
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = (files, tls);
        Ok(None)
    }
}
