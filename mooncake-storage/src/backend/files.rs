//! Durable file operations the layouts share.

use std::io::Write;
use std::path::Path;

use crate::error::Result;

/// Writes `bytes` to `dir/name` atomically: a temporary file, fsync, rename, fsync
/// of the directory.
pub(super) fn write_file_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// fsync of a directory (makes renames and creations in it durable).
pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Removes a file durably: unlinks it ("not found" counts as removed), then syncs
/// its directory, so that the file cannot come back with a power loss.
pub(super) fn remove_file_durable(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Removes a file, ignoring "not found".
pub(super) fn remove_file_quiet(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
    }
}
