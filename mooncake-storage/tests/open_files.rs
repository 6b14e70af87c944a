//! The descriptors a tier holds are bounded by `max_open_files`, whatever the number
//! of files it reads. Alone in its test binary, so the process's descriptors are its
//! own. (Before the bound, every file ever read kept a descriptor: a large tier ran
//! the process out of them, and then offloads and loads failed with EMFILE.)

mod common;

use common::{test_root, value};
use mooncake_storage::*;

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn reading_many_files_holds_at_most_the_bound_of_descriptors() {
    const BOUND: usize = 16;
    const FILES: usize = 300;
    let dir = tempfile::tempdir_in(test_root()).unwrap();
    let b = FilePerKeyBackend::open(dir.path(), BackendOptions::default().with_max_open_files(BOUND)).unwrap();
    let keys: Vec<String> = (0..FILES).map(|i| format!("k{i}")).collect();
    for k in &keys {
        b.offload(k, &value(k, 4096)).unwrap();
    }
    let before = open_descriptors();
    for k in &keys {
        assert_eq!(b.load_vec(k).unwrap(), value(k, 4096));
    }
    let during = open_descriptors();
    assert!(during <= before + BOUND, "{before} descriptors before reading {FILES} files, {during} after");
    assert_eq!(b.stats().handles_closed as usize, FILES - BOUND);
}
