//! The tier's unit tests: file systems of directories, the names it owns, the extent size, the
//! last user's clean-up.

use super::dirs::fs_type_of;
use super::*;
use std::os::unix::fs::PermissionsExt;

#[test]
fn the_file_system_of_a_directory_is_its_deepest_mount_point() {
    let mounts = "/dev/vda / ext4 rw 0 0\n\
                  tmpfs /dev/shm tmpfs rw,nosuid 0 0\n\
                  /dev/vdb /data xfs rw 0 0\n\
                  tmpfs /data/fast\\040dir tmpfs rw 0 0\n";
    assert_eq!(fs_type_of(mounts, Path::new("/dev/shm/granary-tier-0")), Some("tmpfs"));
    assert_eq!(fs_type_of(mounts, Path::new("/data/tier")), Some("xfs"));
    assert_eq!(fs_type_of(mounts, Path::new("/data/fast dir/tier")), Some("tmpfs"));
    // Component-wise: /data-other is not under /data.
    assert_eq!(fs_type_of(mounts, Path::new("/data-other/tier")), Some("ext4"));
    assert_eq!(fs_type_of("", Path::new("/x")), None);
}

#[test]
fn names_are_the_tiers_own() {
    let shard = "ef".repeat(32);
    assert!(is_extent_name(&format!("{shard}.4096k.000012")));
    assert!(!is_extent_name(&format!("{shard}.000012")), "the size is part of the name");
    assert!(!is_extent_name(&format!("{}.4096k.000012", shard.to_uppercase())));
    assert!(!is_extent_name("notes.txt"));
    assert!(!is_extent_name(&format!("{shard}.4096k.000012.bak")));
    assert_eq!(claimed_extent(&format!(".new-12-3-{shard}.64k.000001")), Some(&*format!("{shard}.64k.000001")));
    assert_eq!(claimed_extent(&format!(".fill-{shard}.64k.000001")), Some(&*format!("{shard}.64k.000001")));
    assert_eq!(claimed_extent(".fill-notes.txt"), None);
}

#[test]
fn the_default_extent_keeps_a_tier_of_all_memory_within_the_mapping_limit() {
    let extent = default_extent_bytes();
    assert!(extent >= EXTENT_BYTES_DEFAULT && extent.is_power_of_two());
    assert!(Memory::read().total.div_ceil(extent) <= EXTENTS_MAX);
    let config = TierConfig {
        kind: TierKind::Memory,
        budget_bytes: Some(EXTENTS_MAX * (64 << 10) + 1),
        dir: Some(tempfile::tempdir().expect("tempdir").path().join("t")),
        extent_bytes: 64 << 10,
        ..TierConfig::default()
    };
    assert!(MemoryTier::open(&config).is_err(), "more extents than mappings allow");
}

#[test]
fn the_last_user_empties_the_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = TierConfig {
        kind: TierKind::Memory,
        budget_bytes: Some(1 << 30),
        dir: Some(dir.path().join("t")),
        ..TierConfig::default()
    };
    let first = MemoryTier::open(&config).expect("open").expect("on");
    let second = MemoryTier::open(&config).expect("open").expect("on");
    let extent = dir.path().join(format!("t/{}.4096k.000000", "ab".repeat(32)));
    std::fs::write(&extent, b"x").expect("write");
    drop(first);
    assert!(extent.exists(), "a user remains");
    drop(second);
    assert!(!extent.exists(), "the last user emptied it");
}

#[test]
fn a_directory_of_someone_elses_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let config =
        TierConfig { kind: TierKind::Memory, budget_bytes: Some(1 << 30), dir: Some(open), ..TierConfig::default() };
    assert!(MemoryTier::open(&config).is_err(), "a world-writable directory could hold forged extents");
}
