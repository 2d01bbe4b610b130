//! What the bench observes besides its own clocks: CPU time per process
//! group from `/proc`, Postgres' WAL and commit counters, Ductor's own
//! metrics, Kafka high watermarks, and the progress line on stderr.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde::Serialize;
use sqlx::{PgPool, Row};

use ductor::config::KafkaConfig;

/// `/proc` reports CPU time in USER_HZ ticks, 100 per second on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

/// The process groups CPU time is attributed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Group {
    Ductor,
    Postgres,
    Kafka,
}

/// Cumulative CPU ticks per process of this process, the stack's Postgres
/// and its Kafka broker, and of the whole machine. Kept per pid, so that a
/// process ending inside a window loses its own share instead of making the
/// group's sum go down.
#[derive(Debug, Clone, Default)]
pub struct CpuTicks {
    processes: BTreeMap<(Group, u32), u64>,
    /// Busy ticks of the whole machine (`/proc/stat`), all CPUs summed,
    /// steal excluded.
    machine: u64,
    /// Steal ticks of the whole machine.
    steal: u64,
    at: Option<Instant>,
}

/// Cores used on average over a window, per process group.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CpuCores {
    /// This process: the pipeline (ingress, drainer, worker) and the bench's clients.
    pub ductor: f64,
    pub postgres: f64,
    pub kafka: f64,
    /// Everything else on the machine (compilers, other tests): contention
    /// that the figures do not account for.
    pub other: f64,
    /// CPU time the hypervisor gave to other guests while this machine's
    /// threads were ready to run (`steal` in `/proc/stat`): not counted in
    /// `other`, and as disturbing.
    pub steal: f64,
}

/// Which processes count as whose: the stack's Kafka broker is the process
/// listening on the bootstrap port; Postgres is every `postgres` process
/// except backends serving other databases (another test suite sharing the
/// server shows up as `other`, not as the bench's Postgres load).
#[derive(Debug, Clone, Default)]
pub struct CpuScope {
    pub db_name: String,
    pub kafka_pid: Option<String>,
    /// The process counted as Ductor: this one when `None`, else a `serve`
    /// of its own (timed from outside, see `outside`).
    pub ductor_pid: Option<String>,
}

impl CpuScope {
    pub fn new(db_name: &str, bootstrap_servers: &str) -> CpuScope {
        let port = bootstrap_servers
            .split(',')
            .next()
            .and_then(|s| s.rsplit(':').next())
            .and_then(|p| p.trim().parse::<u16>().ok());
        CpuScope {
            db_name: db_name.to_string(),
            kafka_pid: port.and_then(listener_pid),
            ductor_pid: None,
        }
    }
}

/// The pid owning the listening TCP socket on `port`, if it can be seen.
fn listener_pid(port: u16) -> Option<String> {
    let wanted = format!(":{port:04X}");
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address, rem_address, st (0A = LISTEN), ..., inode at 9.
            if f.len() > 9 && f[1].ends_with(&wanted) && f[3] == "0A" {
                inodes.push(format!("socket:[{}]", f[9]));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && inodes.iter().any(|i| target.as_os_str() == i.as_str())
            {
                return Some(pid);
            }
        }
    }
    None
}

impl CpuTicks {
    /// Reads `/proc/<pid>/stat` of every process; processes that vanish
    /// meanwhile are skipped. All zero where `/proc` cannot be read.
    pub fn sample(scope: &CpuScope) -> CpuTicks {
        let mut ticks = CpuTicks {
            at: Some(Instant::now()),
            ..CpuTicks::default()
        };
        (ticks.machine, ticks.steal) = machine_busy_ticks().unwrap_or((0, 0));
        let me = scope
            .ductor_pid
            .clone()
            .unwrap_or_else(|| std::process::id().to_string());
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return ticks;
        };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((comm, used)) = parse_stat(&stat) else {
                continue;
            };
            let group = if pid == me {
                Group::Ductor
            } else if comm.starts_with("postgres") {
                let title =
                    std::fs::read_to_string(entry.path().join("cmdline")).unwrap_or_default();
                if other_database_backend(&title, &scope.db_name) {
                    continue;
                }
                Group::Postgres
            } else if comm == "java" && scope.kafka_pid.as_deref().is_none_or(|k| k == pid) {
                Group::Kafka
            } else {
                continue;
            };
            if let Ok(pid) = pid.parse::<u32>() {
                ticks.processes.insert((group, pid), used);
            }
        }
        ticks
    }

    /// Average cores used between `self` and `later`.
    pub fn cores_until(&self, later: &CpuTicks) -> CpuCores {
        let seconds = match (self.at, later.at) {
            (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
            _ => 0.0,
        };
        if seconds <= 0.0 {
            return CpuCores::default();
        }
        let cores = |ticks: u64| ticks as f64 / TICKS_PER_SECOND / seconds;
        let group = |g: Group| {
            let ticks: u64 = later
                .processes
                .iter()
                .filter(|((group, _), _)| *group == g)
                .map(|(key, after)| {
                    after.saturating_sub(self.processes.get(key).copied().unwrap_or(0))
                })
                .sum();
            cores(ticks)
        };
        let ductor = group(Group::Ductor);
        let postgres = group(Group::Postgres);
        let kafka = group(Group::Kafka);
        CpuCores {
            ductor,
            postgres,
            kafka,
            other: (cores(later.machine.saturating_sub(self.machine)) - ductor - postgres - kafka)
                .max(0.0),
            steal: cores(later.steal.saturating_sub(self.steal)),
        }
    }
}

/// A backend serving another database: its title is
/// `postgres: <user> <database> <client> <activity>`.
fn other_database_backend(title: &str, db_name: &str) -> bool {
    let is_backend =
        title.contains("127.0.0.1(") || title.contains("[local]") || title.contains("::1(");
    is_backend && !title.contains(&format!(" {db_name} "))
}

/// Busy ticks of all CPUs: the first line of `/proc/stat` less idle and iowait.
/// `(busy, steal)` ticks of the whole machine; busy excludes steal.
fn machine_busy_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is in user).
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3)? + fields.get(4)?;
    let steal = fields.get(7).copied().unwrap_or(0);
    Some((total.saturating_sub(idle).saturating_sub(steal), steal))
}

/// `(comm, utime + stime)` of one `/proc/<pid>/stat` line.
fn parse_stat(stat: &str) -> Option<(&str, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let fields: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
    // After the comm: state is field 3 of the man page, utime 14, stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((comm, utime + stime))
}

/// Cluster-wide WAL counters (`pg_stat_wal`) and the bench database's
/// commits (`pg_stat_database`, read-only transactions included).
#[derive(Debug, Clone, Copy, Default)]
pub struct PgCounters {
    wal_records: f64,
    wal_bytes: f64,
    wal_syncs: f64,
    commits: f64,
}

/// Postgres work per applied input over a window.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PgPerInput {
    pub wal_records: f64,
    pub wal_bytes: f64,
    /// WAL fsyncs (group commit makes this < commits).
    pub wal_syncs: f64,
    /// Transactions committed in the bench database, reads included.
    pub commits: f64,
}

impl PgCounters {
    pub async fn sample(pool: &PgPool, db_name: &str) -> anyhow::Result<PgCounters> {
        let row = sqlx::query(
            "SELECT w.wal_records::float8 AS wal_records, w.wal_bytes::float8 AS wal_bytes, \
                 w.wal_sync::float8 AS wal_syncs, d.xact_commit::float8 AS commits \
             FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = $1",
        )
        .bind(db_name)
        .fetch_one(pool)
        .await
        .context("reading pg_stat_wal and pg_stat_database")?;
        Ok(PgCounters {
            wal_records: row.try_get("wal_records")?,
            wal_bytes: row.try_get("wal_bytes")?,
            wal_syncs: row.try_get("wal_syncs")?,
            commits: row.try_get("commits")?,
        })
    }

    pub fn per_input(&self, later: &PgCounters, inputs: u64) -> PgPerInput {
        let n = inputs.max(1) as f64;
        PgPerInput {
            wal_records: (later.wal_records - self.wal_records) / n,
            wal_bytes: (later.wal_bytes - self.wal_bytes) / n,
            wal_syncs: (later.wal_syncs - self.wal_syncs) / n,
            commits: (later.commits - self.commits) / n,
        }
    }
}

/// `_sum` and `_count` of Ductor's histograms, from the process-wide
/// Prometheus recorder that `serve` installs.
#[derive(Debug, Clone, Default)]
pub struct Histograms(BTreeMap<String, f64>);

impl Histograms {
    pub fn sample() -> Histograms {
        Histograms::parse(&ductor::infra::telemetry::metrics_handle().render())
    }

    /// The `_sum` and `_count` series of a Prometheus text exposition.
    pub fn parse(text: &str) -> Histograms {
        let mut values = BTreeMap::new();
        for (series, v) in ductor_testkit::metrics::samples(text) {
            // `name_sum{labels}` is kept as `name{labels}_sum`.
            let (base, labels) = match series.split_once('{') {
                Some((base, rest)) => (base, format!("{{{rest}")),
                None => (series, String::new()),
            };
            for suffix in ["_sum", "_count"] {
                if let Some(metric) = base.strip_suffix(suffix) {
                    values.insert(format!("{metric}{labels}{suffix}"), v);
                }
            }
        }
        Histograms(values)
    }

    /// `(count, sum)` of `name` between `self` and `later`; a labelled
    /// series is named as in the exposition, `name{label="value"}`.
    pub fn delta(&self, later: &Histograms, name: &str) -> (f64, f64) {
        let get = |h: &Histograms, suffix: &str| {
            h.0.get(&format!("{name}{suffix}")).copied().unwrap_or(0.0)
        };
        (
            get(later, "_count") - get(self, "_count"),
            get(later, "_sum") - get(self, "_sum"),
        )
    }
}

/// Messages in each topic so far: the sum of its partitions' high
/// watermarks (the producers are idempotent, not transactional, so offsets
/// count messages).
pub async fn topic_offsets(
    kafka: &KafkaConfig,
    topics: &[String],
) -> anyhow::Result<BTreeMap<String, i64>> {
    let kafka = kafka.clone();
    let topics = topics.to_vec();
    tokio::task::spawn_blocking(move || {
        let timeout = Duration::from_millis(kafka.admin_timeout_ms);
        let consumer: BaseConsumer =
            ductor::infra::kafka::consumer_config(&kafka, "bench-offsets", "offsets")
                .create()
                .context("creating the offsets client")?;
        let mut out = BTreeMap::new();
        for topic in topics {
            let metadata = consumer
                .fetch_metadata(Some(&topic), timeout)
                .with_context(|| format!("fetching metadata of {topic}"))?;
            let mut total = 0;
            for t in metadata.topics() {
                for p in t.partitions() {
                    let (_, high) = consumer
                        .fetch_watermarks(&topic, p.id(), timeout)
                        .with_context(|| format!("fetching watermarks of {topic}/{}", p.id()))?;
                    total += high;
                }
            }
            out.insert(topic, total);
        }
        Ok(out)
    })
    .await
    .context("offsets task")?
}

/// Messages added to all topics between two [`topic_offsets`] samples.
pub fn messages_between(before: &BTreeMap<String, i64>, after: &BTreeMap<String, i64>) -> i64 {
    after
        .iter()
        .map(|(t, n)| n - before.get(t).copied().unwrap_or(0))
        .sum()
}

/// The progress display: one line rewritten in place on a terminal, one line
/// every few seconds otherwise.
pub struct Progress {
    tty: bool,
    last: Option<Instant>,
    started: Instant,
}

const PROGRESS_EVERY: Duration = Duration::from_secs(3);

impl Default for Progress {
    fn default() -> Self {
        Progress {
            tty: std::io::stderr().is_terminal(),
            last: None,
            started: Instant::now(),
        }
    }
}

impl Progress {
    /// A transient status line.
    pub fn update(&mut self, line: &str) {
        let now = Instant::now();
        let elapsed = now.duration_since(self.started).as_secs_f64();
        // The print macros, not a raw stderr handle, so that a test harness
        // captures the progress of an in-process bench.
        if self.tty {
            eprint!("\r\x1b[2K[{elapsed:6.1}s] {line}");
            let _ = std::io::stderr().flush();
        } else if self
            .last
            .is_none_or(|l| now.duration_since(l) >= PROGRESS_EVERY)
        {
            eprintln!("[{elapsed:6.1}s] {line}");
            self.last = Some(now);
        }
    }

    /// A line that stays.
    pub fn done(&mut self, line: &str) {
        let elapsed = self.started.elapsed().as_secs_f64();
        if self.tty {
            eprint!("\r\x1b[2K");
        }
        eprintln!("[{elapsed:6.1}s] {line}");
        self.last = None;
    }
}

/// Bounds a wait: fails when the overall deadline passes or when the
/// watched count has not moved for `stall`.
pub struct Watchdog {
    what: String,
    deadline: Instant,
    stall: Duration,
    last_value: u64,
    last_change: Instant,
}

impl Watchdog {
    pub fn new(what: impl Into<String>, limit: Duration, stall: Duration) -> Watchdog {
        let now = Instant::now();
        Watchdog {
            what: what.into(),
            deadline: now + limit,
            stall,
            last_value: 0,
            last_change: now,
        }
    }

    /// Records progress `value` out of `target`; an error names the phase,
    /// how far it got and why it gave up.
    pub fn check(&mut self, value: u64, target: u64) -> anyhow::Result<()> {
        let now = Instant::now();
        if value != self.last_value {
            self.last_value = value;
            self.last_change = now;
        }
        if now >= self.deadline {
            anyhow::bail!(
                "{}: deadline passed with {value} of {target} done",
                self.what
            );
        }
        if now.duration_since(self.last_change) >= self.stall {
            anyhow::bail!(
                "{}: stalled at {value} of {target}, no progress for {} s",
                self.what,
                self.stall.as_secs()
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_with_spaces_in_comm() {
        let line =
            "42 (postgres: ductor x) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 0 0 20 0 1 0 5 0 0";
        assert_eq!(parse_stat(line), Some(("postgres: ductor x", 10)));
    }

    #[test]
    fn histogram_deltas_cover_plain_and_labelled_series() {
        let before = Histograms::parse(
            "# TYPE ductor_apply_seconds summary\n\
             ductor_apply_seconds{quantile=\"0.5\"} 0.01\n\
             ductor_apply_seconds_sum 1.5\n\
             ductor_apply_seconds_count 10\n\
             ductor_apply_phase_seconds_sum{phase=\"load\"} 0.25\n\
             ductor_apply_phase_seconds_count{phase=\"load\"} 10\n",
        );
        let after = Histograms::parse(
            "ductor_apply_seconds_sum 2.5\n\
             ductor_apply_seconds_count 30\n\
             ductor_apply_phase_seconds_sum{phase=\"load\"} 0.75\n\
             ductor_apply_phase_seconds_count{phase=\"load\"} 30\n\
             ductor_apply_phase_seconds_sum{phase=\"write\"} 4\n\
             ductor_apply_phase_seconds_count{phase=\"write\"} 20\n",
        );
        assert_eq!(before.delta(&after, "ductor_apply_seconds"), (20.0, 1.0));
        assert_eq!(
            before.delta(&after, "ductor_apply_phase_seconds{phase=\"load\"}"),
            (20.0, 0.5)
        );
        assert_eq!(
            before.delta(&after, "ductor_apply_phase_seconds{phase=\"write\"}"),
            (20.0, 4.0)
        );
        assert_eq!(before.delta(&after, "ductor_missing_seconds"), (0.0, 0.0));
    }

    #[test]
    fn watchdog_reports_a_stall() {
        let mut w = Watchdog::new("phase", Duration::from_secs(60), Duration::ZERO);
        let err = w.check(0, 10).unwrap_err().to_string();
        assert!(err.contains("stalled at 0 of 10"), "{err}");
    }
}
