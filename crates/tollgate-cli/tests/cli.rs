//! The `tollgate` command on good and broken limits files, and `peek` on a real Redis.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use tollgate::engine::{Backend, Check, Clock, Refused, Status, SystemClock};
use tollgate::key::{ClientIp, KeyExtractor};
use tollgate::{Limit, Quota};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;

const GOOD: &str = r#"
[[limit]]
name = "per-ip"
period = "1m"
key = { ip = { header = "cf-connecting-ip", trusted = "cloudflare" } }
failure = { fallback = 3 }
delay = "1500ms"
shadow = true
[limit.quota]
default = { limit = 60, burst = 10 }

[[limit]]
name = "per-token"
algorithm = "fixed_window"
period = "1d"
key = "principal"
failure = "closed"
missing_key = "skip"
cost = 3
penalty = { after = 5, within = "10m", block = "1h" }
[limit.quota]
default = 5000
pro = 50000

[[limit]]
name = "per-shop"
algorithm = "sliding_log"
period = "1h"
key = { header = "x-shop-domain" }
shadow = true
[limit.quota]
default = 100

[[limit]]
name = "in-flight"
algorithm = "concurrency"
key = "global"
slot_ttl = "1m"
queue = { wait = "5s" }
quota = 3

[[allowlist]]
key = "ip"
networks = ["10.0.0.0/8", "2001:db8::/32"]

[[allowlist]]
key = "principal"
values = ["ops-bot"]

[[denylist]]
key = "ip"
networks = ["198.51.100.0/24", "2001:db8:bad::/48"]

[[denylist]]
key = { header = "x-shop-domain" }
values = ["spam.example"]
"#;

/// A file of its own for each test, in the system's temporary directory, removed when the
/// test ends.
fn file(name: &str, text: &str) -> TempFile {
    let path =
        std::env::temp_dir().join(format!("tollgate-cli-{}-{name}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    TempFile(path)
}

struct TempFile(PathBuf);

impl std::ops::Deref for TempFile {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn run(args: &[&str]) -> Output {
    command(args).output().unwrap()
}

/// The command, with no `$TOLLGATE_LIMITS` from the environment the tests run in.
fn command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command.args(args).env_remove("TOLLGATE_LIMITS");
    command
}

/// The workspace's root, where the README's commands run.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

#[test]
fn check_prints_the_effective_limits() {
    let path = file("good", GOOD);
    let out = run(&["check", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let want = format!(
        "\
name       algorithm     quota                             key                                             cost     missing key  failure     shadow  wait                          penalty
per-ip     gcra          default 60/1m burst 10            ip (cf-connecting-ip from 22 trusted networks)  fixed 1  reject       fallback 3  yes     delay 1500ms, max 64 waiting  -
per-token  fixed_window  default 5000/1d, pro 50000/1d     principal String                                fixed 3  skip         closed      no      -                             5 in 10m: block 1h
per-shop   sliding_log   default 100/1h                    header x-shop-domain                            fixed 1  reject       open        yes     -                             -
in-flight  concurrency   default 3 in flight; slot ttl 1m  global                                          fixed 1  reject       open        no      queue 5s, max 64 waiting      -

allowlist (admitted, counted by no limit):
  networks 10.0.0.0/8, 2001:db8::/32
  keys ops-bot

denylist (refused with 403 unless allowlisted, counted by no limit):
  networks 198.51.100.0/24, 2001:db8:bad::/48
  keys spam.example

{}: ok, 4 limits
",
        path.display()
    );
    assert_eq!(cells(&stdout(&out)), cells(&want));
}

/// A limit enforced on a share of its keys shows the share in the `shadow` column.
#[test]
fn check_prints_an_enforced_share() {
    let text = "[[limit]]\nname = \"new\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\nenforce_percent = 30\n";
    let path = file("share", text);
    let out = run(&["check", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let rows = cells(&stdout(&out));
    assert_eq!(rows[0][7], "shadow");
    assert_eq!(rows[1][..2], ["new", "gcra"]);
    assert_eq!(rows[1][7], "enforce 30%");
}

/// Columns are padded to their widest cell: compare cell by cell.
fn cells(s: &str) -> Vec<Vec<String>> {
    s.lines()
        .map(|l| {
            l.split("  ")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .map(String::from)
                .collect()
        })
        .collect()
}

#[test]
fn the_shipped_file_checks() {
    let out = command(&["check", "examples/limits.toml"])
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let want = "\
name                 algorithm     quota                              key                                             cost     missing key  failure     shadow  wait                      penalty
per-ip               gcra          default 60/1m burst 10             ip (cf-connecting-ip from 22 trusted networks)  fixed 1  reject       fallback 3  no      -                         30 in 1m: block 5m, doubling to 1h
per-token            fixed_window  default 5000/1d, pro 50000/1d      principal String                                fixed 1  reject       closed      no      -                         -
per-shop             sliding_log   default 1000/1h                    header x-shop-domain                            fixed 1  skip         open        yes     -                         -
per-token-in-flight  concurrency   default 4 in flight; slot ttl 30s  principal String                                fixed 1  skip         open        no      queue 10s, max 8 waiting  -

allowlist (admitted, counted by no limit):
  networks 10.0.0.0/8, 2001:db8::/32
  keys ops-bot

examples/limits.toml: ok, 4 limits
";
    assert_eq!(cells(&stdout(&out)), cells(want));
    assert_eq!(stderr(&out), "");
}

/// The README's `tollgate` commands, as written there (the peek's Redis URL aside).
fn readme_commands() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    readme
        .lines()
        .filter_map(|l| l.strip_prefix("cargo run -p tollgate-cli -- "))
        .map(|l| {
            let command = l.split('#').next().unwrap();
            command.split_whitespace().map(String::from).collect()
        })
        .collect()
}

#[test]
fn the_readme_commands_run_on_the_shipped_file() {
    let commands = readme_commands();
    let names: Vec<&str> = commands.iter().map(|c| c[0].as_str()).collect();
    assert_eq!(names, ["check", "peek", "reset", "top", "deny", "undeny"]);
    let server = RedisServer::start();
    for command in commands {
        let args: Vec<String> = command
            .iter()
            .map(|a| {
                if a == "redis://127.0.0.1/" {
                    server.url()
                } else {
                    a.clone()
                }
            })
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert!(args.contains(&"examples/limits.toml"), "{args:?}");
        let out = self::command(&args).current_dir(root()).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        if args[0] == "top" {
            assert_eq!(
                stdout(&out).lines().next(),
                Some("limit  per-ip: 0 refused identities")
            );
        }
        if args[0] == "deny" {
            assert_eq!(
                stdout(&out),
                "denied 203.0.113.7 under per-ip for 1h\n",
                "{args:?}"
            );
        }
        if args[0] == "peek" {
            let text = stdout(&out);
            assert!(text.contains("limit      per-ip (gcra 60/1m)\n"), "{text}");
            assert!(text.contains("identity   203.0.113.7\n"), "{text}");
            assert!(text.contains("burst      10\n"), "{text}");
            assert!(text.contains("remaining  10\n"), "{text}");
        }
    }
}

#[test]
fn help_and_version_exit_0() {
    let help = run(&["--help"]);
    assert_eq!(help.status.code(), Some(0));
    let text = stdout(&help);
    for says in [
        "Usage: tollgate <COMMAND>",
        "  check  ",
        "  peek  ",
        "  0  ok",
        "  1  a bad file",
        "  2  a usage error",
        "  3  Redis failed",
        "TOLLGATE_LIMITS",
        "  --limits  $TOLLGATE_LIMITS, else limits.toml",
        "  --prefix  tollgate",
        "  reset  ",
    ] {
        assert!(text.contains(says), "{says:?} not in:\n{text}");
    }
    let version = run(&["--version"]);
    assert_eq!(version.status.code(), Some(0));
    assert_eq!(
        stdout(&version),
        format!("tollgate {}\n", env!("CARGO_PKG_VERSION"))
    );
    let check = run(&["check", "--help"]);
    assert_eq!(check.status.code(), Some(0));
    assert!(stdout(&check).contains("Usage: tollgate check <FILE>"));
    assert!(stdout(&check).contains("  1  a bad file"));
    // Each subcommand's help speaks of that subcommand alone.
    let text = stdout(&check);
    for not in ["peek", "  3  ", "TOLLGATE_LIMITS", "Redis"] {
        assert!(!text.contains(not), "{not:?} in:\n{text}");
    }
    for (sub, says) in [
        ("peek", "  0  ok: the state was read (and printed)"),
        (
            "reset",
            "  0  ok: the identity's state under the limit is forgotten",
        ),
        (
            "reset",
            "or a concurrency limit (its slots are requests in flight)",
        ),
        ("deny", "  0  ok: the identity is denied"),
        ("deny", "a bad Redis URL or --for"),
        (
            "undeny",
            "  0  ok: the deny is lifted, or there was none (said so)",
        ),
        ("top", "  1  a bad limits file; or a limit it does not have"),
        ("top", "  -n        10"),
        ("top", "shows only after that replica's next refusal"),
    ] {
        let out = run(&[sub, "--help"]);
        assert_eq!(out.status.code(), Some(0));
        let text = stdout(&out);
        assert!(text.contains(says), "{sub}: {says:?} not in:\n{text}");
        assert!(
            text.contains(&format!(
                "the limits file of {sub} when --limits is not given"
            )),
            "{sub}:\n{text}"
        );
        assert!(
            text.contains("  3  Redis failed, or did not answer within 2s"),
            "{sub}:\n{text}"
        );
        for other in ["peek", "reset", "deny", "undeny", "top"] {
            let says_other = format!("the limits file of {other} ");
            assert!(
                other == sub || !text.contains(&says_other),
                "{sub}:\n{text}"
            );
        }
    }
    let peek = run(&["peek", "--help"]);
    assert_eq!(peek.status.code(), Some(0));
    let text = stdout(&peek);
    for says in [
        "--redis <URL>",
        "--cluster <URL[,URL...]>",
        "[env: TOLLGATE_LIMITS=]",
        "[default: limits.toml]",
        "[default: tollgate]",
        "  3  Redis failed",
    ] {
        assert!(text.contains(says), "{says:?} not in:\n{text}");
    }
    assert_eq!(run(&["help", "peek"]).status.code(), Some(0));
}

#[test]
fn an_unknown_command_or_flag_is_named_with_a_hint() {
    let out = run(&["chek", "limits.toml"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("unrecognized subcommand 'chek'"), "{err}");
    assert!(
        err.contains("a similar subcommand exists: 'check'"),
        "{err}"
    );
    let out = run(&["check", "--strict", "limits.toml"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("unexpected argument '--strict'"), "{err}");
    assert!(err.contains("For more information, try '--help'."), "{err}");
    let out = run(&[
        "peek",
        "--redis",
        "redis://127.0.0.1/",
        "--limts",
        "f",
        "a",
        "b",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("unexpected argument '--limts'"), "{err}");
    assert!(
        err.contains("a similar argument exists: '--limits'"),
        "{err}"
    );
    assert_eq!(stdout(&out), "");
    // Both servers, or neither.
    let out = run(&[
        "peek",
        "--redis",
        "redis://a/",
        "--cluster",
        "redis://b/",
        "l",
        "i",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("cannot be used with"),
        "{}",
        stderr(&out)
    );
    let out = run(&["peek", "l", "i"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--redis <URL>|--cluster"),
        "{}",
        stderr(&out)
    );
}

/// A broken file: exit 1, and the error names the line and column.
fn broken(name: &str, text: &str, line: usize, column: usize, says: &str) {
    let path = file(name, text);
    let out = run(&["check", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{name}: {}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("line {line} column {column}:")),
        "{name}: {err}"
    );
    assert!(err.contains(says), "{name}: {err}");
    assert_eq!(stdout(&out), "", "{name}");
}

#[test]
fn check_names_the_line_and_column_of_a_broken_file() {
    let limit = |name: &str, quota: &str, key: &str| {
        format!("[[limit]]\nname = \"{name}\"\nperiod = \"1m\"\nkey = {key}\n[limit.quota]\ndefault = {quota}\n\n")
    };
    // A quota of zero, in the second limit (which starts on line 8): at the quota's line.
    let text = limit("a", "5", "\"ip\"") + &limit("b", "0", "\"ip\"");
    broken(
        "zero-quota",
        &text,
        13,
        11,
        "limit \"b\": a quota must admit at least one request",
    );
    // A misspelt algorithm, at its own line rather than its `[[limit]]`'s.
    broken(
        "algorithm",
        "[[limit]]\nname = \"a\"\nalgorithm = \"fixed_windw\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n",
        3,
        13,
        "limit \"a\": unknown algorithm \"fixed_windw\" (gcra, fixed_window, sliding_log, \
         concurrency)",
    );
    // An unknown key kind.
    let text = limit("a", "5", "\"cookie\"");
    broken("unknown-key", &text, 4, 7, "unknown key \"cookie\"");
    // A name given twice: the second one is the mistake.
    let text = limit("a", "5", "\"ip\"") + &limit("b", "5", "\"ip\"") + &limit("a", "7", "\"ip\"");
    broken(
        "duplicate",
        &text,
        16,
        8,
        "two limits are named \"a\" (the first at line 2)",
    );
    // TOML that does not parse, and a field the format does not have.
    broken(
        "syntax",
        "[[limit]]\nname = \"a\"\nperiod = [\"1m\"\n",
        3,
        15,
        "",
    );
    let text = "[[limit]]\nname = \"a\"\nqota = 3\nperiod = \"1m\"\nkey = \"ip\"\n[limit.quota]\ndefault = 5\n";
    broken("field", text, 3, 1, "unknown field `qota`");
    // A delay on a fixed window, at the delay; a penalty of no refusals, at its `after`.
    let text = "[[limit]]\nname = \"a\"\nalgorithm = \"fixed_window\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\ndelay = \"2s\"\n";
    broken(
        "delay",
        text,
        7,
        9,
        "limit \"a\": a fixed_window limit cannot delay requests",
    );
    let text = "[[limit]]\nname = \"a\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\npenalty = { after = 0, within = \"1m\", block = \"1m\" }\n";
    broken(
        "penalty",
        text,
        6,
        21,
        "limit \"a\": invalid penalty: a penalty needs at least one refusal",
    );
    // The same below `[limit.quota]`, where TOML reads it as a plan.
    let text =
        limit("a", "5", "\"ip\"") + "penalty = { after = 3, within = \"1m\", block = \"1m\" }\n";
    broken(
        "penalty-among-plans",
        &text,
        8,
        11,
        "limit \"a\": a quota is a number, or { limit = N, burst = M } (`penalty` is a field \
         of the limit: write it above `[limit.quota]`, whose lines are plans)",
    );
    // A quota that is not a number.
    let text = limit("a", "\"five\"", "\"ip\"");
    broken(
        "not-a-number",
        &text,
        6,
        11,
        "a quota is a number, or { limit = N, burst = M }",
    );
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(run(&[]).status.code(), Some(2));
    assert_eq!(run(&["check"]).status.code(), Some(2));
    assert_eq!(run(&["peek", "--redis"]).status.code(), Some(2));
    let missing = run(&["check", "/nonexistent/limits.toml"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing).contains("cannot read"),
        "{}",
        stderr(&missing)
    );
}

/// A backend of the application the CLI is pointed at: the prefix `app`, as the commands
/// below say it.
fn app_backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::builder()
        .url(server.url())
        .prefix("app")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// The key a per-IP limit counts `ip` under.
fn ip_key(ip: &str) -> tollgate::key::Key<'static> {
    let ip: std::net::IpAddr = ip.parse().unwrap();
    ClientIp::peer().key_of(&ip.into()).unwrap()
}

#[tokio::test]
async fn peek_reads_one_key_in_redis_and_writes_nothing() {
    let server = RedisServer::start();
    let text = r#"
[[limit]]
name = "daily"
algorithm = "fixed_window"
period = "1d"
key = "ip"
[limit.quota]
default = 10
"#;
    let path = file("peek", text);
    // Three requests of 203.0.113.7, counted by a backend as a layer would.
    let backend = app_backend(&server);
    let limit = Limit::fixed_window("daily", Quota::per_day(10).unwrap()).unwrap();
    let key = ip_key("203.0.113.7");
    for _ in 0..3 {
        let v = backend
            .check(&[Check::new(&limit, key.as_bytes())])
            .await
            .unwrap();
        assert!(v[0].is_allowed());
    }
    let keys_before = server.dbsize();
    server.reset_stats();

    let peek = |identity: &str| {
        run(&[
            "peek",
            "--redis",
            &server.url(),
            "--prefix",
            "app",
            "--limits",
            path.to_str().unwrap(),
            "daily",
            identity,
        ])
    };
    for _ in 0..2 {
        let out = peek("203.0.113.7");
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let text = stdout(&out);
        assert!(
            text.contains("limit      daily (fixed_window 10/1d)\n"),
            "{text}"
        );
        assert!(text.contains("remaining  7\n"), "{text}");
        assert!(text.contains("retry      -\n"), "{text}");
    }
    let fresh = stdout(&peek("198.51.100.1"));
    assert!(fresh.contains("remaining  10\n"), "{fresh}");
    // Read-only: no key added, no write command, and the count is still 3.
    assert_eq!(server.dbsize(), keys_before);
    let stats = server.command_stats();
    for write in [
        "set", "incrby", "del", "expire", "pexpire", "zadd", "evalsha",
    ] {
        assert_eq!(
            stats.get(write).copied().unwrap_or(0),
            0,
            "{write}: {stats:?}"
        );
    }
    let v = backend
        .check(&[Check::new(&limit, key.as_bytes())])
        .await
        .unwrap();
    assert_eq!(v[0].remaining, 6);
    // An unknown limit, and an identity the limit's keys cannot be.
    let out = peek("not-an-address");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        "\"not-an-address\" is not an IP address: expected an IP address for rate limit \"daily\"\n"
    );
    assert_eq!(stdout(&out), "");
    let out = run(&[
        "peek",
        "--redis",
        &server.url(),
        "--limits",
        path.to_str().unwrap(),
        "nope",
        "1.2.3.4",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no limit named \"nope\""),
        "{}",
        stderr(&out)
    );

    // Without --limits, the file is $TOLLGATE_LIMITS; --limits wins over it.
    let args = [
        "peek",
        "--redis",
        &server.url(),
        "--prefix",
        "app",
        "daily",
        "203.0.113.7",
    ];
    let out = command(&args)
        .env("TOLLGATE_LIMITS", &*path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("remaining  6\n"), "{}", stdout(&out));
    let out = command(
        &[
            &args[..5],
            &["--limits", "/nonexistent/limits.toml"],
            &args[5..],
        ]
        .concat(),
    )
    .env("TOLLGATE_LIMITS", &*path)
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("cannot read /nonexistent/limits.toml"),
        "{}",
        stderr(&out)
    );
    // Neither: limits.toml in the working directory, here an empty one.
    let empty = std::env::temp_dir().join(format!("tollgate-cli-{}-empty", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = command(&args).current_dir(&empty).output().unwrap();
    std::fs::remove_dir(&empty).unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with("limits.toml: limits file: cannot read limits.toml"),
        "{}",
        stderr(&out)
    );
}

/// `top` prints what the replicas reported to Redis, most refused first, and writes nothing.
#[tokio::test]
async fn top_prints_the_most_refused_identities_from_redis() {
    let server = RedisServer::start();
    let backend = app_backend(&server);
    // Two replicas' counters, as their layers hand them over (2025-01-01T00:00:10Z on).
    let t0 = 1_735_689_610_000_000;
    let now = SystemClock::new().now();
    let reports = backend.reports().unwrap();
    let a = vec![
        Refused::new("203.0.113.7", 40, 0, t0, t0 + 5_000_000),
        Refused::new("2001:db8:1:2::/64", 3, 1, t0 + 1_000_000, t0 + 2_000_000),
    ];
    let b = vec![
        Refused::new("203.0.113.7", 2, 0, t0 - 3_000_000, t0 + 61_000_000),
        Refused::new("shop-1", 5, 0, t0, t0),
    ];
    reports.merge("per-ip", 200, a, now).await.unwrap();
    reports.merge("per-ip", 200, b, now).await.unwrap();
    server.reset_stats();
    let path = file(
        "top",
        "[[limit]]\nname = \"per-ip\"\nperiod = \"1m\"\nkey = \"ip\"\nquota = 5\n",
    );
    let out = run(&[
        "top",
        "--redis",
        &server.url(),
        "--limits",
        path.to_str().unwrap(),
        "--prefix",
        "app",
        "-n",
        "2",
        "per-ip",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "\
limit  per-ip: 2 refused identities
  refused   error  first seen (UTC)      last seen (UTC)       identity
       42       0  2025-01-01T00:00:07Z  2025-01-01T00:01:11Z  203.0.113.7
        5       0  2025-01-01T00:00:10Z  2025-01-01T00:00:10Z  shop-1
"
    );
    let stats = server.command_stats();
    assert_eq!(stats.get("eval").copied(), Some(1), "{stats:?}");
    // Another prefix has nothing.
    let limits = path.to_str().unwrap();
    let other = run(&[
        "top",
        "--redis",
        &server.url(),
        "--limits",
        limits,
        "per-ip",
    ]);
    assert_eq!(other.status.code(), Some(0), "{}", stderr(&other));
    assert_eq!(stdout(&other), "limit  per-ip: 0 refused identities\n  refused   error  first seen (UTC)      last seen (UTC)       identity\n");
    // A limit the file does not have is a mistake, not an empty report.
    let unknown = run(&["top", "--redis", &server.url(), "--limits", limits, "other"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert_eq!(stdout(&unknown), "");
    assert_eq!(
        stderr(&unknown),
        format!("{limits}: no limit named \"other\"\n")
    );
}

/// `deny` refuses an identity on every replica that shares the Redis server, `undeny` lifts
/// it, and a malformed `--for` is a usage error.
#[tokio::test]
async fn deny_and_undeny_reach_a_replica_through_redis() {
    let server = RedisServer::start();
    let text = r#"
[[limit]]
name = "per-ip"
algorithm = "gcra"
period = "1m"
key = "ip"
[limit.quota]
default = 60
"#;
    let path = file("deny", text);
    let backend = app_backend(&server);
    let limit = Limit::gcra("per-ip", Quota::per_minute(60).unwrap()).unwrap();
    let key = ip_key("203.0.113.7");
    let status = || {
        let f = backend.check(&[Check::new(&limit, key.as_bytes())]);
        async move { f.await.unwrap()[0].status }
    };
    let url = server.url();
    let target = |command: &'static str| {
        let mut args = vec![
            command,
            "--redis",
            &url,
            "--prefix",
            "app",
            "--limits",
            path.to_str().unwrap(),
            "per-ip",
            "203.0.113.7",
        ];
        if command == "deny" {
            args.extend(["--for", "2h"]);
        }
        run(&args)
    };
    let denied = target("deny");
    assert_eq!(denied.status.code(), Some(0), "{}", stderr(&denied));
    assert_eq!(stdout(&denied), "denied 203.0.113.7 under per-ip for 2h\n");
    let Status::Denylisted { retry_after } = status().await else {
        panic!("the replica refuses the denied identity");
    };
    assert!(retry_after > 7_199_000_000 && retry_after <= 7_200_000_000);
    // `peek` says the identity is denied, and until when.
    let peeked = run(&[
        "peek",
        "--redis",
        &url,
        "--prefix",
        "app",
        "--limits",
        path.to_str().unwrap(),
        "per-ip",
        "203.0.113.7",
    ]);
    let text = stdout(&peeked);
    let denied = text
        .lines()
        .find(|l| l.starts_with("denied     until 20"))
        .unwrap_or_else(|| panic!("no deny in:\n{text}"));
    assert!(
        denied.ends_with("Z (in 7200s)") || denied.ends_with("Z (in 7199s)"),
        "{denied}"
    );
    assert!(text.contains("remaining  0\n"), "{text}");
    let lifted = target("undeny");
    assert_eq!(lifted.status.code(), Some(0), "{}", stderr(&lifted));
    assert_eq!(
        stdout(&lifted),
        "lifted the deny of 203.0.113.7 under per-ip\n"
    );
    // There is none left to lift: said so.
    let again = target("undeny");
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    assert_eq!(
        stdout(&again),
        "203.0.113.7 was not denied under per-ip: nothing to lift\n"
    );
    // The replica's deny cache holds the deny for up to its TTL; a replica without one
    // (a backend of its own) asks Redis, which admits.
    let other = app_backend(&server);
    let v = other
        .check(&[Check::new(&limit, key.as_bytes())])
        .await
        .unwrap();
    assert_eq!(v[0].status, Status::Allowed);
    // 36526d is a day past the longest deny (100 years, `MAX_DENY`).
    for bad in ["0", "1w", "h", "99999999999999999d", "36526d", "999999d"] {
        let out = run(&[
            "deny",
            "--redis",
            &url,
            "--limits",
            path.to_str().unwrap(),
            "per-ip",
            "203.0.113.7",
            "--for",
            bad,
        ]);
        assert_eq!(out.status.code(), Some(2), "--for {bad}: {}", stderr(&out));
    }
}

/// `check -` reads the file from standard input, as `check FILE` reads it.
#[test]
fn check_dash_reads_standard_input() {
    use std::io::Write;
    let from = |text: &str| {
        let mut child = command(&["check", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let out = from(GOOD);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let path = file("stdin-good", GOOD);
    let from_file = stdout(&run(&["check", path.to_str().unwrap()]));
    assert_eq!(
        stdout(&out),
        from_file.replace(path.to_str().unwrap(), "standard input")
    );
    assert!(stdout(&out).ends_with("standard input: ok, 4 limits\n"));
    let out = from("[[limit]]\nname = \"a\"\n");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with("standard input: limits file, line 1 column 1: "),
        "{}",
        stderr(&out)
    );
}

/// A field misspelt below `[limit.quota]` would be a plan: `check` refuses it, exit 1.
#[test]
fn check_refuses_a_plan_named_like_a_field() {
    broken(
        "qota",
        "[[limit]]\nname = \"api\"\nperiod = \"1m\"\nkey = \"ip\"\n[limit.quota]\n\
         default = 5\nqota = 3\n",
        7,
        1,
        "limit \"api\": plan \"qota\" is one edit from `quota`: did you mean `quota`?",
    );
}

/// The limits file `peek` and `reset` read below: a GCRA limit and a concurrency limit.
const TARGETS: &str = r#"
[[limit]]
name = "per-ip"
period = "1m"
key = "ip"
[limit.quota]
default = { limit = 60, burst = 10 }

[[limit]]
name = "jobs"
algorithm = "concurrency"
key = "ip"
quota = 5
"#;

/// `peek` and `reset` of one identity, with `extra` options, on the server at `url`.
fn on_target(sub: &str, url: &str, limits: &Path, extra: &[&str], limit: &str) -> Output {
    let mut args = vec![
        sub,
        "--redis",
        url,
        "--prefix",
        "app",
        "--limits",
        limits.to_str().unwrap(),
    ];
    args.extend(extra);
    args.extend([limit, "203.0.113.7"]);
    run(&args)
}

/// Over TLS, from a TLS-only server: `peek` reads a key and `reset` forgets it.
#[tokio::test]
async fn peek_and_reset_reach_a_tls_only_redis() {
    let certs = tollgate_testsupport::TestCerts::generate();
    let server = RedisServer::start_tls(&certs);
    let url = server.url();
    assert!(url.starts_with("rediss://"), "{url}");
    let ca = file("ca.pem", certs.ca_pem());
    let limits = file("tls-targets", TARGETS);
    let backend = RedisBackend::builder()
        .url(&url)
        .tls_ca_pem(certs.ca_pem())
        .prefix("app")
        .build()
        .unwrap();
    let limit = Limit::gcra(
        "per-ip",
        Quota::per_minute(60).unwrap().with_burst(10).unwrap(),
    )
    .unwrap();
    let key = ip_key("203.0.113.7");
    for _ in 0..4 {
        let v = backend
            .check(&[Check::new(&limit, key.as_bytes())])
            .await
            .unwrap();
        assert!(v[0].is_allowed());
    }
    let tls = ["--tls-ca", ca.to_str().unwrap()];
    let peek = on_target("peek", &url, &limits, &tls, "per-ip");
    assert_eq!(peek.status.code(), Some(0), "{}", stderr(&peek));
    let text = stdout(&peek);
    assert!(text.contains("burst      10\nremaining  6\n"), "{text}");
    let reset = on_target("reset", &url, &limits, &tls, "per-ip");
    assert_eq!(reset.status.code(), Some(0), "{}", stderr(&reset));
    assert_eq!(
        stdout(&reset),
        "reset 203.0.113.7 under per-ip: its next request finds the whole quota\n"
    );
    let peek = on_target("peek", &url, &limits, &tls, "per-ip");
    assert!(
        stdout(&peek).contains("remaining  10\n"),
        "{}",
        stdout(&peek)
    );
    let v = backend
        .check(&[Check::new(&limit, key.as_bytes())])
        .await
        .unwrap();
    assert_eq!(v[0].remaining, 9);
    // Without the CA, the server's certificate is not trusted: Redis failed, exit 3.
    let untrusted = on_target("peek", &url, &limits, &[], "per-ip");
    assert_eq!(untrusted.status.code(), Some(3), "{}", stderr(&untrusted));
}

/// A concurrency limit peeks as the requests in flight, and cannot be reset; a reset leaves
/// a deny and says so.
#[tokio::test]
async fn peek_shows_requests_in_flight_and_reset_what_it_leaves() {
    let server = RedisServer::start();
    let url = server.url();
    let limits = file("targets", TARGETS);
    let backend = app_backend(&server);
    let jobs = Limit::concurrency("jobs", 5).unwrap();
    let key = ip_key("203.0.113.7");
    for slot in 1..=3 {
        let v = backend
            .check(&[Check::new(&jobs, key.as_bytes()).with_slot(slot)])
            .await
            .unwrap();
        assert!(v[0].is_allowed());
    }
    let peek = on_target("peek", &url, &limits, &[], "jobs");
    assert_eq!(peek.status.code(), Some(0), "{}", stderr(&peek));
    assert_eq!(
        stdout(&peek),
        "limit      jobs (concurrency 5 at once)\nidentity   203.0.113.7\n\
         in flight  3\nremaining  2\n"
    );
    let reset = on_target("reset", &url, &limits, &[], "jobs");
    assert_eq!(reset.status.code(), Some(1));
    assert_eq!(
        stderr(&reset),
        "limit \"jobs\" is a concurrency limit: its slots are requests still in flight, given \
         back when they end, and cannot be reset\n"
    );
    let deny = on_target("deny", &url, &limits, &["--for", "1h"], "per-ip");
    assert_eq!(deny.status.code(), Some(0), "{}", stderr(&deny));
    let reset = on_target("reset", &url, &limits, &[], "per-ip");
    assert_eq!(reset.status.code(), Some(0), "{}", stderr(&reset));
    assert_eq!(stdout(&reset).lines().count(), 2, "{}", stdout(&reset));
    assert!(
        stdout(&reset).contains("\nit is still denied until 20"),
        "{}",
        stdout(&reset)
    );
}

/// A Redis that accepts and never answers: the command gives up after the 2 s its help
/// states, not sooner.
#[test]
fn a_silent_redis_is_given_the_deadline_the_help_states() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}/", listener.local_addr().unwrap());
    // Accepts every connection and holds it, silent, until the test ends.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            held.push(conn);
        }
    });
    let limits = file("silent", TARGETS);
    let started = std::time::Instant::now();
    let out = on_target("peek", &url, &limits, &[], "per-ip");
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        "rate-limit backend timeout: no answer to peek within 2s\n"
    );
    assert!(took >= Duration::from_secs(2), "{took:?}");
}

/// A server that is not Redis: one line that says so, exit 3.
#[test]
fn a_server_that_is_not_redis_is_one_line() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}/", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n\
                  Content-Length: 11\r\nConnection: close\r\n\r\nBad Request",
            );
        }
    });
    let limits = file("not-redis", TARGETS);
    let out = on_target("peek", &url, &limits, &[], "per-ip");
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("the server does not answer as Redis does: is it a Redis server?"),
        "{err}"
    );
}

/// URL mistakes say what was expected, and are usage errors.
#[test]
fn a_bad_redis_url_says_what_was_expected() {
    let limits = file("urls", TARGETS);
    for (url, says) in [
        (
            "127.0.0.1:6379",
            "redis: invalid Redis URL: no scheme: a Redis URL starts with redis://",
        ),
        (
            "http://127.0.0.1:6379/",
            "redis: invalid Redis URL: http:// is not a Redis scheme",
        ),
        (
            "redis://127.0.0.1:99999/",
            "redis: invalid Redis URL: port 99999 is out of range",
        ),
    ] {
        let out = on_target("peek", url, &limits, &[], "per-ip");
        assert_eq!(out.status.code(), Some(2), "{url}");
        assert!(stderr(&out).starts_with(says), "{url}: {}", stderr(&out));
    }
}

/// `peek --key-secret-env NAME` reads the state a backend built with that key secret wrote
/// (the secret comes from the environment, never from the arguments); without it, the
/// unkeyed key is another, empty one; a variable that is not set is a usage error.
#[tokio::test]
async fn peek_with_a_key_secret_reads_the_keyed_state() {
    let server = RedisServer::start();
    let text = r#"
[[limit]]
name = "daily"
algorithm = "fixed_window"
period = "1d"
key = "ip"
[limit.quota]
default = 10
"#;
    let path = file("peek-keyed", text);
    let secret = "a secret of thirty-two bytes, ok";
    let backend = RedisBackend::builder()
        .url(server.url())
        .prefix("app")
        .key_secret(secret)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let limit = Limit::fixed_window("daily", Quota::per_day(10).unwrap()).unwrap();
    let key = ip_key("203.0.113.7");
    for _ in 0..3 {
        let v = backend
            .check(&[Check::new(&limit, key.as_bytes())])
            .await
            .unwrap();
        assert!(v[0].is_allowed());
    }
    let url = server.url();
    let peek = |secret_env: Option<&str>| {
        let mut args = vec!["peek", "--redis", &url, "--prefix", "app"];
        args.extend(["--limits", path.to_str().unwrap()]);
        if let Some(name) = secret_env {
            args.extend(["--key-secret-env", name]);
        }
        args.extend(["daily", "203.0.113.7"]);
        command(&args)
            .env("TOLLGATE_TEST_KEY_SECRET", secret)
            .env_remove("TOLLGATE_TEST_NO_SECRET")
            .output()
            .unwrap()
    };
    let keyed = peek(Some("TOLLGATE_TEST_KEY_SECRET"));
    assert_eq!(keyed.status.code(), Some(0), "{}", stderr(&keyed));
    assert!(
        stdout(&keyed).contains("remaining  7\n"),
        "{}",
        stdout(&keyed)
    );
    let unkeyed = peek(None);
    assert!(
        stdout(&unkeyed).contains("remaining  10\n"),
        "{}",
        stdout(&unkeyed)
    );
    let unset = peek(Some("TOLLGATE_TEST_NO_SECRET"));
    assert_eq!(unset.status.code(), Some(2));
    assert_eq!(
        stderr(&unset),
        "tollgate: --key-secret-env: the environment variable TOLLGATE_TEST_NO_SECRET is not set\n"
    );
}
