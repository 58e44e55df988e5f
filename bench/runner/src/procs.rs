//! Child processes (Redis, podsim, gateway) and a tiny Redis client for INFO/FLUSHALL/SCAN.

use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// A child process killed when dropped (also on errors and Ctrl-C, as the run future is dropped).
pub struct Proc {
    child: Child,
    /// Lines printed before READY (e.g. `POD 0 127.0.0.1:1234`, `LISTENING main ...`).
    pub lines: Vec<String>,
}

impl Proc {
    /// Spawns `cmd` and reads stdout until a line `READY` (or fails after `timeout`).
    pub async fn spawn_until_ready(
        mut cmd: Command,
        what: &str,
        timeout: Duration,
    ) -> Result<Proc> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).stdin(Stdio::null()).kill_on_drop(true);
        let mut child = cmd.spawn().with_context(|| format!("starting {what}"))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("{what}: no stdout"))?;
        let mut reader = BufReader::new(stdout).lines();
        let mut lines = Vec::new();
        let ready = tokio::time::timeout(timeout, async {
            while let Some(l) = reader.next_line().await? {
                if l.trim() == "READY" {
                    return Ok::<bool, std::io::Error>(true);
                }
                lines.push(l);
            }
            Ok(false)
        })
        .await;
        match ready {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => bail!("{what} exited before READY (output: {lines:?})"),
            Ok(Err(e)) => bail!("{what}: reading stdout: {e}"),
            Err(_) => bail!("{what} not READY after {timeout:?} (output: {lines:?})"),
        }
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = reader.next_line().await {} });
        Ok(Proc { child, lines })
    }

    /// Spawns `cmd` with its stdout and stderr appended to `log` (no readiness line: the caller
    /// polls the process's port).
    pub fn spawn_logged(mut cmd: Command, what: &str, log: &Path) -> Result<Proc> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let child = cmd.spawn().with_context(|| format!("starting {what}"))?;
        Ok(Proc { child, lines: Vec::new() })
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Values of lines starting with `prefix` (the rest of the line, split on whitespace).
    pub fn lines_with(&self, prefix: &str) -> Vec<Vec<String>> {
        self.lines
            .iter()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(|r| r.split_whitespace().map(str::to_string).collect())
            .collect()
    }

    /// Stops the process now.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A local `redis-server` on a free port, no persistence.
pub struct Redis {
    /// The process.
    pub proc: Child,
    /// `127.0.0.1:port`.
    pub addr: String,
}

impl Redis {
    /// Starts redis-server and waits for PING.
    pub async fn start() -> Result<Redis> {
        let port = testkit::paths::free_port()?;
        let proc = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting redis-server (install it: apt-get install redis-server)")?;
        let addr = format!("127.0.0.1:{port}");
        for _ in 0..100 {
            if let Ok(Resp::Simple(s)) = redis_cmd(&addr, &["PING"]).await {
                if s == "PONG" {
                    return Ok(Redis { proc, addr });
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("redis-server on {addr} did not answer PING")
    }
}

/// A RESP reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Resp {
    /// +OK
    Simple(String),
    /// -ERR
    Error(String),
    /// :1
    Int(i64),
    /// $n (None for nil)
    Bulk(Option<Vec<u8>>),
    /// *n (None for nil)
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// Bulk or simple string as text.
    pub fn text(&self) -> String {
        match self {
            Resp::Simple(s) | Resp::Error(s) => s.clone(),
            Resp::Bulk(Some(b)) => String::from_utf8_lossy(b).into_owned(),
            Resp::Int(i) => i.to_string(),
            _ => String::new(),
        }
    }
}

async fn read_resp<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> Result<Resp> {
    let mut line = String::new();
    r.read_line(&mut line).await?;
    let line = line.trim_end_matches(['\r', '\n']);
    let (tag, rest) = line.split_at(line.len().min(1));
    Ok(match tag {
        "+" => Resp::Simple(rest.into()),
        "-" => Resp::Error(rest.into()),
        ":" => Resp::Int(rest.parse()?),
        "$" => {
            let n: i64 = rest.parse()?;
            if n < 0 {
                Resp::Bulk(None)
            } else {
                let mut buf = vec![0; n as usize + 2];
                r.read_exact(&mut buf).await?;
                buf.truncate(n as usize);
                Resp::Bulk(Some(buf))
            }
        }
        "*" => {
            let n: i64 = rest.parse()?;
            if n < 0 {
                Resp::Array(None)
            } else {
                let mut v = Vec::new();
                for _ in 0..n {
                    v.push(Box::pin(read_resp(r)).await?);
                }
                Resp::Array(Some(v))
            }
        }
        _ => bail!("bad RESP line {line:?}"),
    })
}

/// Sends one command on a fresh connection and reads the reply.
pub async fn redis_cmd(addr: &str, args: &[&str]) -> Result<Resp> {
    let mut s = TcpStream::connect(addr).await?;
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.write_all(req.as_bytes()).await?;
    let mut r = BufReader::new(s);
    read_resp(&mut r).await
}

/// `INFO <section>` parsed into key/value pairs.
pub async fn redis_info(addr: &str, section: &str) -> Result<Vec<(String, String)>> {
    let text = redis_cmd(addr, &["INFO", section]).await?.text();
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect())
}

/// Commands a client sends at top level that run Lua (the plugin sends nothing else on the
/// request path, plus `SCRIPT LOAD` after a `NOSCRIPT`).
const SCRIPT_COMMANDS: &[&str] =
    &["eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro", "script|load"];

/// Redis work since the last `CONFIG RESETSTAT`, as the plugin caused it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RedisUsage {
    /// µs spent in scripts (`usec` of the script commands). Commands run inside a script are
    /// listed in `commandstats` on their own lines too and their time is inside the script's:
    /// never added.
    pub script_usec: u64,
    /// Script commands sent (calls of [`SCRIPT_COMMANDS`]); the commands they ran are not counted.
    pub top_level_calls: u64,
    /// Commands run inside scripts (every other command, less the bench's own INFO/CONFIG).
    pub inner_calls: u64,
    /// Main-thread CPU seconds (`used_cpu_{user,sys}_main_thread` delta; includes reading and
    /// parsing every command).
    pub cpu_s: f64,
    /// `total_net_input_bytes`.
    pub bytes_in: u64,
    /// `total_net_output_bytes`.
    pub bytes_out: u64,
}

impl RedisUsage {
    /// Parses `INFO stats` and `INFO commandstats` pairs (the CPU left to the caller).
    pub fn parse(stats: &[(String, String)], commandstats: &[(String, String)]) -> RedisUsage {
        let get = |k: &str| {
            stats.iter().find(|(n, _)| n == k).and_then(|(_, v)| v.parse::<u64>().ok()).unwrap_or(0)
        };
        let mut u = RedisUsage {
            bytes_in: get("total_net_input_bytes"),
            bytes_out: get("total_net_output_bytes"),
            ..RedisUsage::default()
        };
        for (k, v) in commandstats {
            let cmd = k.trim_start_matches("cmdstat_");
            let field = |name: &str| {
                v.split(',')
                    .find_map(|f| f.strip_prefix(name))
                    .and_then(|x| x.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            if SCRIPT_COMMANDS.contains(&cmd) {
                u.top_level_calls += field("calls=");
                if cmd != "script|load" {
                    u.script_usec += field("usec=");
                }
            } else if !(cmd == "info" || cmd.starts_with("config|")) {
                u.inner_calls += field("calls=");
            }
        }
        u
    }

    /// Redis's main-thread CPU seconds so far (not reset by `CONFIG RESETSTAT`).
    pub async fn main_thread_cpu_s(addr: &str) -> Result<f64> {
        let cpu = redis_info(addr, "cpu").await?;
        let f = |k: &str| {
            cpu.iter().find(|(n, _)| n == k).and_then(|(_, v)| v.parse::<f64>().ok()).unwrap_or(0.0)
        };
        Ok(f("used_cpu_user_main_thread") + f("used_cpu_sys_main_thread"))
    }

    /// Main-thread CPU seconds per second while nobody sends commands, over `window`.
    pub async fn idle_cpu_per_s(addr: &str, window: Duration) -> Result<f64> {
        let a = Self::main_thread_cpu_s(addr).await?;
        tokio::time::sleep(window).await;
        let b = Self::main_thread_cpu_s(addr).await?;
        Ok((b - a).max(0.0) / window.as_secs_f64().max(1e-3))
    }

    /// Usage since the last `CONFIG RESETSTAT`, CPU since `cpu0` (from [`Self::main_thread_cpu_s`]).
    pub async fn since_reset(addr: &str, cpu0: f64) -> Result<RedisUsage> {
        let stats = redis_info(addr, "stats").await?;
        let cmds = redis_info(addr, "commandstats").await?;
        let cpu = Self::main_thread_cpu_s(addr).await?;
        Ok(RedisUsage { cpu_s: (cpu - cpu0).max(0.0), ..Self::parse(&stats, &cmds) })
    }
}

/// Fetches `http://addr/path` (GET) and returns the body text.
pub async fn http_get(addr: &str, path: &str) -> Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    Ok(text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

/// Value of an unlabelled Prometheus sample `name` in `text`.
pub fn prom_value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Checks that a file exists, with a hint on how to build it.
pub fn require(path: &Path, hint: &str) -> Result<()> {
    if !path.exists() {
        bail!("{} not found: {hint}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prom_value_reads_unlabelled_samples() {
        let t = "# TYPE a counter\na 12\nb{x=\"1\"} 3\npodsim_peak_inflight 7\n";
        assert_eq!(prom_value(t, "a"), Some(12.0));
        assert_eq!(prom_value(t, "podsim_peak_inflight"), Some(7.0));
        assert_eq!(prom_value(t, "b"), None);
    }

    #[test]
    fn redis_usage_counts_scripts_once_and_never_their_inner_commands() {
        let kv = |t: &str| -> Vec<(String, String)> {
            t.lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let stats = kv(
            "total_net_input_bytes:1000\ntotal_net_output_bytes:200\ntotal_commands_processed:99",
        );
        let cmds = kv("cmdstat_evalsha:calls=10,usec=300,usec_per_call=30.00\n\
             cmdstat_script|load:calls=2,usec=50,usec_per_call=25.00\n\
             cmdstat_hincrby:calls=40,usec=80,usec_per_call=2.00\n\
             cmdstat_info:calls=3,usec=900\ncmdstat_config|resetstat:calls=1,usec=5");
        let u = RedisUsage::parse(&stats, &cmds);
        assert_eq!(u.script_usec, 300, "script time only, not the HINCRBYs inside it");
        assert_eq!(u.top_level_calls, 12, "10 scripts + 2 SCRIPT LOAD");
        assert_eq!(u.inner_calls, 40, "the bench's INFO/CONFIG are not the plugin's");
        assert_eq!((u.bytes_in, u.bytes_out), (1000, 200));
    }

    #[tokio::test]
    async fn resp_parses_nested_arrays() {
        let data = b"*2\r\n$1\r\n0\r\n*2\r\n$3\r\nfoo\r\n$-1\r\n".to_vec();
        let mut r = BufReader::new(&data[..]);
        let v = read_resp(&mut r).await.expect("parse");
        assert_eq!(
            v,
            Resp::Array(Some(vec![
                Resp::Bulk(Some(b"0".to_vec())),
                Resp::Array(Some(vec![Resp::Bulk(Some(b"foo".to_vec())), Resp::Bulk(None)]))
            ]))
        );
    }
}
