//! The binaries' command lines (the multi-process behaviour is tested in the
//! workspace's `tests/` crate, which needs these binaries built).

use std::process::Command;

fn run(bin: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const CLIENT: &str = env!("CARGO_BIN_EXE_mooncake-client");
const MASTER: &str = env!("CARGO_BIN_EXE_mooncake-master");

#[test]
fn help_lists_the_commands_and_flags_of_the_design() {
    let (code, out, _) = run(CLIENT, &["--help"]);
    assert_eq!(code, 0);
    for cmd in ["serve", "put", "get", "rm", "stat", "ls"] {
        assert!(out.contains(cmd), "client help lacks {cmd}: {out}");
    }
    let (code, out, _) = run(CLIENT, &["serve", "--help"]);
    assert_eq!(code, 0);
    for flag in ["--master", "--listen", "--segment-size", "--ssd-dir", "--ssd-capacity"] {
        assert!(out.contains(flag), "serve help lacks {flag}");
    }
    let (code, out, _) = run(MASTER, &["--help"]);
    assert_eq!(code, 0);
    for flag in ["--listen", "--metrics-listen", "--allocation-strategy", "--default-lease-ms", "--client-ttl-ms"] {
        assert!(out.contains(flag), "master help lacks {flag}");
    }
}

#[test]
fn bad_sizes_and_strategies_are_refused_with_one_line() {
    let (code, _, err) =
        run(CLIENT, &["serve", "--master", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--segment-size", "12parsecs"]);
    assert_eq!(code, 2, "clap usage errors exit 2");
    assert!(err.contains("bad size"), "{err}");
    let (code, _, err) = run(MASTER, &["--allocation-strategy", "best_guess"]);
    assert_ne!(code, 0);
    assert!(err.contains("best_guess"), "{err}");
}

#[test]
fn one_shot_commands_report_an_unreachable_master_on_one_line() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let (code, _, err) = run(CLIENT, &["ls", "--master", &addr]);
    assert_eq!(code, 1);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.starts_with("master unavailable"), "{err}");
}

#[test]
fn sizes_parse_like_the_design_says() {
    use mooncake_core::parse_size;
    assert_eq!(parse_size("4096").unwrap(), 4096);
    assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
    assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
    assert_eq!(parse_size("2K").unwrap(), 2048);
    assert_eq!(parse_size("1TiB").unwrap(), 1 << 40);
    for bad in ["", "MiB", "-1", "1.5GiB", "99999999999999999999", "17179869184TiB", "4 GiBs"] {
        assert!(parse_size(bad).is_err(), "{bad:?} must be refused");
    }
}
