//! Certificates for TLS servers, made at run time.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// A CA made for one test, and two certificates it signed: one for a server at `127.0.0.1`
/// (and `localhost`), and one for a client. All in PEM; clones share them.
///
/// # Examples
///
/// ```no_run
/// use tollgate_testsupport::{RedisServer, TestCerts};
///
/// let certs = TestCerts::generate();
/// let server = RedisServer::start_tls(&certs);
/// assert!(server.url().starts_with("rediss://127.0.0.1:"));
/// let ca: &str = certs.ca_pem(); // what a client must trust
/// # drop(ca);
/// ```
#[derive(Clone)]
pub struct TestCerts(Arc<Pems>);

struct Pems {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

impl std::fmt::Debug for TestCerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestCerts")
    }
}

/// Where [`TestCerts::write_to`] put the files.
#[derive(Debug, Clone)]
pub(crate) struct Files {
    pub(crate) ca: PathBuf,
    pub(crate) server_cert: PathBuf,
    pub(crate) server_key: PathBuf,
    pub(crate) client_cert: PathBuf,
    pub(crate) client_key: PathBuf,
}

impl TestCerts {
    /// A new CA, a server certificate for `127.0.0.1` and `localhost`, and a client
    /// certificate, each with a new key.
    ///
    /// # Panics
    ///
    /// When a key or a certificate cannot be made (not for any input: there is none).
    pub fn generate() -> Self {
        let ca_key = KeyPair::generate().expect("make the CA's key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "tollgate test CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("sign the CA");
        let issuer = Issuer::new(ca, ca_key);

        let leaf = |name: &str, usages: Vec<ExtendedKeyUsagePurpose>| {
            let key = KeyPair::generate().expect("make a key");
            let mut params =
                CertificateParams::new(vec!["localhost".to_owned()]).expect("leaf parameters");
            params
                .subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
            params.distinguished_name.push(DnType::CommonName, name);
            params.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            params.extended_key_usages = usages;
            let cert = params.signed_by(&key, &issuer).expect("sign a leaf");
            (cert.pem(), key.serialize_pem())
        };
        // Redis presents its server certificate to its peers too (replicas, cluster nodes,
        // sentinels), as a client: it must serve both purposes.
        let (server_cert, server_key) = leaf(
            "127.0.0.1",
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let (client_cert, client_key) =
            leaf("tollgate client", vec![ExtendedKeyUsagePurpose::ClientAuth]);
        Self(Arc::new(Pems {
            ca: ca_cert.pem(),
            server_cert,
            server_key,
            client_cert,
            client_key,
        }))
    }

    /// The CA's certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.0.ca
    }

    /// The client's certificate, PEM.
    pub fn client_cert_pem(&self) -> &str {
        &self.0.client_cert
    }

    /// The client's private key, PEM (PKCS#8).
    pub fn client_key_pem(&self) -> &str {
        &self.0.client_key
    }

    /// Writes the PEM files into `dir`.
    pub(crate) fn write_to(&self, dir: &Path) -> std::io::Result<Files> {
        let files = Files {
            ca: dir.join("ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
        };
        std::fs::write(&files.ca, &self.0.ca)?;
        std::fs::write(&files.server_cert, &self.0.server_cert)?;
        std::fs::write(&files.server_key, &self.0.server_key)?;
        std::fs::write(&files.client_cert, &self.0.client_cert)?;
        std::fs::write(&files.client_key, &self.0.client_key)?;
        Ok(files)
    }

    /// A client for the TLS server at `url`, trusting the CA and presenting the client
    /// certificate.
    pub(crate) fn client(&self, url: &str) -> redis::RedisResult<redis::Client> {
        // redis-rs builds its TLS configuration on the process's default provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        redis::Client::build_with_tls(
            url,
            redis::TlsCertificates {
                client_tls: Some(redis::ClientTlsConfig {
                    client_cert: self.0.client_cert.clone().into_bytes(),
                    client_key: self.0.client_key.clone().into_bytes(),
                }),
                root_cert: Some(self.0.ca.clone().into_bytes()),
            },
        )
    }
}
