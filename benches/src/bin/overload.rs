//! The overload benchmark: a server of known capacity behind each system in turn (no
//! limiter, a static concurrency limit, tower-acc's Gradient2, tollgate), under open-loop load
//! through a steady phase, spikes, a slower dependency and recoveries. Run it with
//! `benches/overload.sh`; what it prints is explained in `docs/benchmarks.md`, "Overload".
//!
//! ```text
//! overload                       # the run; settings from the environment (see overload.sh)
//! overload serve --system NAME --workers W --service-us US [--threads N]
//!                                # one server, printing `port N` once it listens
//! ```

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::str::FromStr;
use std::time::Duration;

use tollgate_bench::overload::load::{self, Mix, Settings, Target};
use tollgate_bench::overload::phases::{self, Phase};
use tollgate_bench::overload::server;
use tollgate_bench::overload::stats;
use tollgate_bench::overload::systems::System;
use tollgate_bench::overload::Capacity;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        None => drive(),
        Some(other) => Err(format!(
            "unknown command {other}: `overload` or `overload serve`"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("overload: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse<T: FromStr>(name: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("{name}: not a valid value: {value:?}"))
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
}

/// A setting from the environment, or its default.
fn env<T: FromStr>(name: &str, default: T) -> Result<T, String> {
    match std::env::var(name) {
        Ok(value) => parse(name, &value),
        Err(_) => Ok(default),
    }
}

fn serve(args: &[String]) -> Result<(), String> {
    let mut system = None;
    let mut capacity = Capacity {
        workers: 8,
        service: Duration::from_millis(20),
    };
    let mut threads = 1;
    for pair in args.chunks(2) {
        let [flag, value] = pair else {
            return Err(format!("{}: needs a value", pair[0]));
        };
        match flag.as_str() {
            "--system" => {
                system = Some(System::parse(value).ok_or(format!("no system {value:?}"))?);
            }
            "--workers" => capacity.workers = parse(flag, value)?,
            "--service-us" => capacity.service = Duration::from_micros(parse(flag, value)?),
            "--threads" => threads = parse(flag, value)?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let system = system.ok_or("--system is needed")?;
    let app = server::app(system, capacity)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        println!("port {port}");
        server::serve(listener, app)
            .await
            .map_err(|e| e.to_string())
    })
}

struct Config {
    rounds: u32,
    quiet_pct: u64,
    quiet_max: u32,
    capacity: Capacity,
    phases: Vec<Phase>,
    settings: Settings,
    systems: Vec<System>,
    server_cpu: Option<String>,
    server_threads: usize,
    load_threads: usize,
}

fn config() -> Result<Config, String> {
    let capacity = Capacity {
        workers: env("WORKERS", 8)?,
        service: Duration::from_micros(env("SERVICE_US", 20_000)?),
    };
    if capacity.workers == 0 || capacity.service.is_zero() {
        return Err("WORKERS and SERVICE_US must be above 0".into());
    }
    let phase = Duration::try_from_secs_f64(env("PHASE_SECS", 5.0)?)
        .map_err(|e| format!("PHASE_SECS: {e}"))?;
    let settings = Settings {
        capacity,
        timeout: Duration::from_millis(env("TIMEOUT_MS", 1_000)?),
        warmup: Duration::try_from_secs_f64(env("WARMUP_SECS", 2.0)?)
            .map_err(|e| format!("WARMUP_SECS: {e}"))?,
        mix: {
            let mix = env("MIX", "spike".to_string())?;
            Mix::parse(&mix).ok_or(format!("MIX: {mix:?} is neither spike nor fixed"))?
        },
    };
    // `none` always runs, first: its steady phase gives the unloaded p99.
    let mut systems = vec![System::None];
    for name in env("SYSTEMS", "none static tower-acc tollgate".to_string())?.split_whitespace() {
        let system = System::parse(name).ok_or(format!("SYSTEMS: no system {name:?}"))?;
        if !systems.contains(&system) {
            systems.push(system);
        }
    }
    Ok(Config {
        rounds: env("ROUNDS", 1)?.max(1),
        quiet_pct: env("QUIET_PCT", 20)?,
        quiet_max: env("QUIET_MAX", 5)?,
        capacity,
        phases: phases::plan(phase),
        settings,
        systems,
        server_cpu: std::env::var("SERVER_CPU").ok().filter(|c| !c.is_empty()),
        server_threads: env("SERVER_THREADS", 1)?,
        load_threads: env("LOAD_THREADS", 1)?,
    })
}

/// A fresh server for `system`, and the port it listens on.
fn start(config: &Config, system: System) -> Result<(std::process::Child, u16), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut command = match &config.server_cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", cpu]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    command
        .args(["serve", "--system", system.name()])
        .args(["--workers", &config.capacity.workers.to_string()])
        .args([
            "--service-us",
            &config.capacity.service.as_micros().to_string(),
        ])
        .args(["--threads", &config.server_threads.to_string()])
        .stdout(Stdio::piped());
    let mut child = command
        .spawn()
        .map_err(|e| format!("starting the server: {e}"))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    match line.trim().strip_prefix("port ").map(str::parse) {
        Some(Ok(port)) => Ok((child, port)),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("the {} server did not start", system.name()))
        }
    }
}

fn drive() -> Result<(), String> {
    let config = config()?;
    let c = config.capacity.per_second();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.load_threads)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let length = config.phases.first().map_or(Duration::ZERO, |p| p.length);
    println!(
        "W = {} workers, S = {:.1} ms, C = {c:.0} req/s; phases of {:.1} s: {}; deadline {} ms",
        config.capacity.workers,
        config.capacity.service.as_secs_f64() * 1e3,
        length.as_secs_f64(),
        config
            .phases
            .iter()
            .map(|p| format!(
                "{} ({}x C{})",
                p.name,
                p.load,
                if p.slowdown > 1 { ", S x2" } else { "" }
            ))
            .collect::<Vec<_>>()
            .join(", "),
        config.settings.timeout.as_millis(),
    );
    println!(
        "classes: {}",
        match config.settings.mix {
            Mix::Spike =>
                "20% critical, 50% default, 30% batch up to 0.5x C; above it critical \
                           stays at 0.1x C and the rest is default and batch, 5 to 3 (MIX=spike)",
            Mix::Fixed => "20% critical, 50% default, 30% batch at every load (MIX=fixed)",
        }
    );
    let mut runs = Vec::new();
    let mut unloaded_p99s = Vec::new();
    for round in 1..=config.rounds {
        println!(
            "\nround {round} of {}\n\n{}",
            config.rounds,
            stats::header()
        );
        let mut round_runs = Vec::new();
        let mut unloaded = None;
        let mut others = Vec::new();
        for &system in &config.systems {
            quiet(&config);
            let (mut child, port) = start(&config, system)?;
            let target = Target {
                port,
                pid: child.id(),
            };
            let before = Ticks::now(child.id());
            let run = runtime.block_on(load::run(target, config.settings, &config.phases));
            let other = Ticks::now(child.id()).other_since(before);
            let _ = child.kill();
            let _ = child.wait();
            let run = run?;
            others.push(format!(
                "{}: {}",
                system.name(),
                other.map_or("-".into(), |o| format!("{o:.0}%"))
            ));
            if system == System::None {
                unloaded = stats::steady_p99(&run, &config.phases);
            }
            for row in stats::rows(system.name(), &run, &config.phases, c, unloaded) {
                println!("{}", stats::line(&row, length));
            }
            round_runs.push((system, run));
        }
        println!(
            "\nunloaded p99 (none, steady): {}; other load on the machine during each system's run (% of one CPU, neither the server nor the load): {}",
            ms(unloaded),
            others.join(", ")
        );
        unloaded_p99s.extend(unloaded);
        runs.push(round_runs);
    }
    // Every round's figures against one unloaded p99, the lowest of the rounds': a stall of
    // the machine only ever raises a p99.
    let unloaded = unloaded_p99s.iter().min().copied();
    let rounds: Vec<Vec<stats::Row>> = runs
        .iter()
        .map(|round| {
            round
                .iter()
                .flat_map(|(system, run)| {
                    stats::rows(system.name(), run, &config.phases, c, unloaded)
                })
                .collect()
        })
        .collect();
    let rows = stats::median(&rounds, unloaded);
    if rounds.len() > 1 {
        println!(
            "\nmedian of {} rounds, all against the lowest unloaded p99 of the rounds ({})\n\n{}",
            rounds.len(),
            ms(unloaded),
            stats::header()
        );
        for row in &rows {
            println!("{}", stats::line(row, length));
        }
    }
    let names: Vec<&str> = config.systems.iter().map(|s| s.name()).collect();
    println!();
    print!("{}", stats::cpu_table(&rows, &names));
    println!();
    for (prefix, system) in [("tower-acc", "tower-acc"), ("tollgate", "tollgate")] {
        if let Some(line) = stats::limit_summary(prefix, system, &rows) {
            println!("{line}");
        }
    }
    if config.systems.contains(&System::TowerAcc) {
        println!(
            "{}",
            stats::summary("tower-acc", "tower-acc", &rows, length)
        );
    }
    if config.systems.contains(&System::Tollgate) {
        println!("{}", stats::summary("overload", "tollgate", &rows, length));
    }
    Ok(())
}

/// CPU ticks: the whole machine's busy time (`/proc/stat`), this process's and the server's.
#[derive(Clone, Copy)]
struct Ticks {
    at: std::time::Instant,
    machine: Option<u64>,
    own: Option<u64>,
    server: Option<u64>,
}

impl Ticks {
    fn now(server: u32) -> Ticks {
        Ticks {
            at: std::time::Instant::now(),
            machine: machine_busy(),
            own: tollgate_bench::cpu_ticks(std::process::id()),
            server: tollgate_bench::cpu_ticks(server),
        }
    }

    /// The share of one CPU that neither process used since `before`, in percent.
    fn other_since(self, before: Ticks) -> Option<f64> {
        let busy = self.machine?.checked_sub(before.machine?)?;
        let own = self.own?.checked_sub(before.own?)?;
        let server = self.server?.checked_sub(before.server?)?;
        let other = busy.saturating_sub(own + server) as f64 / ticks_per_second();
        Some(100.0 * other / self.at.duration_since(before.at).as_secs_f64())
    }
}

/// The ticks of a second in `/proc`: `USER_HZ`, 100 on Linux.
fn ticks_per_second() -> f64 {
    100.0
}

/// The machine's busy time so far, all CPUs, in ticks (`/proc/stat`'s `cpu` line less idle
/// and I/O wait).
fn machine_busy() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let total: u64 = fields.iter().take(8).sum();
    Some(total - fields.get(3)? - fields.get(4)?)
}

/// Waits until the rest of the machine uses under `QUIET_PCT`% of a CPU for a second, at most
/// `QUIET_MAX` seconds.
fn quiet(config: &Config) {
    for _ in 0..config.quiet_max {
        let (b0, own0) = (
            machine_busy(),
            tollgate_bench::cpu_ticks(std::process::id()),
        );
        std::thread::sleep(Duration::from_secs(1));
        let (b1, own1) = (
            machine_busy(),
            tollgate_bench::cpu_ticks(std::process::id()),
        );
        let busy = b1.zip(b0).map(|(b1, b0)| b1.saturating_sub(b0));
        let own = own1.zip(own0).map_or(0, |(o1, o0)| o1.saturating_sub(o0));
        if busy.is_some_and(|b| {
            (b.saturating_sub(own) as f64) < config.quiet_pct as f64 * ticks_per_second() / 100.0
        }) {
            return;
        }
    }
}
