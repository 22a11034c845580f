//! `rediss://` URLs, their certificates, and URLs fit to be printed.
//!
//! With the `tls` feature, a `rediss://` (or `valkeys://`) URL is reached over TLS through
//! redis-rs's rustls support, on rustls's `ring` provider. The server's certificate is checked
//! against the webpki roots, or against the CA given to
//! [`RedisBackendBuilder::tls_ca_pem`](crate::RedisBackendBuilder::tls_ca_pem) instead.
//! Without the feature, such a URL is a [`BuildError::TlsNotEnabled`](crate::BuildError).

/// Whether `url` asks for TLS: its scheme is `rediss` or `valkeys`.
pub(crate) fn is_tls_url(url: &str) -> bool {
    let scheme = url.trim_start().split("://").next().unwrap_or_default();
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}

/// `url` with its password replaced by `***`, fit for a log line or a banner: in the user part
/// (`redis://user:***@host/`, `redis://:***@host/`) and in a `pass` or `password` query
/// parameter (`redis+unix:///run/redis.sock?pass=***`). Anything else is kept as it is.
///
/// # Examples
///
/// ```
/// assert_eq!(
///     tollgate_redis::redact_url("rediss://app:s3cret@redis.internal:6380/0"),
///     "rediss://app:***@redis.internal:6380/0"
/// );
/// assert_eq!(
///     tollgate_redis::redact_url("redis://127.0.0.1:6379"),
///     "redis://127.0.0.1:6379"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    split_secrets(url).0
}

/// The passwords that `url` holds, as written and as redis-rs decodes them, to be blotted out
/// of a message that might quote them.
pub(crate) fn secrets_of(url: &str) -> Vec<String> {
    let mut secrets = split_secrets(url).1;
    if secrets.is_empty() {
        return secrets;
    }
    if let Ok(info) = redis::IntoConnectionInfo::into_connection_info(url) {
        if let Some(password) = info.redis_settings().password() {
            secrets.push(password.to_owned());
        }
    }
    secrets.retain(|s| !s.is_empty());
    secrets
}

/// `url` redacted, and the secrets taken out of it, as written.
fn split_secrets(url: &str) -> (String, Vec<String>) {
    let mut secrets = Vec::new();
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return (url.to_owned(), secrets);
    };
    let rest = &url[start..];
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..start]);
    // As URLs are read: the authority ends at the first `/`, `?` or `#`, and its user part
    // at the last `@` in it.
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.split_once(':') {
                Some((user, password)) => {
                    out.push_str(user);
                    out.push_str(":***");
                    secrets.push(password.to_owned());
                }
                None => out.push_str(userinfo),
            }
            out.push_str(&authority[at..]);
        }
        None => out.push_str(authority),
    }
    let tail = &rest[authority_end..];
    match tail.find('?') {
        None => out.push_str(tail),
        Some(q) => {
            out.push_str(&tail[..=q]);
            let query = &tail[q + 1..];
            let (query, fragment) = match query.find('#') {
                Some(h) => (&query[..h], &query[h..]),
                None => (query, ""),
            };
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, value))
                        if key.eq_ignore_ascii_case("pass")
                            || key.eq_ignore_ascii_case("password") =>
                    {
                        secrets.push(value.to_owned());
                        format!("{key}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
            out.push_str(fragment);
        }
    }
    (out, secrets)
}

/// `message` with each of `secrets` replaced by `***`.
pub(crate) fn blot(message: String, secrets: &[String]) -> String {
    secrets
        .iter()
        .fold(message, |m, secret| m.replace(secret.as_str(), "***"))
}

/// The certificates given to the builder, in PEM.
#[derive(Clone, Default)]
pub(crate) struct TlsFiles {
    /// The CA that signs the servers' certificates, instead of the webpki roots.
    pub(crate) ca_pem: Option<Vec<u8>>,
    /// A client certificate (chain) and its private key, for servers that ask for one.
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Certificates are public, but a key is not: neither is printed.
        f.debug_struct("TlsFiles")
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<set>"))
            .field("client_cert", &self.client.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl TlsFiles {
    pub(crate) fn is_empty(&self) -> bool {
        self.ca_pem.is_none() && self.client.is_none()
    }
}

#[cfg(feature = "tls")]
mod enabled {
    use std::sync::Arc;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    use super::TlsFiles;

    impl TlsFiles {
        /// The certificates in redis-rs's form, once checked: a message saying what is wrong
        /// with them otherwise.
        pub(crate) fn certificates(&self) -> Result<Option<redis::TlsCertificates>, String> {
            if self.is_empty() {
                return Ok(None);
            }
            if let Some(ca) = &self.ca_pem {
                let certs = CertificateDer::pem_slice_iter(ca)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("the CA PEM cannot be read: {e}"))?;
                if certs.is_empty() {
                    return Err("the CA PEM holds no certificate".to_owned());
                }
            }
            if let Some((cert, key)) = &self.client {
                let certs = CertificateDer::pem_slice_iter(cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("the client certificate PEM cannot be read: {e}"))?;
                if certs.is_empty() {
                    return Err("the client certificate PEM holds no certificate".to_owned());
                }
                // The key's own error text never quotes the key.
                let key = PrivateKeyDer::from_pem_slice(key)
                    .map_err(|e| format!("the client key PEM cannot be read: {e}"))?;
                // What redis-rs will do when it connects, done now: a key that is no key, or
                // not the certificate's, is an error of the build and not of every call.
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_client_auth_cert(certs, key)
                .map_err(|e| format!("the client certificate and key cannot be used: {e}"))?;
            }
            Ok(Some(redis::TlsCertificates {
                client_tls: self
                    .client
                    .as_ref()
                    .map(|(cert, key)| redis::ClientTlsConfig {
                        client_cert: cert.clone(),
                        client_key: key.clone(),
                    }),
                root_cert: self.ca_pem.clone(),
            }))
        }
    }

    /// Makes rustls's `ring` provider the process's default unless the application chose one:
    /// redis-rs builds its TLS configurations on the default provider.
    pub(crate) fn install_provider() {
        // An error means a provider is installed already: the application's, kept.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(feature = "tls")]
pub(crate) use enabled::install_provider;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_schemes() {
        assert!(is_tls_url("rediss://h:1/"));
        assert!(is_tls_url("  REDISS://h/"));
        assert!(is_tls_url("valkeys://h/"));
        assert!(!is_tls_url("redis://h/"));
        assert!(!is_tls_url("redis+unix:///tmp/s"));
        assert!(!is_tls_url("garbage"));
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://:secret@127.0.0.1:6379/"),
            "redis://:***@127.0.0.1:6379/"
        );
        assert_eq!(
            redact_url("rediss://app:s3cr%40t@h:6380/2"),
            "rediss://app:***@h:6380/2"
        );
        assert_eq!(redact_url("redis://app@h/"), "redis://app@h/");
        assert_eq!(redact_url("redis://h:6379/"), "redis://h:6379/");
        assert_eq!(
            redact_url("redis+unix:///run/r.sock?user=u&pass=hunter2&protocol=resp3"),
            "redis+unix:///run/r.sock?user=u&pass=***&protocol=resp3"
        );
        assert_eq!(redact_url("no url"), "no url");
        // An `@` in the password does not leave its tail behind.
        assert_eq!(redact_url("redis://u:a@b@h/"), "redis://u:***@h/");
    }

    #[test]
    fn secrets_found_in_every_form() {
        let secrets = secrets_of("redis://app:s3cr%40t@h:6380/");
        assert!(secrets.contains(&"s3cr@t".to_owned()), "{secrets:?}");
        assert!(secrets.contains(&"s3cr%40t".to_owned()), "{secrets:?}");
        assert_eq!(
            blot("bad s3cr%40t and s3cr@t".to_owned(), &secrets),
            "bad *** and ***"
        );
        assert!(secrets_of("redis://h/").is_empty());
    }
}
