//! `tollgate`: checks a limits file before a deploy, reads or resets one key's state in Redis,
//! denies an identity on every replica, and prints who a limit refuses most.
//!
//! ```text
//! tollgate check FILE|-
//! tollgate peek   REDIS [--limits FILE] [--prefix PREFIX] [--plan PLAN] LIMIT IDENTITY
//! tollgate reset  REDIS [--limits FILE] [--prefix PREFIX] LIMIT IDENTITY
//! tollgate deny   REDIS [--limits FILE] [--prefix PREFIX] LIMIT IDENTITY --for DURATION
//! tollgate undeny REDIS [--limits FILE] [--prefix PREFIX] LIMIT IDENTITY
//! tollgate top    REDIS [--limits FILE] [--prefix PREFIX] [-n N] LIMIT
//!   REDIS: (--redis URL | --cluster URL[,URL...]) [--tls-ca FILE] [--key-secret-env NAME]
//!          (rediss:// for TLS; NAME: the variable that holds the backend's key secret)
//! ```
//!
//! `check` exits 0 and prints the effective limits as a table (name, algorithm, quota per
//! plan, key, cost, missing-key policy, failure policy, shadow, wait (a delay or a queue) and
//! penalty box), the allowlist and the denylist; a broken file makes it print the error, with
//! its line and column, and exit 1. `-` reads the file from standard input. Principals need
//! no Rust type here: every principal name the file uses is taken as a string id.
//!
//! `peek` reads what the next one-unit request of IDENTITY (an address, a tenant's or a
//! principal's name) would find under LIMIT, as the layer's `peek` does: the limit's algorithm,
//! quota and key come from the limits file (`--limits`, else `$TOLLGATE_LIMITS`, else
//! `limits.toml`), the state from Redis, and a deny or a block that stands, until when. It
//! writes nothing. `reset` forgets what IDENTITY has used under LIMIT (a deny stays).
//!
//! `top` prints the N identities (default 10) that LIMIT refused most over the current and
//! the previous report bucket, as every replica reported them to Redis: count, error bound,
//! first and last seen (UTC), identity. It writes nothing.
//!
//! Each subcommand's `--help` ends with its exit codes: 0 ok, 1 a bad file (or an unknown
//! limit, plan or identity), 2 a usage error, 3 Redis failed.

mod check;
mod redis;
mod sanction;
mod table;
mod top;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tollgate_redis::DEFAULT_PREFIX;

/// How long a subcommand waits for Redis, to connect and then for each call.
const DEADLINE: Duration = Duration::from_secs(2);

/// The subcommand whose `--help` a footer ends, or `None` for `tollgate --help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sub {
    Check,
    Peek,
    Reset,
    Deny,
    Undeny,
    Top,
}

/// What `--help` says after the options: the exit codes, and for the subcommands that read
/// a limits file and Redis, where the file and the defaults come from.
fn footer(sub: Option<Sub>) -> String {
    let ok = match sub {
        None => "ok: the file is good, the state was read or changed, the report was read",
        Some(Sub::Check) => "ok: the file is good (its limits are printed)",
        Some(Sub::Peek) => "ok: the state was read (and printed)",
        Some(Sub::Reset) => "ok: the identity's state under the limit is forgotten",
        Some(Sub::Deny) => "ok: the identity is denied",
        Some(Sub::Undeny) => "ok: the deny is lifted, or there was none (said so)",
        Some(Sub::Top) => "ok: the report was read (and printed)",
    };
    let bad = match sub {
        None => "a bad file: unreadable or broken; or an unknown limit, plan or identity",
        Some(Sub::Check) => "a bad file: unreadable or broken",
        Some(Sub::Peek) => "a bad limits file; or an unknown limit, plan or identity",
        Some(Sub::Reset) => {
            "a bad limits file; an unknown limit or identity; or a concurrency limit (its \
             slots are requests in flight)"
        }
        Some(Sub::Deny | Sub::Undeny) => "a bad limits file; or an unknown limit or identity",
        Some(Sub::Top) => "a bad limits file; or a limit it does not have",
    };
    let usage = match sub {
        Some(Sub::Check) => "a usage error: an unknown flag, a missing FILE",
        Some(Sub::Deny) => {
            "a usage error: an unknown flag, a missing argument, a bad Redis URL or --for"
        }
        None => "a usage error: an unknown command or flag, a missing argument, a bad Redis URL",
        _ => "a usage error: an unknown flag, a missing argument, a bad Redis URL",
    };
    let mut text = format!("Exit codes:\n  0  {ok}\n  1  {bad}\n  2  {usage}");
    if sub != Some(Sub::Check) {
        text.push_str(&format!(
            "\n  3  Redis failed, or did not answer within {}s",
            DEADLINE.as_secs()
        ));
    }
    if sub == Some(Sub::Check) {
        return text;
    }
    let name = match sub {
        Some(Sub::Peek) => "peek",
        Some(Sub::Reset) => "reset",
        Some(Sub::Deny) => "deny",
        Some(Sub::Undeny) => "undeny",
        Some(Sub::Top) => "top",
        None | Some(Sub::Check) => "peek, reset, deny, undeny and top",
    };
    text.push_str(&format!(
        "\n
Environment:
  TOLLGATE_LIMITS  the limits file of {name} when --limits is not given

Defaults:
  --limits  $TOLLGATE_LIMITS, else limits.toml
  --prefix  {DEFAULT_PREFIX} (the Redis backend's default key prefix)"
    ));
    match sub {
        Some(Sub::Peek) => text.push_str("\n  --plan    none: the limit's default quota"),
        Some(Sub::Top) => text.push_str("\n  -n        10"),
        _ => {}
    }
    text
}

/// Checks a limits file before a deploy, and reads or changes one key's state in Redis.
#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    arg_required_else_help = true,
    after_help = footer(None)
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Reads a limits file as the layer would and prints the effective limits.
    ///
    /// Prints each limit's name, algorithm, quota per plan, key, cost per request,
    /// missing-key policy, failure policy, shadow flag, wait (a delay or a queue) and penalty
    /// box, then the allowlist and the denylist. Every
    /// principal name the file uses is taken as a string id. A broken file prints the error
    /// with its line and column, and exits 1.
    #[command(after_help = footer(Some(Sub::Check)))]
    Check {
        /// The limits file (TOML); `-` reads it from standard input.
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Reads what IDENTITY's next one-unit request would find under LIMIT, writing nothing.
    ///
    /// The limit's algorithm, quota and key come from the limits file, the state from Redis:
    /// what is left (for a concurrency limit, how many are in flight), the burst of a GCRA
    /// limit, and a deny or a block that refuses the identity, until when. IDENTITY is whom
    /// requests are counted as: an IP address for a limit keyed by client address, a
    /// tenant's or a principal's name.
    #[command(after_help = footer(Some(Sub::Peek)))]
    Peek(PeekArgs),
    /// Forgets what IDENTITY has used under LIMIT: its next request finds the whole quota.
    ///
    /// Deletes the key's state in Redis and lifts a block of the penalty box; a deny stays
    /// (`undeny` lifts it). A replica that holds a denial of it in its deny cache refuses it
    /// until that runs out (1 s by default). A concurrency limit cannot be reset: its slots
    /// are requests still in flight.
    #[command(after_help = footer(Some(Sub::Reset)))]
    Reset(TargetArgs),
    /// Prints the identities LIMIT refused most, as every replica reported them to Redis.
    ///
    /// Over the current and the previous report bucket (a minute each): the count of
    /// refusals, the most it may be over (0 when exact), when they were first and last seen
    /// (UTC), and the identity as requests carry it. Writes nothing.
    ///
    /// A replica reports the refusals it counted when it refuses again at least a second
    /// after its last report: the last second of a burst followed by silence shows only after
    /// that replica's next refusal under the limit.
    #[command(after_help = footer(Some(Sub::Top)))]
    Top(TopArgs),
    /// Refuses IDENTITY under LIMIT on every replica for a while: 403, nothing consumed.
    ///
    /// The deny lives in Redis, beside the key's state; each replica refuses the identity
    /// from its next check of it (a replica that holds an answer for it in its deny cache or
    /// a leased slice, once that runs out: 1 s by default). A reset leaves it; `undeny`
    /// lifts it.
    #[command(after_help = footer(Some(Sub::Deny)))]
    Deny(DenyArgs),
    /// Lifts a deny of IDENTITY under LIMIT, or says there was none.
    #[command(after_help = footer(Some(Sub::Undeny)))]
    Undeny(TargetArgs),
}

#[derive(Debug, Args)]
struct DenyArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// How long: `90` or `90s`, `15m`, `1h`, `7d`; at most 36525d (100 years).
    #[arg(long = "for", value_name = "DURATION", value_parser = sanction::parse_for)]
    duration: Duration,
}

/// One identity under one limit of a limits file, in Redis.
#[derive(Debug, Args)]
struct TargetArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// The limits file.
    #[arg(
        long,
        value_name = "FILE",
        env = "TOLLGATE_LIMITS",
        default_value = "limits.toml"
    )]
    limits: PathBuf,
    /// The key prefix the layer's Redis backend was built with.
    #[arg(long, value_name = "PREFIX", default_value = DEFAULT_PREFIX)]
    prefix: String,
    /// The limit's name, as the limits file says it.
    #[arg(value_name = "LIMIT")]
    limit: String,
    /// Whom requests are counted as: an IP address, a tenant's or a principal's name.
    #[arg(value_name = "IDENTITY")]
    identity: String,
}

#[derive(Debug, Args)]
struct TopArgs {
    #[command(flatten)]
    redis: RedisArgs,
    /// The limits file, which must have LIMIT.
    #[arg(
        long,
        value_name = "FILE",
        env = "TOLLGATE_LIMITS",
        default_value = "limits.toml"
    )]
    limits: PathBuf,
    /// The key prefix the layer's Redis backend was built with.
    #[arg(long, value_name = "PREFIX", default_value = DEFAULT_PREFIX)]
    prefix: String,
    /// How many identities to print.
    #[arg(short = 'n', value_name = "N", default_value_t = 10)]
    n: usize,
    /// The limit's name.
    #[arg(value_name = "LIMIT")]
    limit: String,
}

#[derive(Debug, Args)]
struct PeekArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Reads under this plan's quota instead of the default quota.
    #[arg(long, value_name = "PLAN")]
    plan: Option<String>,
}

/// Which Redis, and how to trust it.
#[derive(Debug, Args)]
struct RedisArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// With rediss:// URLs: the CA that signs the servers' certificates, in PEM, instead of
    /// the public roots.
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// The environment variable that holds the key secret the layer's Redis backend was
    /// built with (`key_secret`); the secret itself is never an argument.
    #[arg(long, value_name = "NAME")]
    key_secret_env: Option<String>,
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct ServerArgs {
    /// A standalone Redis server: redis://HOST:PORT, or rediss://HOST:PORT for TLS.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// The nodes of a Redis Cluster, comma-separated.
    #[arg(long, value_name = "URL[,URL...]", value_delimiter = ',')]
    cluster: Option<Vec<String>>,
}

fn main() -> ExitCode {
    // Help and version exit 0; usage errors name what is wrong, with a hint, and exit 2.
    let cli = Cli::parse();
    let done = match cli.command {
        Command::Check { file } => check::run(&file),
        Command::Peek(args) => sanction::peek(&args.target, args.plan.as_deref()),
        Command::Reset(args) => sanction::reset(&args),
        Command::Top(args) => top::run(&args),
        Command::Deny(args) => sanction::deny(&args.target, args.duration),
        Command::Undeny(args) => sanction::undeny(&args),
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}
