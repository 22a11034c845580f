//! `tollgate`: checks a limits file before a deploy, reads one key's state in Redis, and who
//! a limit refuses most.
//!
//! ```text
//! tollgate check FILE
//! tollgate peek (--redis URL | --cluster URL[,URL...]) [--limits FILE] [--prefix PREFIX]
//!               [--key-secret-env NAME] [--plan PLAN] LIMIT IDENTITY
//! tollgate top (--redis URL | --cluster URL[,URL...]) [--prefix PREFIX] [-n N] LIMIT
//! ```
//!
//! `check` exits 0 and prints the effective limits as a table (name, algorithm, quota per
//! plan, key, cost, missing-key policy, failure policy, shadow, wait (a delay or a queue) and
//! penalty box), the allowlist and the denylist; a broken
//! file makes it print the error, with its line and column, and exit 1. Principals need no
//! Rust type here: every principal name the file uses is taken as a string id.
//!
//! `peek` reads what the next one-unit request of IDENTITY (an address, a tenant's or a
//! principal's name) would find under LIMIT, as the layer's `peek` does: the limit's algorithm,
//! quota and key come from the limits file (`--limits`, else `$TOLLGATE_LIMITS`, else
//! `limits.toml`), the state from Redis. It writes nothing.
//!
//! `top` prints the N identities (default 10) that LIMIT refused most over the current and
//! the previous report bucket, as every replica reported them to Redis: count, error bound,
//! first and last seen (UTC), identity. It writes nothing.
//!
//! Exit codes: 0 ok, 1 a bad file (or an unknown limit, plan or identity), 2 a usage error,
//! 3 Redis failed. `--help` says the same.

mod table;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use table::period;
use tollgate::engine::{
    Admin, Check, Clock, KeyState, Limit, Quota, Refused, Reports, SystemClock,
};
use tollgate::key::{Identity, IdentityError};
use tollgate::{Limits, LimitsFile};
use tollgate_redis::{RedisBackend, DEFAULT_PREFIX};

/// How long `peek` waits for Redis.
const PEEK_DEADLINE: Duration = Duration::from_secs(2);

/// What `--help` says after the options: the exit codes, and where `peek`'s file and
/// defaults come from.
fn footer(peek: bool) -> String {
    let mut text = format!(
        "\
Exit codes:
  0  ok: the file is good (check), the state was read (peek)
  1  a bad file: unreadable or broken; or an unknown limit, plan or identity (peek)
  2  a usage error: an unknown command or flag, a missing argument, a bad Redis URL
  3  Redis failed or did not answer within {}s (peek)",
        PEEK_DEADLINE.as_secs()
    );
    if peek {
        text.push_str(&format!(
            "\n
Environment:
  TOLLGATE_LIMITS  the limits file of `peek` when --limits is not given

Defaults:
  peek --limits  $TOLLGATE_LIMITS, else limits.toml
  peek --prefix  {DEFAULT_PREFIX} (the Redis backend's default key prefix)
  peek --plan    none: the limit's default quota"
        ));
    }
    text
}

/// Checks a limits file before a deploy, and reads one key's state in Redis.
#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    arg_required_else_help = true,
    after_help = footer(true)
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
    #[command(after_help = footer(false))]
    Check {
        /// The limits file (TOML).
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Reads what IDENTITY's next one-unit request would find under LIMIT, writing nothing.
    ///
    /// The limit's algorithm, quota and key come from the limits file, the state from Redis.
    /// IDENTITY is whom requests are counted as: an IP address for a limit keyed by client
    /// address, a tenant's or a principal's name.
    #[command(after_help = footer(true))]
    Peek(PeekArgs),
    /// Prints the identities LIMIT refused most, as every replica reported them to Redis.
    ///
    /// Over the current and the previous report bucket (a minute each): the count of
    /// refusals, the most it may be over (0 when exact), when they were first and last seen
    /// (UTC), and the identity as the layer names it: a fingerprint, unless the limit's
    /// extractor reveals identities. Writes nothing.
    #[command(after_help = footer(false))]
    Top(TopArgs),
    /// Refuses IDENTITY under LIMIT on every replica for a while: 403, nothing consumed.
    ///
    /// The deny lives in Redis, beside the key's state; each replica refuses the identity
    /// from its next check of it (a replica that holds an answer for it in its deny cache or
    /// a leased slice, once that runs out: 1 s by default). A reset leaves it; `undeny`
    /// lifts it.
    #[command(after_help = footer(true))]
    Deny(DenyArgs),
    /// Lifts a deny of IDENTITY under LIMIT.
    #[command(after_help = footer(true))]
    Undeny(TargetArgs),
}

#[derive(Debug, Args)]
struct DenyArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// How long: `90` or `90s`, `15m`, `1h`, `7d`.
    #[arg(long = "for", value_name = "DURATION", value_parser = parse_for)]
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
    /// The environment variable that holds the key secret the layer's Redis backend was
    /// built with (`key_secret`); the secret itself is never an argument.
    #[arg(long, value_name = "NAME")]
    key_secret_env: Option<String>,
    /// The limit's name, as the limits file says it.
    #[arg(value_name = "LIMIT")]
    limit: String,
    /// Whom requests are counted as: an IP address, a tenant's or a principal's name.
    #[arg(value_name = "IDENTITY")]
    identity: String,
}

/// `90`, `90s`, `15m`, `1h` or `7d`.
fn parse_for(text: &str) -> Result<Duration, String> {
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 90s, 15m, 1h or 7d"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    match n.checked_mul(secs) {
        Some(0) => Err("a deny must last longer than zero".to_owned()),
        Some(total) => Ok(Duration::from_secs(total)),
        None => Err(format!("{text:?} is too long")),
    }
}

#[derive(Debug, Args)]
struct TopArgs {
    #[command(flatten)]
    redis: RedisArgs,
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

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct RedisArgs {
    /// A standalone Redis server.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// The nodes of a Redis Cluster, comma-separated.
    #[arg(long, value_name = "URL[,URL...]", value_delimiter = ',')]
    cluster: Option<Vec<String>>,
}

fn main() -> ExitCode {
    // Help and version exit 0; usage errors name what is wrong, with a hint, and exit 2.
    let cli = Cli::parse();
    match cli.command {
        Command::Check { file } => match load(&file) {
            Ok(limits) => {
                table::print(&file, &limits);
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Peek(args) => peek(&args),
        Command::Top(args) => top(&args),
        Command::Deny(args) => sanction(&args.target, Some(args.duration)),
        Command::Undeny(args) => sanction(&args, None),
    }
}

/// `deny` (for `duration`) or `undeny` (`None`) of the target's identity.
fn sanction(target: &TargetArgs, duration: Option<Duration>) -> ExitCode {
    let name = target.limit.as_str();
    let (limit, key, identity) = match target_key(&target.limits, name, &target.identity) {
        Ok(found) => found,
        Err(code) => return code,
    };
    let (backend, runtime) = match connect(
        &target.redis,
        &target.prefix,
        target.key_secret_env.as_deref(),
    ) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let check = Check::new(&limit, &key);
    let answer = match duration {
        Some(d) => runtime.block_on(backend.deny(&check, d)),
        None => runtime.block_on(backend.undeny(&check)),
    };
    match (answer, duration) {
        (Ok(()), Some(d)) => {
            println!("denied {identity} under {name} for {}", period(d));
            ExitCode::SUCCESS
        }
        (Ok(()), None) => {
            println!("lifted the deny of {identity} under {name}");
            ExitCode::SUCCESS
        }
        (Err(e), _) => {
            eprintln!("{e}");
            ExitCode::from(3)
        }
    }
}

fn load(file: &Path) -> Result<Limits, ExitCode> {
    LimitsFile::new().any_principal().read(file).map_err(|e| {
        eprintln!("{}: {e}", file.display());
        ExitCode::from(1)
    })
}

fn peek(args: &PeekArgs) -> ExitCode {
    let target = &args.target;
    let name = target.limit.as_str();
    let (limit, key, identity) = match target_key(&target.limits, name, &target.identity) {
        Ok(found) => found,
        Err(code) => return code,
    };
    let limit = &limit;
    let quota = match &args.plan {
        None => *limit.quota(),
        Some(plan) => match limit.plans().find(|(n, _)| n == plan) {
            Some((_, q)) => *q,
            None => {
                eprintln!("limit {name:?} has no plan {plan:?}");
                return ExitCode::from(1);
            }
        },
    };
    let (backend, runtime) = match connect(
        &target.redis,
        &target.prefix,
        target.key_secret_env.as_deref(),
    ) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let check = Check::new(limit, &key).with_quota(quota);
    match runtime.block_on(backend.peek(&check)) {
        Ok(state) => {
            print_state(name, &identity, limit, &quota, &state);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(3)
        }
    }
}

/// The limit named `name` in the limits file `file`, and the key `identity` is counted
/// under there; or the exit code of why not.
fn target_key(
    file: &Path,
    name: &str,
    identity: &str,
) -> Result<(Limit, Vec<u8>, Identity), ExitCode> {
    let limits = load(file)?;
    let Some((limit, key)) = limits.get(name) else {
        eprintln!("{}: no limit named {name:?}", file.display());
        return Err(ExitCode::from(1));
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
/// code of why not.
fn connect(
    redis: &RedisArgs,
    prefix: &str,
    key_secret_env: Option<&str>,
) -> Result<(RedisBackend, tokio::runtime::Runtime), ExitCode> {
    let builder = match (&redis.redis, &redis.cluster) {
        (Some(url), _) => RedisBackend::builder().url(url),
        (None, Some(urls)) => RedisBackend::builder().cluster(urls),
        // The argument group requires one of the two: clap refuses this first.
        (None, None) => {
            eprintln!("tollgate: needs --redis URL or --cluster URL[,URL...]");
            return Err(ExitCode::from(2));
        }
    };
    let builder = match key_secret_env {
        None => builder,
        Some(name) => match std::env::var_os(name) {
            Some(secret) if !secret.is_empty() => builder.key_secret(secret.as_encoded_bytes()),
            _ => {
                eprintln!("tollgate: --key-secret-env: the environment variable {name} is not set");
                return Err(ExitCode::from(2));
            }
        },
    };
    let backend = match builder.prefix(prefix).deadline(PEEK_DEADLINE).build() {
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

fn top(args: &TopArgs) -> ExitCode {
    let (backend, runtime) = match connect(&args.redis, &args.prefix, None) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let now = SystemClock::new().now();
    match runtime.block_on(backend.top(&args.limit, args.n, now)) {
        Ok(top) => {
            print_top(&args.limit, &top);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(3)
        }
    }
}

fn print_top(limit: &str, top: &[Refused]) {
    println!("limit  {limit}: {} refused identities", top.len());
    println!(
        "{:>9} {:>7}  {:<20}  {:<20}  identity",
        "refused", "error", "first seen (UTC)", "last seen (UTC)"
    );
    for r in top {
        println!(
            "{:>9} {:>7}  {:<20}  {:<20}  {}",
            r.count,
            r.error,
            utc(r.first_seen),
            utc(r.last_seen),
            r.identity
        );
    }
}

/// Microseconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(micros: u64) -> String {
    let secs = micros / 1_000_000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days to a civil date, counted in 400-year eras from 0000-03-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3_600,
        rest / 60 % 60,
        rest % 60
    )
}

fn print_state(name: &str, identity: &Identity, limit: &Limit, quota: &Quota, s: &KeyState) {
    println!(
        "limit      {name} ({} {}/{})",
        limit.algorithm().as_str(),
        quota.limit(),
        period(quota.period())
    );
    println!("identity   {identity}");
    println!("remaining  {}", s.remaining);
    println!("reset      {:.3}s", s.reset.as_secs_f64());
    match s.retry_after {
        Some(after) => println!("retry      {:.3}s", after.as_secs_f64()),
        None => println!("retry      -"),
    }
}
