//! `granary top`: a live terminal view of one or more `/metrics` endpoints (a node's
//! `serve --metrics`, a trainer's `serve_metrics`), scraped once a second over HTTP (hyper).
//! Per rank: throughput with a sparkline of the last minute, stall, epoch; the cache hit ratio,
//! the skew across every rank scraped, the hot shards; per node: replication lag, bandwidth
//! and its peers. `q`, Esc or Ctrl-C quits.
//!
//! Owns: `TopArgs` and `run`: the endpoints (given, or the one the node of `--root` recorded in
//! `replication/metrics-listen`), a runtime of one thread for the scrapes (`GET /metrics`, at most
//! `SCRAPE_BYTES_MAX` bytes within `SCRAPE_TIMEOUT` each), and the terminal with its key loop; what
//! is shown is `view.rs`'s.
//!
//! Never: writes anywhere but the terminal it draws on, or leaves the terminal in raw mode
//! (it is restored on every way out, errors included).

mod view;

#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Empty, Limited};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};

use view::{History, Scrape, View};

/// The most of one scrape read.
const SCRAPE_BYTES_MAX: usize = 16 << 20;
/// How long one endpoint may take to answer.
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(1500);

#[derive(Args)]
pub(crate) struct TopArgs {
    /// The endpoints to watch (HOST:PORT,...): a node's `serve --metrics`, each rank's
    /// `serve_metrics`. Default: the metrics of the node serving --root.
    #[arg(long, value_delimiter = ',', value_name = "ADDRS")]
    connect: Vec<String>,
    /// Seconds between scrapes (0.2 to 60).
    #[arg(long, default_value_t = 1.0, value_parser = parse_interval)]
    interval: f64,
}

fn parse_interval(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(seconds) if (0.2..=60.0).contains(&seconds) => Ok(seconds),
        _ => Err(format!("{text:?} is not a number of seconds from 0.2 to 60")),
    }
}

pub(crate) fn run(root: Option<&Path>, args: &TopArgs) -> Result<()> {
    let targets = targets(root, &args.connect)?;
    if !std::io::stdout().is_terminal() {
        bail!(
            "granary top draws on a terminal and stdout is not one; the metrics as text: curl http://{}/metrics",
            targets[0]
        );
    }
    let interval = Duration::from_secs_f64(args.interval);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting a runtime")?;
    let title = targets.iter().map(SocketAddr::to_string).collect::<Vec<_>>().join(", ");
    // Raw mode is set before the alternate screen: a failure between the two is restored too.
    let outcome = match ratatui::try_init() {
        Ok(mut terminal) => watch(&runtime, &mut terminal, &targets, &title, interval),
        Err(e) => Err(anyhow::Error::new(e).context("setting up the terminal")),
    };
    let restored = ratatui::try_restore().context("restoring the terminal");
    outcome.and(restored)
}

/// The endpoints: those given, or the one the node of `root` recorded when it started.
fn targets(root: Option<&Path>, connect: &[String]) -> Result<Vec<SocketAddr>> {
    if !connect.is_empty() {
        return connect
            .iter()
            .map(|text| {
                text.to_socket_addrs()
                    .with_context(|| format!("address {text:?}"))?
                    .next()
                    .with_context(|| format!("address {text:?} resolves to nothing"))
            })
            .collect();
    }
    let root = root.context("nothing to watch: pass --connect HOST:PORT, or --root of a node run with --metrics")?;
    let path = root.join("replication").join("metrics-listen");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "{}: no metrics endpoint recorded (start the node with `serve --metrics ADDR`, or pass --connect)",
            path.display()
        )
    })?;
    let addr = text.trim().parse().with_context(|| format!("{}: not an address", path.display()))?;
    Ok(vec![addr])
}

fn watch(
    runtime: &tokio::runtime::Runtime,
    terminal: &mut ratatui::DefaultTerminal,
    targets: &[SocketAddr],
    title: &str,
    interval: Duration,
) -> Result<()> {
    let started = Instant::now();
    let mut history = History::default();
    let mut next_scrape = Instant::now();
    let mut view = View::of(&history);
    loop {
        if Instant::now() >= next_scrape {
            // Behind (endpoints slow to answer), the next scrape is an interval from now.
            next_scrape = (next_scrape + interval).max(Instant::now());
            let at = started.elapsed().as_secs_f64();
            history.push(runtime.block_on(scrape_all(targets, at)));
            view = View::of(&history);
        }
        terminal.draw(|frame| view::draw(frame, &view, title, started.elapsed())).context("drawing")?;
        let wait = next_scrape.saturating_duration_since(Instant::now()).min(Duration::from_millis(250));
        if event::poll(wait).context("reading the terminal")?
            && let Event::Key(key) = event::read().context("reading the terminal")?
            && key.kind == KeyEventKind::Press
        {
            let ctrl_c = key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
            if matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                return Ok(());
            }
        }
    }
}

/// Scrapes every endpoint at once (a slow one delays the screen by `SCRAPE_TIMEOUT` at most).
async fn scrape_all(targets: &[SocketAddr], at: f64) -> Scrape {
    let mut scrape = Scrape { at, ..Scrape::default() };
    let mut fetches = tokio::task::JoinSet::new();
    for (i, &addr) in targets.iter().enumerate() {
        fetches.spawn(async move { (i, addr, tokio::time::timeout(SCRAPE_TIMEOUT, fetch(addr)).await) });
    }
    let mut answers = Vec::with_capacity(targets.len());
    while let Some(answer) = fetches.join_next().await {
        if let Ok(answer) = answer {
            answers.push(answer);
        }
    }
    // In the order given, whatever order they answered in.
    answers.sort_by_key(|(i, _, _)| *i);
    for (_, addr, answer) in answers {
        match answer {
            Ok(Ok(text)) => match view::parse(&text) {
                Ok(samples) => scrape.samples.extend(samples),
                Err(why) => scrape.errors.push(format!("{addr}: {why}")),
            },
            Ok(Err(why)) => scrape.errors.push(format!("{addr}: {why:#}")),
            Err(_) => scrape.errors.push(format!("{addr}: no answer in {} ms", SCRAPE_TIMEOUT.as_millis())),
        }
    }
    scrape
}

/// `GET /metrics` from `addr`, in the Prometheus text format.
async fn fetch(addr: SocketAddr) -> Result<String> {
    let stream = tokio::net::TcpStream::connect(addr).await.context("connecting")?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.context("HTTP")?;
    let connection = tokio::spawn(connection);
    let request = hyper::Request::get("/metrics")
        .header(hyper::header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .context("building the request")?;
    let response = sender.send_request(request).await.context("HTTP")?;
    if !response.status().is_success() {
        bail!("HTTP {}", response.status());
    }
    let body = Limited::new(response.into_body(), SCRAPE_BYTES_MAX)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
        .to_bytes();
    connection.abort();
    String::from_utf8(body.to_vec()).context("the answer is not UTF-8")
}
