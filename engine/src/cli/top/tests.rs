//! `granary top`'s parsing, derived figures and screen, on fixed scrapes.

use std::time::Duration;

use ratatui::Terminal;
use ratatui::backend::TestBackend;

use super::view::{self, History, Scrape, View};

/// Two ranks and a node, as two scrapes a second apart would show them.
fn scrape(at: f64, delivered: [u64; 2], stall: [f64; 2], sent: u64) -> Scrape {
    let text = format!(
        "# HELP granary_loader_delivered_bytes_total Record bytes handed to the trainer.\n\
         # TYPE granary_loader_delivered_bytes_total counter\n\
         granary_loader_delivered_bytes_total{{rank=\"0\"}} {}\n\
         granary_loader_delivered_bytes_total{{rank=\"1\"}} {}\n\
         granary_loader_stall_seconds_total{{rank=\"0\"}} {}\n\
         granary_loader_stall_seconds_total{{rank=\"1\"}} {}\n\
         granary_loader_epoch{{rank=\"0\"}} 3.0\n\
         granary_loader_epoch{{rank=\"1\"}} 3.0\n\
         granary_loader_epoch_records{{rank=\"0\"}} 1200.0\n\
         granary_loader_epoch_records{{rank=\"1\"}} 800.0\n\
         granary_loader_queued_batches{{rank=\"0\"}} 4.0\n\
         granary_loader_queued_batches{{rank=\"1\"}} 0.0\n\
         granary_loader_cache_hit_ratio{{rank=\"0\"}} 0.9\n\
         granary_loader_cache_hit_ratio{{rank=\"1\"}} 0.8\n\
         granary_read_verify_failures_total{{rank=\"1\"}} 1\n\
         granary_read_shards_repaired_total{{rank=\"1\"}} 1\n\
         granary_shard_reads{{dataset=\"tokens@1\",shard=\"a1b2c3d4e5f6\"}} 900.0\n\
         granary_shard_reads{{dataset=\"tokens@1\",shard=\"0f0f0f0f0f0f\"}} 1500.0\n\
         granary_node_uptime_seconds{{node=\"7\"}} 12.5\n\
         granary_node_under_replicated_shards{{node=\"7\"}} 2.0\n\
         granary_node_under_replicated_oldest_age_seconds{{node=\"7\"}} 4.2\n\
         granary_node_sent_bytes_total{{node=\"7\"}} {sent}\n\
         granary_node_received_bytes_total{{node=\"7\"}} 0\n\
         granary_peer_up{{node=\"7\",peer=\"8\"}} 1.0\n\
         granary_peer_heartbeat_age_seconds{{node=\"7\",peer=\"8\"}} 0.1\n\
         granary_peer_sent_bytes_total{{node=\"7\",peer=\"8\"}} {sent}\n\
         granary_peer_up{{node=\"7\",peer=\"127.0.0.1:9\"}} 0.0\n",
        delivered[0], delivered[1], stall[0], stall[1]
    );
    Scrape { at, samples: view::parse(&text).expect("the fixture parses"), errors: Vec::new() }
}

fn history() -> History {
    let mut history = History::default();
    history.push(scrape(10.0, [1_000_000_000, 500_000_000], [1.0, 2.0], 0));
    history.push(scrape(11.0, [2_500_000_000, 600_000_000], [1.05, 2.5], 30_000_000));
    history
}

#[test]
fn the_view_holds_rates_between_scrapes_and_the_skew_of_the_ranks() {
    let view = View::of(&history());
    assert_eq!(view.ranks.len(), 2);
    assert_eq!(view.ranks[0].throughput, vec![1.5e9]);
    assert_eq!(view.ranks[1].throughput, vec![1.0e8]);
    assert!((view.ranks[0].stall - 0.05).abs() < 1e-9);
    assert!((view.ranks[1].stall - 0.5).abs() < 1e-9);
    assert_eq!(view.skew, Some(1.2));
    assert!((view.cache_hit.unwrap() - 0.85).abs() < 1e-9);
    assert_eq!(view.hot[0], ("0f0f0f0f0f0f".to_owned(), 1500.0));
    assert_eq!(view.nodes[0].sent, 3.0e7);
    let peers = &view.nodes[0].peers;
    assert_eq!((peers[0].peer.as_str(), peers[0].up, peers[0].answered, peers[0].sent), ("8", true, Some(0.1), 3.0e7));
    assert_eq!(
        (peers[1].peer.as_str(), peers[1].up, peers[1].answered, peers[1].sent),
        ("127.0.0.1:9", false, None, 0.0)
    );
}

#[test]
fn labels_with_escapes_and_special_values_parse_and_garbage_does_not() {
    let samples = view::parse("a{x=\"q\\\"u,o}te\",y=\"\\\\\"} +Inf\nb 1e3 1700000000\n").unwrap();
    assert_eq!(samples[0].labels, vec![("x".to_owned(), "q\"u,o}te".to_owned()), ("y".to_owned(), "\\".to_owned())]);
    assert_eq!(samples[0].value, f64::INFINITY);
    assert_eq!(samples[1].value, 1000.0);
    assert!(view::parse("a{x=\"unterminated} 1\n").is_err());
    assert!(view::parse("a{x=\"1\"}\n").is_err());
    assert!(view::parse("a one\n").is_err());
}

/// The screen for the fixture, as `screen.txt` beside this file holds it (`GRANARY_BLESS=1`
/// writes it).
#[test]
fn the_screen_matches_the_expected_one() {
    let mut terminal = Terminal::new(TestBackend::new(100, 22)).unwrap();
    let view = View::of(&history());
    terminal.draw(|frame| view::draw(frame, &view, "127.0.0.1:9464", Duration::from_secs(3723))).unwrap();
    let buffer = terminal.backend().buffer();
    let mut screen = String::new();
    for y in 0..buffer.area.height {
        let line: String = (0..buffer.area.width).map(|x| buffer[(x, y)].symbol()).collect();
        screen.push_str(line.trim_end());
        screen.push('\n');
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cli/top/screen.txt");
    if std::env::var_os("GRANARY_BLESS").is_some() {
        std::fs::write(&path, &screen).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    assert_eq!(screen, expected, "the screen changed; if on purpose, run with GRANARY_BLESS=1");
}
