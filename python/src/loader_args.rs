//! A Python loader's arguments turned into the engine's settings: the device, the plan, the
//! tier and the I/O backend, each refused here, naming the argument, when it is wrong.
//!
//! Owns `target_of`, `plan_of`, `tier_of` and `backend_of`. Never: opens a dataset, a tier or a
//! device (the loader does, at its first batch).

use granary::{Order, PlanSource, Target, TierConfig, TierKind, TierSetting};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::{invalid, to_py};

/// `device` (`None`, `"cpu"`, `"cuda"`, `"cuda:N"`) as the engine's target and CUDA ordinal.
pub(crate) fn target_of(device: Option<&str>) -> PyResult<(Target, Option<u32>)> {
    Ok(match device {
        None => (Target::Auto, None),
        Some("cpu") => (Target::Host, None),
        Some(name) => {
            let ordinal = match name {
                "cuda" => 0,
                other => other
                    .strip_prefix("cuda:")
                    .and_then(|n| n.parse::<u32>().ok())
                    .ok_or_else(|| invalid(format!("device {other:?}: expected \"cpu\", \"cuda\" or \"cuda:N\"")))?,
            };
            (Target::Gpu, Some(ordinal))
        }
    })
}

/// The plan `order`, `partitioner` and `partitioner_options` ask for; `None` when none of them
/// is given (the session's default).
pub(crate) fn plan_of(
    order: Option<&str>,
    partitioner: Option<String>,
    partitioner_options: Option<Vec<(String, String)>>,
) -> PyResult<Option<PlanSource>> {
    Ok(Some(match (order, partitioner) {
        (_, Some(plugin)) => PlanSource::Partitioner {
            plugin: if plugin == "default" { None } else { Some(plugin) },
            options: partitioner_options.unwrap_or_default(),
        },
        // Options alone are the default partitioner's (not dropped in silence).
        (None, None) if partitioner_options.is_some() => {
            PlanSource::Partitioner { plugin: None, options: partitioner_options.unwrap_or_default() }
        }
        (Some(order), None) if partitioner_options.is_some() => {
            return Err(invalid(format!(
                "partitioner_options are a partitioner's, and order={order:?} reads without one: \
                 drop order (the default partitioner takes them) or name a partitioner"
            )));
        }
        (None, None) => return Ok(None),
        (Some("shuffled"), None) => PlanSource::Native(Order::Shuffled),
        (Some("sequential"), None) => PlanSource::Native(Order::Sequential),
        (Some(other), None) => {
            return Err(invalid(format!("order {other:?}: expected \"shuffled\" or \"sequential\"")));
        }
    }))
}

/// The tier `tier`, `tier_bytes`, `tier_evictor` and its options ask for; what they leave
/// unsaid comes from the environment, as by default.
pub(crate) fn tier_of(
    tier: Option<&str>,
    tier_bytes: Option<u64>,
    tier_evictor: Option<String>,
    tier_evictor_options: Option<Vec<(String, String)>>,
) -> PyResult<TierSetting> {
    let tier_kind = tier
        .map(|name| {
            TierKind::parse(name).ok_or_else(|| {
                PyValueError::new_err(format!("tier must be \"page-cache\" or \"memory\", not {name:?}"))
            })
        })
        .transpose()?;
    Ok(match (tier_bytes, tier_kind.is_some() || tier_evictor.is_some() || tier_evictor_options.is_some()) {
        (None, false) => {
            // A bad GRANARY_TIER_BYTES is refused now, not at the first batch.
            TierConfig::from_env().map_err(to_py)?;
            TierSetting::Auto
        }
        (Some(0), _) => TierSetting::Off,
        // The kind, budget and evictor given; the rest from the environment, as by default.
        (bytes, _) => {
            let from_env = TierConfig::from_env().map_err(to_py)?;
            let kind = tier_kind.unwrap_or(from_env.kind);
            TierSetting::Config(TierConfig {
                kind,
                budget_bytes: bytes.or(from_env.budget_bytes),
                // A directory in the environment is the memory tier's.
                dir: if kind == TierKind::Memory { from_env.dir.clone() } else { None },
                keep: kind == TierKind::Memory && from_env.keep,
                evictor: tier_evictor.or(from_env.evictor.clone()),
                evictor_options: tier_evictor_options.unwrap_or_default(),
                ..from_env
            })
        }
    })
}

/// The I/O backend `io` (`None`, `"auto"`, `"uring"`, `"pread"`) names.
pub(crate) fn backend_of(io: Option<&str>) -> PyResult<granary::Backend> {
    Ok(match io {
        None | Some("auto") => granary::Backend::Auto,
        Some("uring") => granary::Backend::Uring,
        Some("pread") => granary::Backend::Pread,
        Some(other) => return Err(invalid(format!("io {other:?}: expected \"auto\", \"uring\" or \"pread\""))),
    })
}
