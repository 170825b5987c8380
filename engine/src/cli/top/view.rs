//! What `granary top` shows: scrapes parsed into samples, a window of them kept per second,
//! the figures derived from it (rates between scrapes, the skew across every rank scraped),
//! and the screen drawn from those figures.
//!
//! Owns: `Sample` and `parse` (the Prometheus text format), `Scrape`, `History` (the last `WINDOW`
//! scrapes), `View` with `RankView`, `NodeView` and `PeerView`, and `draw`. Never: does I/O
//! (`mod.rs` scrapes and owns the terminal): the tests draw a fixed window on ratatui's test
//! backend.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Sparkline};

/// Scrapes kept: a minute at one a second.
pub(super) const WINDOW: usize = 61;
/// Hot shards listed.
const HOT_SHOWN: usize = 8;

/// One sample of a scrape.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Sample {
    pub(super) name: String,
    pub(super) labels: Vec<(String, String)>,
    pub(super) value: f64,
}

impl Sample {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Parses an exposition in the Prometheus text format (what an endpoint serves a scraper that
/// does not ask for OpenMetrics): comments skipped, a line that does not parse is an error.
pub(super) fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(
            parse_line(line).ok_or_else(|| format!("line {} of the exposition does not parse: {line:.80}", n + 1))?,
        );
    }
    Ok(out)
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        loop {
            while chars.peek().is_some_and(|(_, c)| *c == ',' || c.is_whitespace()) {
                chars.next();
            }
            let (start, c) = *chars.peek()?;
            if c == '}' {
                rest = &inner[start + 1..];
                break;
            }
            let eq = inner[start..].find('=')? + start;
            let key = inner[start..eq].trim().to_owned();
            while chars.peek().is_some_and(|(i, _)| *i <= eq) {
                chars.next();
            }
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                match chars.next()?.1 {
                    '"' => break,
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    other => value.push(other),
                }
            }
            labels.push((key, value));
        }
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().ok()?,
    };
    Some(Sample { name, labels, value })
}

/// The scrapes of one moment, from every endpoint.
#[derive(Clone, Debug, Default)]
pub(super) struct Scrape {
    /// Seconds since `top` started.
    pub(super) at: f64,
    pub(super) samples: Vec<Sample>,
    /// Endpoints that did not answer, and why.
    pub(super) errors: Vec<String>,
}

impl Scrape {
    fn sum(&self, name: &str, filter: impl Fn(&Sample) -> bool) -> Option<f64> {
        let mut found = None;
        for sample in self.samples.iter().filter(|s| s.name == name && filter(s)) {
            *found.get_or_insert(0.0) += sample.value;
        }
        found
    }

    fn of_rank(&self, name: &str, rank: &str) -> Option<f64> {
        self.sum(name, |s| s.label("rank") == Some(rank))
    }

    fn of_node(&self, name: &str, node: &str) -> Option<f64> {
        self.sum(name, |s| s.label("node") == Some(node) && s.label("peer").is_none())
    }

    fn label_values(&self, name: &str, key: &str) -> Vec<String> {
        let mut values: Vec<String> =
            self.samples.iter().filter(|s| s.name == name).filter_map(|s| s.label(key).map(str::to_owned)).collect();
        values.sort_by_key(|v| (v.parse::<u64>().unwrap_or(u64::MAX), v.clone()));
        values.dedup();
        values
    }
}

/// The last minute of scrapes.
#[derive(Default)]
pub(super) struct History {
    scrapes: VecDeque<Scrape>,
}

impl History {
    pub(super) fn push(&mut self, scrape: Scrape) {
        if self.scrapes.len() == WINDOW {
            self.scrapes.pop_front();
        }
        self.scrapes.push_back(scrape);
    }

    /// The rate of `value` between consecutive scrapes, oldest first.
    fn rates(&self, value: impl Fn(&Scrape) -> Option<f64>) -> Vec<f64> {
        let scrapes: Vec<&Scrape> = self.scrapes.iter().collect();
        scrapes
            .windows(2)
            .map(|pair| match (value(pair[0]), value(pair[1])) {
                (Some(a), Some(b)) if pair[1].at > pair[0].at => ((b - a) / (pair[1].at - pair[0].at)).max(0.0),
                _ => 0.0,
            })
            .collect()
    }
}

/// One rank's line.
#[derive(Debug, PartialEq)]
pub(super) struct RankView {
    pub(super) rank: String,
    /// Bytes a second handed to the trainer, per second of the window.
    pub(super) throughput: Vec<f64>,
    pub(super) stall: f64,
    pub(super) epoch: Option<f64>,
    pub(super) epoch_records: Option<f64>,
    pub(super) queued: Option<f64>,
}

/// One node's replication.
#[derive(Debug, PartialEq)]
pub(super) struct NodeView {
    pub(super) node: String,
    pub(super) under_replicated: f64,
    pub(super) oldest: f64,
    pub(super) sent: f64,
    pub(super) received: f64,
    pub(super) peers: Vec<PeerView>,
}

/// One peer of a node.
#[derive(Debug, PartialEq)]
pub(super) struct PeerView {
    pub(super) peer: String,
    pub(super) up: bool,
    /// Seconds since its last heartbeat answer.
    pub(super) answered: Option<f64>,
    /// Bytes a second sent to it and received from it.
    pub(super) sent: f64,
    pub(super) received: f64,
}

/// Everything on the screen.
#[derive(Debug, PartialEq)]
pub(super) struct View {
    pub(super) ranks: Vec<RankView>,
    pub(super) cache_hit: Option<f64>,
    pub(super) skew: Option<f64>,
    pub(super) verify_failures: f64,
    pub(super) repaired: f64,
    pub(super) hot: Vec<(String, f64)>,
    pub(super) nodes: Vec<NodeView>,
    pub(super) errors: Vec<String>,
}

impl View {
    pub(super) fn of(history: &History) -> View {
        let Some(last) = history.scrapes.back() else {
            return View {
                ranks: Vec::new(),
                cache_hit: None,
                skew: None,
                verify_failures: 0.0,
                repaired: 0.0,
                hot: Vec::new(),
                nodes: Vec::new(),
                errors: Vec::new(),
            };
        };
        let last_rate = |rates: Vec<f64>| rates.last().copied().unwrap_or(0.0);
        let ranks: Vec<RankView> = last
            .label_values("granary_loader_delivered_bytes_total", "rank")
            .into_iter()
            .map(|rank| RankView {
                throughput: history.rates(|s| s.of_rank("granary_loader_delivered_bytes_total", &rank)),
                stall: last_rate(history.rates(|s| s.of_rank("granary_loader_stall_seconds_total", &rank))).min(1.0),
                epoch: last.of_rank("granary_loader_epoch", &rank),
                epoch_records: last.of_rank("granary_loader_epoch_records", &rank),
                queued: last.of_rank("granary_loader_queued_batches", &rank),
                rank,
            })
            .collect();
        let hits: Vec<f64> =
            last.samples.iter().filter(|s| s.name == "granary_loader_cache_hit_ratio").map(|s| s.value).collect();
        let cache_hit = (!hits.is_empty()).then(|| hits.iter().sum::<f64>() / hits.len() as f64);
        // The skew over every rank scraped (all of a node's, when `top` is given each rank's
        // endpoint), from their reads this epoch.
        // Ranks are compared within an epoch, when all of a dataset's are in the same one (see
        // the engine's `granary_skew_*`). The screen shows the largest skew of any dataset.
        let epochs: BTreeMap<&[(String, String)], f64> = last
            .samples
            .iter()
            .filter(|s| s.name == "granary_loader_epoch")
            .map(|s| (s.labels.as_slice(), s.value))
            .collect();
        let mut groups: BTreeMap<String, (Option<f64>, bool, Vec<f64>)> = BTreeMap::new();
        for sample in last.samples.iter().filter(|s| s.name == "granary_loader_epoch_records") {
            let epoch = epochs.get(sample.labels.as_slice()).copied().unwrap_or(0.0);
            let group =
                groups.entry(sample.label("dataset").unwrap_or("").to_owned()).or_insert((None, true, Vec::new()));
            if group.0.is_some_and(|e| e != epoch) {
                group.1 = false;
            }
            group.0 = Some(epoch);
            group.2.push(sample.value);
        }
        let skew = groups
            .values()
            .filter(|(_, same_epoch, _)| *same_epoch)
            .filter_map(|(_, _, reads)| {
                let mean = reads.iter().sum::<f64>() / reads.len().max(1) as f64;
                (mean > 0.0).then(|| reads.iter().copied().fold(0.0, f64::max) / mean)
            })
            .reduce(f64::max);
        let mut hot: BTreeMap<String, f64> = BTreeMap::new();
        for sample in last.samples.iter().filter(|s| s.name == "granary_shard_reads") {
            *hot.entry(sample.label("shard").unwrap_or("?").to_owned()).or_default() += sample.value;
        }
        let mut hot: Vec<(String, f64)> = hot.into_iter().collect();
        hot.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        hot.truncate(HOT_SHOWN);
        let nodes = last
            .label_values("granary_node_uptime_seconds", "node")
            .into_iter()
            .map(|node| {
                let peers = last
                    .samples
                    .iter()
                    .filter(|s| s.name == "granary_peer_up" && s.label("node") == Some(node.as_str()))
                    .map(|s| {
                        let peer = s.label("peer").unwrap_or("?").to_owned();
                        let of = |a: &Sample| {
                            a.label("node") == Some(node.as_str()) && a.label("peer") == Some(peer.as_str())
                        };
                        PeerView {
                            up: s.value > 0.0,
                            answered: last.sum("granary_peer_heartbeat_age_seconds", of),
                            sent: last_rate(history.rates(|h| h.sum("granary_peer_sent_bytes_total", of))),
                            received: last_rate(history.rates(|h| h.sum("granary_peer_received_bytes_total", of))),
                            peer,
                        }
                    })
                    .collect();
                NodeView {
                    under_replicated: last.of_node("granary_node_under_replicated_shards", &node).unwrap_or(0.0),
                    oldest: last.of_node("granary_node_under_replicated_oldest_age_seconds", &node).unwrap_or(0.0),
                    sent: last_rate(history.rates(|s| s.of_node("granary_node_sent_bytes_total", &node))),
                    received: last_rate(history.rates(|s| s.of_node("granary_node_received_bytes_total", &node))),
                    peers,
                    node,
                }
            })
            .collect();
        View {
            ranks,
            cache_hit,
            skew,
            verify_failures: last.sum("granary_read_verify_failures_total", |_| true).unwrap_or(0.0),
            repaired: last.sum("granary_read_shards_repaired_total", |_| true).unwrap_or(0.0),
            hot,
            nodes,
            errors: last.errors.clone(),
        }
    }
}

/// Bytes a second, for people.
fn rate(bytes: f64) -> String {
    if bytes >= 1e9 {
        format!("{:.2} GB/s", bytes / 1e9)
    } else if bytes >= 1e6 {
        format!("{:.1} MB/s", bytes / 1e6)
    } else {
        format!("{:.0} kB/s", bytes / 1e3)
    }
}

fn optional(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
}

/// Draws `view` on the whole frame.
pub(super) fn draw(frame: &mut Frame<'_>, view: &View, title: &str, clock: Duration) {
    let area = frame.area();
    let [head, ranks, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(u16::try_from(view.ranks.len().max(1)).unwrap_or(u16::MAX).saturating_add(3)),
        Constraint::Min(4),
    ])
    .areas(area);
    let seconds = clock.as_secs();
    let mut header = vec![
        Span::styled(format!(" granary top · {title}"), Style::new().add_modifier(Modifier::BOLD)),
        Span::raw(format!(" · {:02}:{:02}:{:02} · q quits", seconds / 3600, seconds / 60 % 60, seconds % 60)),
    ];
    if let Some(error) = view.errors.first() {
        header.push(Span::styled(format!(" · {error}"), Style::new().fg(Color::Red)));
    }
    frame.render_widget(Paragraph::new(Line::from(header)), head);
    draw_ranks(frame, view, ranks);
    let [data, replication] =
        Layout::horizontal([Constraint::Percentage(42), Constraint::Percentage(58)]).areas(bottom);
    draw_data(frame, view, data);
    draw_replication(frame, view, replication);
}

fn draw_ranks(frame: &mut Frame<'_>, view: &View, area: Rect) {
    let block = Block::default().borders(Borders::ALL).title(" ranks ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let text_width = 52;
    let rows = Layout::vertical(std::iter::repeat_n(Constraint::Length(1), view.ranks.len() + 1)).split(inner);
    let heading = format!(
        "{:<5} {:>10} {:>6} {:>6} {:>10} {:>6}  throughput, a bar per scrape",
        "rank", "now", "stall", "epoch", "records", "queue"
    );
    frame.render_widget(Paragraph::new(heading).style(Style::new().add_modifier(Modifier::BOLD)), rows[0]);
    if view.ranks.is_empty() {
        return;
    }
    // One scale for every rank's sparkline, so their heights compare.
    let top = view.ranks.iter().flat_map(|r| r.throughput.iter()).fold(0.0, |a: f64, b| a.max(*b / 1e3)) as u64;
    for (rank, row) in view.ranks.iter().zip(rows.iter().skip(1)) {
        let [text, spark] = Layout::horizontal([Constraint::Length(text_width), Constraint::Min(1)]).areas(*row);
        let now = rank.throughput.last().copied().unwrap_or(0.0);
        let line = format!(
            "{:<5} {:>10} {:>5.1}% {:>6} {:>10} {:>6}",
            rank.rank,
            rate(now),
            rank.stall * 100.0,
            optional(rank.epoch),
            optional(rank.epoch_records),
            optional(rank.queued)
        );
        let stall_style = if rank.stall > 0.2 { Style::new().fg(Color::Red) } else { Style::new() };
        frame.render_widget(Paragraph::new(line).style(stall_style), text);
        // Whole kilobytes a second: the sparkline draws integers.
        let data: Vec<u64> = rank.throughput.iter().map(|b| (b / 1e3) as u64).collect();
        let shown = &data[data.len().saturating_sub(spark.width as usize)..];
        frame.render_widget(
            Sparkline::default().data(shown).max(top.max(1)).style(Style::new().fg(Color::Green)),
            spark,
        );
    }
}

fn draw_data(frame: &mut Frame<'_>, view: &View, area: Rect) {
    let mut lines = vec![
        Line::from(format!(
            "cache hit     {}",
            view.cache_hit.map_or_else(|| "-".to_owned(), |h| format!("{:.1}%", h * 100.0))
        )),
        Line::from(format!(
            "skew          {}",
            view.skew.map_or_else(|| "-".to_owned(), |s| format!("{s:.2} x (max/mean)"))
        )),
        Line::from(format!("verify fails  {:.0}   repaired {:.0}", view.verify_failures, view.repaired)),
        Line::from(Span::styled("hot shards (records read)", Style::new().add_modifier(Modifier::BOLD))),
    ];
    if view.hot.is_empty() {
        lines.push(Line::from("  -"));
    }
    for (shard, reads) in &view.hot {
        lines.push(Line::from(format!("  {shard}  {reads:>10.0}")));
    }
    frame.render_widget(Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" data ")), area);
}

fn draw_replication(frame: &mut Frame<'_>, view: &View, area: Rect) {
    let mut lines = Vec::new();
    if view.nodes.is_empty() {
        lines.push(Line::from("no node scraped"));
    }
    for node in &view.nodes {
        lines.push(Line::from(Span::styled(format!("node {}", node.node), Style::new().add_modifier(Modifier::BOLD))));
        lines
            .push(Line::from(format!("  under-replicated {:.0} (oldest {:.1} s)", node.under_replicated, node.oldest)));
        lines.push(Line::from(format!("  sent {}   received {}", rate(node.sent), rate(node.received))));
        for peer in &node.peers {
            let state = if peer.up {
                Span::styled("up  ", Style::new().fg(Color::Green))
            } else {
                Span::styled("DOWN", Style::new().fg(Color::Red))
            };
            // Since its last heartbeat answer.
            let age = peer.answered.map_or_else(|| "-".to_owned(), |a| format!("{a:.1} s"));
            lines.push(Line::from(vec![
                Span::raw(format!("  peer {:<10} ", peer.peer)),
                state,
                Span::raw(format!(" {age:>6}  out {} in {}", rate(peer.sent), rate(peer.received))),
            ]));
        }
    }
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" replication ")),
        area,
    );
}
