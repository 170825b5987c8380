//! A session's saved state: where it stands, everything that decides its order, and a digest
//! over both. `Session::save` makes one and `Session::resume` takes one back; a state whose
//! fields are not those its digest was made over (edited after the save) is refused, and so is
//! one saved under another order, each difference named with both values.
//!
//! Owns `SavedState`, `SavedMixture`, `OrderPairs`, the digest and the comparison of a saved
//! state with a session's. Never: knows a state's written form (a binding writes and reads it:
//! Python a dict), or moves a session (`Session::resume` does, once the checks here pass).

use crate::error::{Error, Result};
use crate::plan::Position;

#[cfg(feature = "policy")]
use super::RebalanceState;

/// What decides a session's order besides its seed, as `(key, value)` pairs: `order` alone (a
/// native order), `partitioner` and its `option:NAME` pairs, `mixture` (a blend by weights), or
/// the `pack.*` settings of packed windows. Compared as sets: the pairs' order is not the plan's.
pub type OrderPairs = Vec<(String, String)>;

/// A session's state as saved (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct SavedState {
    /// After the last batch handed out.
    pub position: Position,
    /// The seed of every order in it.
    pub seed: u64,
    /// The order (see `OrderPairs`).
    pub order: OrderPairs,
    /// The manifest id of the version read (a mixture's: of its sources read as one).
    pub manifest: String,
    /// The mixture read, `None` for one version.
    pub mixture: Option<SavedMixture>,
    /// The rebalancing's weights and pending measures, `None` without rebalancing.
    #[cfg(feature = "policy")]
    pub rebalance: Option<RebalanceState>,
    /// `digest()` when saved; `None` in a state saved before states had one (it is still
    /// resumed, checked field by field).
    pub digest: Option<String>,
}

/// A mixture as a state saves it.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedMixture {
    /// The mixture's id (`Mixture::id`: its versions, weights, changes and epoch length).
    pub id: String,
    /// Each source's manifest id and weight, in order.
    pub sources: Vec<(String, f64)>,
    /// Samples an epoch.
    pub epoch_samples: u64,
    /// Its changes of weights (`Blend::changes`, the first weights at the epoch's start).
    pub changes: Vec<(Position, Vec<f64>)>,
}

impl SavedState {
    /// BLAKE3 over every field but the digest, in a fixed text form: 32 hex digits.
    pub fn digest(&self) -> String {
        let mut text = format!(
            "granary state 1\nposition {} {}\nseed {}\nmanifest {}\n",
            self.position.epoch, self.position.cursor, self.seed, self.manifest
        );
        for (key, value) in sorted(&self.order) {
            text.push_str(&format!("order {key:?}={value:?}\n"));
        }
        if let Some(mixture) = &self.mixture {
            text.push_str(&format!("mixture {} {}\n", mixture.id, mixture.epoch_samples));
            for (manifest, weight) in &mixture.sources {
                text.push_str(&format!("source {manifest} {:016x}\n", weight.to_bits()));
            }
            for (at, weights) in &mixture.changes {
                let bits: Vec<String> = weights.iter().map(|w| format!("{:016x}", w.to_bits())).collect();
                text.push_str(&format!("change {} {} {}\n", at.epoch, at.cursor, bits.join(" ")));
            }
        }
        #[cfg(feature = "policy")]
        if let Some(rebalance) = &self.rebalance {
            let w = &rebalance.weights;
            text.push_str(&format!("weights {} {} {:?}\n", w.epoch, w.step, w.weights));
            if let Some((step, measured)) = &rebalance.pending {
                let measured: Vec<(u32, u64, u64)> =
                    measured.iter().map(|m| (m.rank, m.records, m.busy_nanos)).collect();
                text.push_str(&format!("pending {step} {measured:?}\n"));
            }
        }
        blake3::hash(text.as_bytes()).to_hex()[..32].to_owned()
    }

    /// Refuses a state that carries a digest other than its fields': it was changed after it
    /// was saved (a cursor, an epoch, a weight, a change of weights rewritten).
    pub fn check_digest(&self) -> Result<()> {
        match &self.digest {
            Some(saved) if *saved != self.digest() => Err(Error::invalid_input(format!(
                "the state's digest {saved} is not that of what it says ({}): the state was altered after it was \
                 saved; not resumed",
                self.digest()
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses resuming `self` (saved) in a session whose own state is `now`: another seed,
    /// order, version or mixture would read other samples at the same position. Names the
    /// first difference, both values and what to do.
    pub(super) fn check_same_order(&self, now: &SavedState) -> Result<()> {
        let refuse = |what: String| Err(Error::invalid_input(format!("the state was saved {what}")));
        if self.seed != now.seed {
            return refuse(format!("with seed {}, this loader has seed {}", self.seed, now.seed));
        }
        if sorted(&self.order) != sorted(&now.order) {
            let saved_window = option(&self.order, "window-shards");
            let hint = match saved_window {
                // The window follows the store's cache bound: the same order needs the same one.
                Some(window) if Some(window) != option(&now.order, "window-shards") => format!(
                    ": the window follows the cache's bound; attach with the cache_bytes the saving run had, or make \
                     this loader with partitioner_options={{'window-shards': {window}}}"
                ),
                _ => String::new(),
            };
            return refuse(format!("with plan {}, this loader has {}{hint}", shown(&self.order), shown(&now.order)));
        }
        match (&self.mixture, &now.mixture) {
            (Some(_), None) => return refuse("reading a mixture, this loader reads one dataset".to_owned()),
            (None, Some(_)) => return refuse("reading one dataset, this loader reads a mixture".to_owned()),
            (Some(saved), Some(mine)) => {
                // Weights as given (a float each): equal to a part in 10^9.
                let same_weight = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
                let same = saved.epoch_samples == mine.epoch_samples
                    && saved.sources.len() == mine.sources.len()
                    && saved.sources.iter().zip(&mine.sources).all(|((m, w), (n, v))| m == n && same_weight(*w, *v));
                if !same {
                    return refuse(format!(
                        "reading the mixture {:?} of {} samples an epoch, this loader reads {:?} of {}; make it with \
                         the same versions (their manifest ids), weights and epoch length to resume",
                        saved.sources, saved.epoch_samples, mine.sources, mine.epoch_samples
                    ));
                }
            }
            (None, None) => {}
        }
        if self.manifest != now.manifest {
            return refuse(format!(
                "reading dataset version {}, this loader reads {}; open the same version (pass the manifest id as \
                 the dataset) to resume",
                self.manifest, now.manifest
            ));
        }
        Ok(())
    }
}

/// `pairs` in one order (by key, then value).
fn sorted(pairs: &[(String, String)]) -> Vec<(&str, &str)> {
    let mut out: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    out.sort_unstable();
    out
}

/// The partitioner option `name` among `pairs`.
fn option<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs.iter().find(|(key, _)| key.strip_prefix("option:") == Some(name)).map(|(_, value)| value.as_str())
}

/// `pairs` as `key=value, ...`, sorted.
fn shown(pairs: &[(String, String)]) -> String {
    sorted(pairs).iter().map(|(key, value)| format!("{key}={value}")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> SavedState {
        SavedState {
            position: Position { epoch: 2, cursor: 96 },
            seed: 7,
            order: vec![("partitioner".into(), "default".into()), ("option:window-shards".into(), "4".into())],
            manifest: "ab".repeat(32),
            mixture: Some(SavedMixture {
                id: "cd".repeat(32),
                sources: vec![("01".repeat(32), 0.7), ("02".repeat(32), 0.3)],
                epoch_samples: 240,
                changes: vec![
                    (Position::default(), vec![0.7, 0.3]),
                    (Position { epoch: 1, cursor: 8 }, vec![0.5, 0.5]),
                ],
            }),
            #[cfg(feature = "policy")]
            rebalance: None,
            digest: None,
        }
    }

    type Edit = Box<dyn Fn(&mut SavedState)>;

    #[test]
    fn every_field_is_in_the_digest_and_an_edited_one_is_refused() {
        let mut saved = state();
        saved.digest = Some(saved.digest());
        saved.check_digest().expect("as saved");
        // The pairs' order is not the plan's: the digest does not see it.
        let mut reordered = saved.clone();
        reordered.order.reverse();
        reordered.check_digest().expect("the same order");
        let edits: Vec<(&str, Edit)> = vec![
            ("epoch", Box::new(|s| s.position.epoch = 3)),
            ("cursor", Box::new(|s| s.position.cursor = 10u64.pow(12))),
            ("seed", Box::new(|s| s.seed = 8)),
            ("window", Box::new(|s| s.order[1].1 = "8".into())),
            ("manifest", Box::new(|s| s.manifest = "00".repeat(32))),
            ("weight", Box::new(|s| s.mixture.as_mut().expect("a mixture").sources[0].1 = 0.6)),
            ("change", Box::new(|s| s.mixture.as_mut().expect("a mixture").changes[1].1 = vec![0.0, 1.0])),
            ("id", Box::new(|s| s.mixture.as_mut().expect("a mixture").id = "0".repeat(64))),
            ("mixture", Box::new(|s| s.mixture = None)),
        ];
        for (what, edit) in edits {
            let mut edited = saved.clone();
            edit(&mut edited);
            let refused = edited.check_digest().expect_err(what).to_string();
            assert!(refused.contains("altered after it was saved"), "{what}: {refused}");
        }
        // A state saved before digests is checked field by field only.
        let mut old = saved.clone();
        old.digest = None;
        old.position.cursor = 100;
        old.check_digest().expect("no digest to check");
    }

    #[test]
    fn another_order_is_named_with_both_values() {
        let saved = state();
        let refused = |now: &SavedState| saved.check_same_order(now).expect_err("refused").to_string();
        let mut now = state();
        now.seed = 9;
        assert!(refused(&now).contains("with seed 7, this loader has seed 9"));
        let mut now = state();
        now.order[1].1 = "2".into();
        let said = refused(&now);
        assert!(
            said.contains("option:window-shards=4") && said.contains("partitioner_options={'window-shards': 4}"),
            "{said}"
        );
        let mut now = state();
        now.mixture.as_mut().expect("a mixture").sources[1].1 = 0.2;
        assert!(refused(&now).contains("reading the mixture"));
        let mut now = state();
        now.mixture = None;
        assert!(refused(&now).contains("reading a mixture, this loader reads one dataset"));
        let mut now = state();
        now.manifest = "ef".repeat(32);
        assert!(refused(&now).contains("open the same version"));
        // The position, the changes and the rebalancing are the state's to carry, not compared.
        let mut now = state();
        now.position = Position::default();
        now.mixture.as_mut().expect("a mixture").changes.pop();
        saved.check_same_order(&now).expect("the same order");
    }
}
