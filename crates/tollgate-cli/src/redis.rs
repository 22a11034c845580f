//! What the subcommands that reach Redis share: the limit and key an identity is counted
//! under, read from the limits file, and the backend.

use std::path::Path;
use std::process::ExitCode;

use tollgate::engine::Limit;
use tollgate::key::{Identity, IdentityError};
use tollgate_redis::RedisBackend;

use crate::check::load;
use crate::{RedisArgs, DEADLINE};

/// The limit named `name` in the limits file `file`, or exit 1 with why not.
pub(crate) fn limit_of(file: &Path, name: &str) -> Result<Limit, ExitCode> {
    let limits = load(file)?;
    match limits.get(name) {
        Some((limit, _)) => Ok(limit.clone()),
        None => Err(unknown(file, name)),
    }
}

fn unknown(file: &Path, name: &str) -> ExitCode {
    eprintln!("{}: no limit named {name:?}", file.display());
    ExitCode::from(1)
}

/// The limit named `name` in the limits file `file`, and the key `identity` is counted
/// under there; or the exit code of why not.
pub(crate) fn target_key(
    file: &Path,
    name: &str,
    identity: &str,
) -> Result<(Limit, Vec<u8>, Identity), ExitCode> {
    let limits = load(file)?;
    let Some((limit, key)) = limits.get(name) else {
        return Err(unknown(file, name));
    };
    let identity = Identity::from(identity);
    match key.key_of(&identity) {
        Ok(key) => Ok((limit.clone(), key.as_bytes().to_vec(), identity)),
        Err(missing) => {
            eprintln!("{}", IdentityError::new(name, identity, missing));
            Err(ExitCode::from(1))
        }
    }
}

/// The Redis backend `redis` and `prefix` name, and a runtime to call it on; or the exit
/// code of why not. It gives up on a connection, and on each call, after [`DEADLINE`].
pub(crate) fn connect(
    redis: &RedisArgs,
    prefix: &str,
) -> Result<(RedisBackend, tokio::runtime::Runtime), ExitCode> {
    let builder = match (&redis.server.redis, &redis.server.cluster) {
        (Some(url), _) => RedisBackend::builder().url(url),
        (None, Some(urls)) => RedisBackend::builder().cluster(urls),
        // The argument group requires one of the two: clap refuses this first.
        (None, None) => {
            eprintln!("tollgate: needs --redis URL or --cluster URL[,URL...]");
            return Err(ExitCode::from(2));
        }
    };
    let builder = match &redis.tls_ca {
        None => builder,
        Some(file) => match std::fs::read(file) {
            Ok(pem) => builder.tls_ca_pem(pem),
            Err(e) => {
                eprintln!("--tls-ca {}: cannot read it: {e}", file.display());
                return Err(ExitCode::from(2));
            }
        },
    };
    let builder = match &redis.key_secret_env {
        None => builder,
        Some(name) => match std::env::var_os(name) {
            Some(secret) if !secret.is_empty() => builder.key_secret(secret.as_encoded_bytes()),
            _ => {
                eprintln!("tollgate: --key-secret-env: the environment variable {name} is not set");
                return Err(ExitCode::from(2));
            }
        },
    };
    let backend = match builder
        .prefix(prefix)
        .deadline(DEADLINE)
        .connect_timeout(DEADLINE)
        .build()
    {
        Ok(backend) => backend,
        Err(e) => {
            eprintln!("redis: {e}");
            return Err(ExitCode::from(2));
        }
    };
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Ok((backend, rt)),
        Err(e) => {
            eprintln!("tollgate: {e}");
            Err(ExitCode::from(3))
        }
    }
}

/// Exit 3 with a backend's error; exit 1 when it is that the backend does not offer the
/// operation (it would fail again).
pub(crate) fn failed(e: &tollgate::engine::BackendError) -> ExitCode {
    eprintln!("{e}");
    if e.kind() == tollgate::engine::BackendErrorKind::Unsupported {
        ExitCode::from(1)
    } else {
        ExitCode::from(3)
    }
}
