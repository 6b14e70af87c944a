//! The reference's three programs against our master: their call sequences replayed
//! here (with assertions where they only print), and the programs themselves, kept
//! unchanged in `examples/` and `tests/minimal_smoke.rs`, run as built.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{SystemTime, UNIX_EPOCH};

use mooncake_store::{codes, MooncakeStore, ReplicateConfig, StoreError};
use support::{bin, target_dir, Master};

fn unique(tag: &str) -> String {
    let ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{tag}-{}-{ns}", std::process::id())
}

/// `examples/basic_usage.rs`, step by step; its prints become assertions (every
/// step must take its `[OK]` branch).
#[test]
fn basic_usage_sequence() {
    let master = Master::start(&[]);
    let store = MooncakeStore::new().unwrap();
    store
        .setup(
            "localhost",
            "http://127.0.0.1:8080/metadata",
            512 << 20,
            128 << 20,
            "tcp",
            "",
            &master.addr,
        )
        .unwrap();
    let key = "example-key";
    let value = b"hello, mooncake!";
    store.put(key, value, None).unwrap();
    assert!(store.is_exist(key).unwrap());
    assert_eq!(store.get_size(key).unwrap(), value.len() as i64);
    assert_eq!(store.get(key).unwrap(), value);
    let config = ReplicateConfig {
        replica_num: 2,
        with_soft_pin: true,
        with_hard_pin: false,
        preferred_segments: vec!["seg-0".to_string()],
    };
    store
        .put("replicated-key", b"replicated value", Some(&config))
        .unwrap();
    store.remove(key, false).unwrap();
    store.remove("replicated-key", false).unwrap();
    match store.get_size("nonexistent") {
        Err(StoreError::OperationFailed(code)) => assert_eq!(code, codes::OBJECT_NOT_FOUND),
        other => panic!("{other:?}"),
    }
}

/// `examples/store_benchmark.rs` with small sizes.
#[test]
fn store_benchmark_sequence() {
    let (iterations, payload_size, warmup) = (16usize, 64 << 10, 2usize);
    let master = Master::start(&[]);
    let store = MooncakeStore::new().unwrap();
    store
        .setup(
            "localhost",
            "http://127.0.0.1:8080/metadata",
            64 << 20,
            16 << 20,
            "tcp",
            "",
            &master.addr,
        )
        .unwrap();
    store.health_check().unwrap();
    let prefix = unique("rust-bench");
    let payload: Vec<u8> = (0..payload_size).map(|i| (i % 251) as u8).collect();
    for i in 0..warmup {
        let key = format!("{prefix}-warmup-{i}");
        store.put(&key, &payload, None).unwrap();
        assert_eq!(store.get(&key).unwrap(), payload);
        store.remove(&key, true).unwrap();
    }
    let keys: Vec<String> = (0..iterations)
        .map(|i| format!("{prefix}-key-{i}"))
        .collect();
    for key in &keys {
        store.put(key, &payload, None).unwrap();
    }
    for key in &keys {
        assert_eq!(store.get(key).unwrap(), payload, "round trip of {key}");
    }
    for key in &keys {
        store.remove(key, true).unwrap();
    }
    assert_eq!(
        store
            .batch_is_exist(&keys.iter().map(String::as_str).collect::<Vec<_>>())
            .unwrap(),
        [false; 16]
    );
}

/// `tests/minimal_smoke.rs`'s `smoke_round_trip`, run unconditionally.
#[test]
fn minimal_smoke_sequence() {
    let master = Master::start(&[]);
    let store = MooncakeStore::new().unwrap();
    store
        .setup(
            "localhost",
            "http://127.0.0.1:8080/metadata",
            512 << 20,
            128 << 20,
            "tcp",
            "",
            &master.addr,
        )
        .unwrap();
    store.health_check().unwrap();
    let key = unique("rust-smoke");
    let value = format!("mooncake-rust-smoke-value-{key}").into_bytes();
    store.put(&key, &value, None).unwrap();
    assert!(store.is_exist(&key).unwrap());
    assert_eq!(store.get_size(&key).unwrap() as usize, value.len());
    assert_eq!(store.get(&key).unwrap(), value);
    assert!(!store.get_hostname().unwrap().is_empty());
    store.remove(&key, true).unwrap();
    assert!(!store.is_exist(&key).unwrap());
}

/// Output of a finished process, or a panic with it.
fn succeeded(what: &str, out: Output) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// The newest `target/<profile>/deps/{name}-{hash}{ext}`.
fn newest_in_deps(name: &str, ext: &str) -> Option<PathBuf> {
    std::fs::read_dir(target_dir().join("deps"))
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let file = p.file_name().and_then(|f| f.to_str()).unwrap_or("");
            let hash = file.strip_prefix(name).and_then(|r| r.strip_prefix('-'));
            let hash = hash.and_then(|r| r.strip_suffix(ext));
            hash.is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        })
        .max_by_key(|p| modified(p))
}

fn modified(path: &Path) -> Option<SystemTime> {
    path.metadata().and_then(|m| m.modified()).ok()
}

/// A program cargo built for this package: an example (`cargo test` builds them) or
/// the newest build of another test target.
fn built(kind: &str, name: &str) -> PathBuf {
    let path = match kind {
        "example" => target_dir().join("examples").join(name),
        _ => newest_in_deps(name, "").unwrap_or_default(),
    };
    assert!(
        path.is_file(),
        "the reference's {name} is not built next to this test: run `cargo test -p mooncake_store` \
         (it builds the examples and the test targets)"
    );
    // `cargo test --test reference_programs` alone does not rebuild the examples: a
    // program older than this crate's library would test old code.
    let lib = newest_in_deps("libmooncake_store", ".rlib");
    assert!(
        modified(&path) >= lib.as_deref().and_then(modified),
        "{} is older than the mooncake_store library: run `cargo test -p mooncake_store` \
         (it rebuilds it)",
        path.display()
    );
    path
}

/// The unchanged `store_benchmark` example and `minimal_smoke` test, as built,
/// against a master this test starts (both take its address from the environment).
#[test]
fn reference_benchmark_and_smoke_test_run_unchanged() {
    let master = Master::start(&[]);
    let env = [
        ("MC_RUST_STORE_MASTER_ADDR", master.addr.as_str()),
        ("MC_RUST_STORE_LOCAL_HOSTNAME", "127.0.0.1"),
        ("MC_RUST_STORE_PROTOCOL", "tcp"),
        ("MC_RUST_STORE_DEVICE_NAME", ""),
    ];
    let out = Command::new(built("example", "store_benchmark"))
        .envs(env)
        .envs([
            ("MC_RUST_BENCH_ITERATIONS", "16"),
            ("MC_RUST_BENCH_VALUE_SIZE", "65536"),
            ("MC_RUST_BENCH_WARMUP", "2"),
            ("MC_RUST_STORE_GLOBAL_SEGMENT_SIZE", "67108864"),
        ])
        .output()
        .unwrap();
    let (stdout, _) = succeeded("store_benchmark", out);
    assert!(
        stdout.contains("iterations=16") && stdout.contains("get_mib_per_sec="),
        "{stdout}"
    );

    let out = Command::new(built("test", "minimal_smoke"))
        .envs(env)
        .env("MC_RUST_STORE_RUN_INTEGRATION", "1")
        .args(["--exact", "smoke_round_trip", "--nocapture"])
        .output()
        .unwrap();
    let (stdout, stderr) = succeeded("minimal_smoke", out);
    assert!(stdout.contains("1 passed"), "{stdout}");
    assert!(
        !stderr.contains("skipping"),
        "the smoke test skipped itself:\n{stderr}"
    );
}

/// The unchanged `basic_usage` example. It connects to the fixed address
/// 127.0.0.1:50051 and exits 0 with `[SKIP]` when nothing answers there, so it runs
/// with a master in a network namespace of its own (`unshare -rn`), where that port
/// is free whatever else runs on this host, and every step must print `[OK]`.
#[test]
fn reference_basic_usage_runs_unchanged() {
    if !Command::new("unshare")
        .args(["-rn", "true"])
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("skipped: `unshare -rn` (user and network namespaces) is not available here");
        return;
    }
    let log = std::env::temp_dir().join(format!("{}.log", unique("mooncake-store-basic-usage")));
    let script = r#"
        ip link set lo up || exit 97
        "$1" --listen 127.0.0.1:50051 > "$3" 2>&1 &
        master=$!
        tries=0
        until grep -q listening "$3"; do
            tries=$((tries + 1))
            if [ "$tries" -gt 200 ]; then kill "$master"; exit 98; fi
            sleep 0.05
        done
        "$2"
        rc=$?
        kill "$master"
        wait "$master"
        exit "$rc"
    "#;
    let out = Command::new("unshare")
        .args(["-rn", "sh", "-c", script, "sh"])
        .args([
            bin("mooncake-master").as_path(),
            built("example", "basic_usage").as_path(),
            Path::new(&log),
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&log);
    let (stdout, stderr) = succeeded("basic_usage", out);
    assert!(
        stdout.contains("[OK] Store client set up."),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("=== Example completed successfully ==="),
        "{stdout}"
    );
    for bad in ["[FAIL]", "[WARN]", "[SKIP]"] {
        assert!(
            !stdout.contains(bad) && !stderr.contains(bad),
            "{bad} in:\n{stdout}\n{stderr}"
        );
    }
    assert_eq!(
        stdout.matches("[OK]").count(),
        10,
        "every step takes its [OK] branch:\n{stdout}"
    );
}
